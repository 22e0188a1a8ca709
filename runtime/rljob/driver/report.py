"""What a step and a run tell the user: one row of metrics.jsonl, the trackers and the
RLJob's `status.progress` per step; the summary a finished run prints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rljob.cluster.rollout_pipeline import RolloutBatch, Staleness
from rljob.driver.job import Job
from rljob.reporting import metrics_log
from rljob.trainer.metrics import TrainMetrics
from rljob_api import exits
from rljob_api.status import Progress, timestamp


@dataclass(frozen=True)
class StepTimes:
    rollout_wait: float  # waiting for the step's batch
    train: float  # offload turns and training
    step: float  # the whole step


def step_row(job: Job, metrics: TrainMetrics, batch: RolloutBatch, staleness: Staleness,
             times: StepTimes, evaluation: dict[str, float]) -> dict[str, Any]:
    """The step's metrics.jsonl row (docs/algorithms.md lists its figures)."""
    state = job.state
    row: dict[str, Any] = {
        "step": state.step,
        **metrics.row(),
        **batch.stats.row(),  # seconds, tokens/s, generation rounds, dynamic sampling's counts
        "rollout_wait_seconds": times.rollout_wait,
        "staleness_mean": staleness.mean, "staleness_max": float(staleness.max),
    }
    if job.max_staleness is not None:
        row["stale_samples"] = float(staleness.over_bound)
    if job.recovery is not None:
        row["engines_ready"] = float(job.recovery.ready())
        row["engines_total"] = float(job.recovery.total())
    row.update({
        "train_seconds": times.train,
        "step_seconds": times.step,
        "weight_version": job.engine_version,
        "policy_version": state.weight_version,
        "total_skipped_steps": state.skipped_steps,
        **evaluation,
    })
    return row


def report_step(job: Job, metrics: TrainMetrics, batch: RolloutBatch, staleness: Staleness,
                times: StepTimes, evaluation: dict[str, float]) -> None:
    """One finished step into metrics.jsonl, the trackers and the RLJob's status.progress."""
    state, stats = job.state, batch.stats
    row = step_row(job, metrics, batch, staleness, times, evaluation)
    # A driver left behind by a restart (a partitioned node) learns here that another
    # took the store over, and stops before it writes metrics or status again.
    job.attempt.checkpoints.check_writer()
    metrics_log.append(job.metrics_path, row)
    job.attempt.tracking.log(row)
    job.attempt.reporter.progress(Progress(
        attempt=job.attempt.number, rollout_step=state.step, train_step=state.train_step,
        total_steps=job.spec.algorithm.total_steps, samples=state.samples,
        mean_reward=metrics.reward, tokens_per_second=stats.tokens_per_second,
        weight_version=job.engine_version, skipped_steps=state.skipped_steps,
        policy_version=state.weight_version, staleness_mean=staleness.mean,
        staleness_max=staleness.max,
        filtered_groups=(None if stats.filtered_groups is None
                         else int(stats.filtered_groups)),
        logprob_gap=metrics.logprob_gap, updated_at=timestamp(),
        eval_reward=job.last_eval[1] if job.last_eval else None,
        eval_step=job.last_eval[0] if job.last_eval else None))


def summary(job: Job, rows: list[dict[str, Any]], seconds: float, code: int) -> str:
    rewards = [float(r["reward"]) for r in rows if isinstance(r.get("reward"), int | float)]
    head = rewards[:5]
    tail = rewards[-5:]
    latest = job.attempt.checkpoints.latest()
    state = job.state
    lines = [
        "done" if code == exits.OK else
        "interrupted; state saved" if code == exits.INTERRUPTED else
        f"stopped by {job.attempt.stop.name}; state saved",
        f"  steps        {state.step}/{job.spec.algorithm.total_steps} "
        f"({state.train_step} optimizer steps, {state.skipped_steps} skipped)",
    ]
    if rewards:
        lines.append(f"  mean reward  first {len(head)} steps {np.mean(head):.3f} → "
                     f"last {len(tail)} steps {np.mean(tail):.3f}")
    lines += [
        f"  wall time    {seconds:.1f}s this run",
        f"  checkpoint   {latest.path if latest else '-'}",
        f"  metrics      {job.metrics_path}",
        f"  curves       {job.workdir / metrics_log.PLOT_FILE}",
    ]
    lines += [f"  {field:<12} {outcome}"
              for field, outcome in job.attempt.tracking.outcome.items()]
    return "\n".join(lines)
