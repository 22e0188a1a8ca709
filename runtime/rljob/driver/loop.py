"""The loop, slime-style: rollout batch → (offload turn) → train → non-finite guard → advance
→ weights to the engines → maybe evaluate → report → maybe save."""

from __future__ import annotations

import time

from rljob.driver.job import Job
from rljob.driver.report import StepTimes, report_step
from rljob.reporting.progress_bar import ProgressBar


def train(job: Job) -> None:
    """Run steps until the attempt's end or a stop; the last step reached is saved. A first
    signal from here on lets the step in progress finish and be saved."""
    state, trainers = job.state, job.roles.trainers
    end = job.end_step()
    saved_at = state.step if job.resumed else -1
    bar = ProgressBar(state.step, end)
    job.attempt.loop_started = True
    with job.attempt.stop.deferred():
        while state.step < end and not job.attempt.stop.requested:
            t0 = time.monotonic()
            job.trainers_leave_gpus()
            job.attempt.startup.finish()  # the first batch is asked for next
            batch, staleness = job.take_batch()
            t1 = time.monotonic()
            job.launch_next_batch()
            job.engines_leave_gpus()
            metrics = trainers.train(batch.samples, check_initial_kl=state.step == 0)
            weights_kept = job.engines_return()
            t2 = time.monotonic()
            state.count_train(metrics)
            job.stop_if_nonfinite(metrics, batch.samples)
            state.advance(metrics, len(batch.samples))
            job.weights_after_step(metrics, weights_kept)
            times = StepTimes(t1 - t0, t2 - t1, time.monotonic() - t0)
            report_step(job, metrics, batch, staleness, times, job.evaluate_if_due())
            bar.update(state.step, metrics.reward, batch.stats.tokens_per_second)
            if job.save_due(end):
                job.save()
                saved_at = state.step
        bar.close()
        if saved_at != state.step:
            job.save()
