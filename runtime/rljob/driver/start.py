"""Everything before the first step, in order: the store taken, the workers placed, the state
resumed, weight sync joined and the engines given the trainer's weights."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from rljob.checkpoint.store import Verified
from rljob.cluster.engine_recovery import EngineRecovery
from rljob.cluster.placement import plan
from rljob.cluster.weight_sync import SyncSettings
from rljob.driver.attempt import Attempt
from rljob.driver.job import Job
from rljob.driver.model_files import import_writer_if_needed, prepare_model
from rljob.driver.state import LoopState
from rljob.reporting import metrics_log
from rljob.reporting.tracking import Trackers
from rljob.trainer.select import import_backend
from rljob_api import env, exits
from rljob_api.exits import JobError
from rljob_api.spec import RLJobSpec, RolloutMode
from rljob_api.status import Progress, ResumeReport, timestamp

ENGINE_JOIN_TIMEOUT_S = 300.0


def _import_for_start(spec: RLJobSpec) -> None:
    import_backend(spec)
    import_writer_if_needed(spec)


def start(attempt: Attempt) -> Job:
    spec, options, cluster = attempt.spec, attempt.options, attempt.cluster
    try:  # set by the operator on a cluster; defaults for `rljob run` on one machine
        settings = SyncSettings.from_env(os.environ)
    except ValueError as err:
        raise JobError(exits.INVALID, str(err)) from None
    options.workdir.mkdir(parents=True, exist_ok=True)
    # Ray first, on a cluster and on one machine alike: its processes take seconds to start,
    # mostly importing, and meanwhile a thread of this driver imports what it places workers
    # with (torch; transformers too when the tiny model must be built: seconds either way).
    # A daemon thread: a signal meanwhile stops the run without waiting for it.
    imported = threading.Thread(target=_import_for_start, args=(spec,), name="imports",
                                daemon=True)
    imported.start()
    cluster.start_ray(plan(spec))
    if options.join:
        # A driver left behind by a restart is stopped through Ray before this one waits
        # for the store it holds.
        cluster.stop_stale_drivers()
    imported.join()
    attempt.checkpoints.take()
    model_dir = prepare_model(spec, options.workdir)  # once this driver is the writer
    attempt.startup.mark("model files")
    # Where this attempt starts, in the status at once: placing the workers (pulling images,
    # loading SGLang) can take minutes, while STEP would still show a lost attempt's step.
    _, start_state = attempt.checkpoints.resume_point()
    # Rows after the step this attempt starts from are redone (none, with no checkpoint:
    # an attempt that failed before its first checkpoint leaves nothing to report).
    metrics_path = options.workdir / metrics_log.METRICS_FILE
    metrics_log.keep_until(metrics_path, start_state.step)
    last_eval = metrics_log.last_eval(metrics_path)
    report_resumed_progress(attempt, start_state, metrics_path, last_eval)
    roles = cluster.place(spec, model_dir, settings)
    resumed = attempt.checkpoints.resume(roles.trainers, roles.rollout)
    loaded, state = resumed if resumed is not None else (None, LoopState())
    if loaded is not None:
        print(f"resumed from {loaded.path} (step {loaded.step}, weight version "
              f"{state.weight_version})", file=sys.stderr, flush=True)
    report_resume(attempt, loaded, state.step)
    attempt.tracking = Trackers.start(
        spec.tracking, attempt.name, options.workdir, first_step=state.step,
        attempt=attempt.number,
        config=spec.model_dump(by_alias=True, mode="json"))
    # The store (on the Ray head, or in this process on one machine) and a sidecar per
    # engine are placed; trainer rank 0 joins as the publisher, versions continuing from the
    # checkpoint.
    store = cluster.store_address()
    # Every actor exists now: show where, before waiting on anything they must do.
    cluster.report_placement(spec, roles)
    roles.trainers.set_publisher(store, str(options.workdir / "weights"),
                                 state.weight_version, roles.devices.sync_on_gpu)
    try:
        roles.trainers.wait_for_engines(len(roles.engines), ENGINE_JOIN_TIMEOUT_S)
    except TimeoutError as err:
        check = cluster.check_sidecars()
        lost = check.dead or check.restarted
        raise JobError(exits.FAILED, ("WeightSyncSidecarLost" if lost else
                                      "WeightSyncFailed") + f": {err}; every engine "
                       "needs its weight-sync sidecar" + (f"; {check.describe()}"
                                                          if lost else "")) from None
    # Which sidecar incarnations the engines start with: a later one is a sidecar restarted.
    check = cluster.check_sidecars()
    if check.dead:
        raise JobError(exits.FAILED, f"WeightSyncSidecarLost: {check.describe()}")
    job = Job(attempt, roles, state, resumed=loaded is not None,
              max_staleness=((spec.rollout.max_staleness or 1)
                             if spec.rollout.mode == RolloutMode.async_ else None),
              engine_version=0, last_eval=last_eval)
    attempt.job = job
    if spec.replaces_engines() and not roles.offload and cluster.weight_sync is not None:
        job.recovery = EngineRecovery(
            roles.engines, cluster.weight_sync, roles.trainers, roles.rollout.rollout,
            attempt.reporter, spec.recovery, attempt.number)
        roles.rollout.tend = job.tend_engines
    job.publish()
    attempt.startup.mark("first weights")
    return job


def report_resumed_progress(attempt: Attempt, state: LoopState, metrics_path: Path,
                            last_eval: tuple[int, float] | None) -> None:
    """Show the step this attempt starts from (the checkpoint it resumes, or 0) at once:
    until its first step, the progress in the RLJob (the STEP column) would otherwise keep
    the step a lost attempt reached, steps the job no longer has. The reward is that step's,
    from the metrics log kept up to it (none without a row for it), the latest evaluation
    the log holds."""
    rows = metrics_log.read(metrics_path)
    last = rows[-1] if rows and int(rows[-1]["step"]) == state.step else {}
    reward = last.get("reward")
    attempt.reporter.progress(Progress(
        attempt=attempt.number, rollout_step=state.step, train_step=state.train_step,
        total_steps=attempt.spec.algorithm.total_steps, samples=state.samples,
        mean_reward=float(reward) if isinstance(reward, int | float) else None,
        weight_version=state.weight_version, skipped_steps=state.skipped_steps,
        policy_version=state.weight_version, updated_at=timestamp(),
        eval_reward=last_eval[1] if last_eval else None,
        eval_step=last_eval[0] if last_eval else None))


def report_resume(attempt: Attempt, loaded: Verified | None, step: int) -> None:
    """Tell the RLJob what this attempt loaded (the operator derives resumedFromStep and
    lostSteps from it): the checkpoint's step, path and verified manifest digest, or that
    there was none and the attempt starts at step 0."""
    attempt.reporter.resumed(ResumeReport(
        attempt=attempt.number, found=loaded is not None,
        step=step, path=str(loaded.path) if loaded else None,
        checksum=loaded.checksum if loaded else None, at=timestamp(),
        driver_pod_uid=os.environ.get(env.POD_UID) or None))
