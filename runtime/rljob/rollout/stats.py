"""The rollout worker's records: `RolloutStats` (figures of one step's batch) and
`EvalResult` (one evaluation).

The loop reads the typed fields it acts on or reports in status (tokens/s, filtered
groups); metrics.jsonl gets every figure that applies to the job's options (`row()`), so a
figure an option does not produce is absent, not zero (None here).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class RolloutStats:
    rollout_seconds: float
    response_tokens: float
    tokens_per_second: float  # of tokens generated in this step (not carried ones)
    generation_rounds: float
    generated_groups: float
    # requests sent again to another engine after theirs was lost
    reissued_requests: float = 0.0
    # dynamic sampling
    filtered_groups: float | None = None  # zero-variance groups set aside
    filtered_groups_kept: float | None = None  # of them, used to fill a short batch
    # partial rollout
    partial_groups_carried: float | None = None  # to the next step
    partial_groups_resumed: float | None = None  # from the last step
    partial_tokens_resumed: float | None = None
    stale_groups_dropped: float | None = None  # async: carried groups past the bound
    masked_off_policy_tokens: float | None = None

    def row(self) -> dict[str, float]:
        """The figures metrics.jsonl reports for the step's rollout, by field name."""
        return {f.name: value for f in fields(self)
                if (value := getattr(self, f.name)) is not None}


@dataclass(frozen=True)
class EvalResult:
    """One evaluation over the held-out prompts (spec.eval)."""

    reward: float  # mean reward over every eval sample
    best_reward: float  # mean over prompts of the best sample's reward (pass@n for 0/1 rewards)
    prompts: int
    samples_per_prompt: int
    aborted: int  # samples the generate function aborted; each scored 0
    seconds: float

    def metrics(self) -> dict[str, float]:
        """The metrics.jsonl figures: `eval_reward_max` only when there is a best of several,
        `eval_aborted` only when a sample was aborted."""
        row = {"eval_reward": self.reward, "eval_seconds": self.seconds}
        if self.samples_per_prompt > 1:
            row["eval_reward_max"] = self.best_reward
        if self.aborted:
            row["eval_aborted"] = float(self.aborted)
        return row
