"""`TrainMetrics`: what one rollout step of training reports, the same for every backend.

The loop reads its typed fields (reward, optimizer steps, skipped steps and why); reporting
writes `row()` into metrics.jsonl and the trackers. It is also a read-only mapping of those
reported figures by name, so a figure is read the way metrics.jsonl names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rljob.reporting.figures import Figures


@dataclass(frozen=True)
class TrainMetrics(Figures):
    step_means: dict[str, float]  # loss, pg_loss, kl_loss, entropy, clipfrac, grad_norm, ...
    reward: float
    kl: float  # to the reference, per response token
    logprob_gap: float  # |rollout − trainer| log-prob per response token: mean ...
    logprob_gap_max: float  # ... and largest (a mean hides one token scored very differently)
    response_length: float
    step_skipped: list[bool]  # per optimizer step: skipped for non-finite loss or gradients
    nonfinite: list[str] = field(default_factory=list)  # why each skipped step was skipped
    tis_weight: float | None = None  # with truncated IS: mean weight ...
    tis_truncated: float | None = None  # ... and the share of tokens the cap truncated

    @property
    def optimizer_steps(self) -> int:
        return self.step_skipped.count(False)

    @property
    def skipped_steps(self) -> int:
        return self.step_skipped.count(True)

    def row(self) -> dict[str, float]:
        """The figures metrics.jsonl reports for the step's training."""
        out = dict(self.step_means)
        if self.tis_weight is not None and self.tis_truncated is not None:
            out["tis_weight"] = self.tis_weight
            out["tis_truncated"] = self.tis_truncated
        out.update({
            "reward": self.reward, "kl": self.kl, "logprob_gap": self.logprob_gap,
            "logprob_gap_max": self.logprob_gap_max, "response_length": self.response_length,
            "optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps,
        })
        return out
