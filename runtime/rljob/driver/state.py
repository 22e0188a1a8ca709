"""`LoopState`: where the loop is. Saved in every checkpoint (`state.json`) and read back on
resume, so its fields are the whole of what the loop counts."""

from __future__ import annotations

from dataclasses import dataclass

from rljob.trainer.metrics import TrainMetrics


@dataclass
class LoopState:
    step: int = 0  # rollout steps completed
    train_step: int = 0
    samples: int = 0
    weight_version: int = 0
    skipped_steps: int = 0
    consecutive_nonfinite: int = 0

    def count_train(self, metrics: TrainMetrics) -> None:
        """Add one rollout step's optimizer steps, taken and skipped (non-finite)."""
        for skipped in metrics.step_skipped:
            self.consecutive_nonfinite = self.consecutive_nonfinite + 1 if skipped else 0
        self.skipped_steps += metrics.skipped_steps
        self.train_step += metrics.optimizer_steps

    def advance(self, metrics: TrainMetrics, samples: int) -> None:
        """One rollout step done: its samples counted, and a new weight version when the
        step changed the weights."""
        self.step += 1
        self.samples += samples
        if metrics.optimizer_steps:
            self.weight_version += 1
