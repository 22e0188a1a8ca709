"""What training reports, the same for every backend.

A backend reports each optimizer step as a `StepFigures`; `rljob.trainer.batch.rollout_summary`
turns one rollout step's into its `TrainMetrics`. The loop reads TrainMetrics' typed fields
(reward, optimizer steps, skipped steps and why); reporting writes `row()` into metrics.jsonl
and the trackers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class OptimizerFigures:
    """The figures of an optimizer step, by their metrics.jsonl names: each loss term a token
    mean over the step's slice, and the policy's gradient norm before clipping."""

    loss: float
    pg_loss: float
    kl_loss: float
    entropy: float
    clipfrac: float
    value_loss: float  # of the critic; 0 without one
    grad_norm: float

    @staticmethod
    def mean(steps: Sequence[OptimizerFigures]) -> OptimizerFigures:
        """Each figure's mean over `steps` (NaN when a skipped step's is)."""
        return OptimizerFigures(**{name: sum(getattr(s, name) for s in steps) / len(steps)
                                   for name in FIGURES})

    def row(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FIGURES}


FIGURES = tuple(f.name for f in fields(OptimizerFigures))


@dataclass(frozen=True)
class StepFigures(OptimizerFigures):
    """One optimizer step as a backend reports it. `skipped`: its loss or gradient norm was
    non-finite and nothing was applied (the figures are then what was measured, or NaN)."""

    skipped: bool


@dataclass(frozen=True)
class TrainMetrics:
    step_means: OptimizerFigures  # over the rollout step's optimizer steps
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
        out = self.step_means.row()
        if self.tis_weight is not None and self.tis_truncated is not None:
            out["tis_weight"] = self.tis_weight
            out["tis_truncated"] = self.tis_truncated
        out.update({
            "reward": self.reward, "kl": self.kl, "logprob_gap": self.logprob_gap,
            "logprob_gap_max": self.logprob_gap_max, "response_length": self.response_length,
            "optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps,
        })
        return out
