"""The slime-style loop: generate → reward → train → publish weights → checkpoint.

The driver owns no model and runs no user code: `rljob.cluster.cluster` places the workers, and the
loop here moves samples from the rollout worker to the trainer ranks, decides when to
publish and save (`rljob.driver.checkpoints`), and reports. Every way a run ends is an exit code
(`rljob_api.exits`) and, for a failure or a stop, a status the operator acts on.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from rljob.checkpoint.store import CheckpointConflict, LeaseLost, Verified
from rljob.cluster.cluster import Cluster, RunOptions, attempt_number
from rljob.cluster.placement import plan
from rljob.cluster.rollout_pipeline import RolloutPipeline, Staleness
from rljob.cluster.weight_sync import SyncSettings, WeightSyncActors
from rljob.driver.checkpoints import Checkpoints, LoopState
from rljob.driver.model_files import prepare_model
from rljob.driver.stop import StopSignals
from rljob.reporting import metrics_log
from rljob.reporting.progress_bar import ProgressBar
from rljob.reporting.reporter import Reporter
from rljob.reporting.tracking import Trackers
from rljob.weightsync.publisher import NonFiniteWeights
from rljob_api import env, exits
from rljob_api.exits import JobError
from rljob_api.spec import RLJobSpec, RolloutMode
from rljob_api.status import Progress, ResumeReport, RuntimeFailure, RuntimeStop, timestamp

WEIGHT_SYNC_LOG = "weight_sync.jsonl"
EVIDENCE_DIR = "nonfinite"
ENGINE_JOIN_TIMEOUT_S = 300.0
# How long a failed attempt waits for Ray to say whether a node of it died: Ray's GCS marks a
# node dead at once when its raylet exits, and after its health checks fail (about 15-30 s
# with Ray's defaults) when the node's host vanished.
NODE_DEATH_WAIT_S = 45.0


class Job:
    def __init__(self, name: str, spec: RLJobSpec, options: RunOptions, reporter: Reporter):
        self.name = name
        self.spec = spec
        self.options = options
        self.reporter = reporter
        self.workdir = options.workdir
        self.checkpoints = Checkpoints(self.workdir / "checkpoints", spec.checkpoint.keep_last,
                                       attempt_number(dict(os.environ)), reporter)
        self.metrics_path = self.workdir / metrics_log.METRICS_FILE
        self.state = LoopState()
        self.stop = StopSignals()
        self.cluster = Cluster(options, self.stop)
        self.workers = self.cluster.workers
        self.batches: RolloutPipeline
        self.sync_settings = SyncSettings()
        self.weight_sync = WeightSyncActors(self.sync_settings)
        self.loop_started = False
        self.tracking = Trackers()
        # Async (rljob.cluster.rollout_pipeline): the next batch generates while the trainer trains,
        # and a trained sample may lag the policy by this many versions; None in sync mode.
        self.max_staleness: int | None = (
            (spec.rollout.max_staleness or 1) if spec.rollout.mode == RolloutMode.async_
            else None)
        self.engine_version = 0  # the weight version the engines serve
        # (rollout step, eval reward) of the latest evaluation, reported with every step
        self.last_eval: tuple[int, float] | None = None
        self.last_eval_read = False  # whether metrics.jsonl was read for an earlier eval

    # ---- the loop ----------------------------------------------------------------------

    def run(self) -> int:
        resumed = self.start()
        end = self.spec.algorithm.total_steps
        if self.options.max_steps is not None:
            end = min(end, self.state.step + self.options.max_steps)
        saved_at = self.state.step if resumed else -1
        bar = ProgressBar(self.state.step, end)
        started = time.monotonic()
        # A first signal from here on lets the step in progress finish and be saved.
        self.loop_started = True
        with self.stop.deferred():
            while self.state.step < end and not self.stop.requested:
                self.one_step(bar)
                if self.state.step % self.spec.checkpoint.interval == 0 or self.state.step == end:
                    self.save()
                    saved_at = self.state.step
            bar.close()
            if saved_at != self.state.step:
                self.save()
        code = exits.OK
        if self.stop.requested and self.state.step < end:  # stopped before its end: not done
            code = exits.for_signal(self.stop.signum or 0)
            self.report_stop(aborted=False)
        rows = metrics_log.read(self.metrics_path)
        if rows:
            metrics_log.plot(rows, self.workdir / metrics_log.PLOT_FILE)
        self.tracking.close(code)  # before the summary, which says what each one wrote
        self.summary(rows, time.monotonic() - started, code)
        return code

    def one_step(self, bar: ProgressBar) -> None:
        w, state = self.workers, self.state
        t0 = time.monotonic()
        if w.offload:  # the trainers' parameters, gradients and optimizer state leave
            w.trainers.offload()
        bound = self.max_staleness
        # rewarded samples; a batch generated now is trained at the trainer's version now
        algo = self.spec.algorithm
        batch = self.batches.take(state.step, self.engine_version,
                                  None if bound is None else state.weight_version - bound,
                                  algo.rollout_batch_size * algo.n_samples_per_prompt)
        t1 = time.monotonic()
        if bound is not None and state.step + 1 < algo.total_steps:
            # The next batch is trained after this step's update (one version on): the
            # engines get the newest weights first if it would lag more than the bound.
            # Started at the last step of a --max-steps run too: the checkpoint keeps it and
            # the resumed run trains on it (a stop cancels it instead).
            if state.weight_version + 1 - self.engine_version > bound:
                self.publish()
            self.batches.launch(state.step + 1, self.engine_version,
                                state.weight_version + 1 - bound)
        if w.offload:  # the engines' weights and caches leave; the trainers come back
            w.release_engines()
        samples = batch.samples
        staleness = Staleness.of(batch, state.weight_version, bound)
        m = w.trainers.train(samples, check_initial_kl=state.step == 0)  # log-probs, steps
        weights_kept = w.resume_engines() if w.offload else True
        t2 = time.monotonic()
        state.count_train(m)
        self.stop_if_nonfinite(m, samples)
        state.step += 1
        state.samples += len(samples)
        if m["optimizer_steps"]:
            state.weight_version += 1
            if bound is None or state.step == algo.total_steps:
                self.publish()  # async: at the start of the next step, if due
        elif not weights_kept:  # SGLang dropped its released weights: the same version again
            self.publish(again=True)
        rollout = {**batch.stats, "rollout_wait_seconds": t1 - t0,
                   "staleness_mean": staleness.mean, "staleness_max": float(staleness.max)}
        if bound is not None:
            rollout["stale_samples"] = float(staleness.over_bound)
        self.report(m, rollout, train_seconds=t2 - t1, step_seconds=time.monotonic() - t0)
        bar.update(state.step, m["reward"], rollout["tokens_per_second"])

    # ---- start-up ----------------------------------------------------------------------

    def start(self) -> bool:
        """Everything before the first step: the store taken, the workers placed, the state
        resumed, weight sync joined and the engines given the trainer's weights. True when
        the run resumed from a checkpoint."""
        try:  # set by the operator on a cluster; defaults for `rljob run` on one machine
            self.sync_settings = SyncSettings.from_env(os.environ)
        except ValueError as err:
            raise JobError(exits.INVALID, str(err)) from None
        self.weight_sync = WeightSyncActors(self.sync_settings)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.options.join:
            # On a cluster this driver's Ray node comes first: a driver left behind by a
            # restart is stopped through Ray before this one waits for the store it holds.
            self.cluster.start_ray(plan(self.spec))
            self.cluster.stop_stale_drivers()
        self.checkpoints.take()
        model_dir = prepare_model(self.spec, self.workdir)
        self.cluster.place(self.spec, model_dir, self.sync_settings.engine_port)
        self.batches = RolloutPipeline(self.workers.rollout)
        resumed = self.checkpoints.resume(self.workers.trainers, self.batches)
        loaded: Verified | None = None
        # Rows after the step this attempt starts from are redone (none, with no checkpoint:
        # an attempt that failed before its first checkpoint leaves nothing to report).
        metrics_log.keep_until(self.metrics_path, resumed[1].step if resumed else 0)
        if resumed is not None:
            loaded, self.state = resumed
            print(f"resumed from {loaded.path} (step {loaded.step}, weight version "
                  f"{self.state.weight_version})", file=sys.stderr, flush=True)
        self.report_resume(loaded)
        self.tracking = Trackers.start(
            self.spec.tracking, self.name, self.workdir, first_step=self.state.step,
            attempt=attempt_number(dict(os.environ)),
            config=self.spec.model_dump(by_alias=True, mode="json"))
        self.start_weight_sync()
        self.publish()
        return loaded is not None

    def start_weight_sync(self) -> None:
        """The store on the Ray head, a sidecar per engine (unless the pods run them), and
        trainer rank 0 joined as the publisher; versions continue from the checkpoint."""
        w = self.workers
        store = self.weight_sync.start_store()
        self.weight_sync.start_sidecars(w.engines, w.urls, store,
                                        loopback=not self.options.on_cluster,
                                        placement=self.cluster.engine_placement(self.spec),
                                        sync_on_gpu=w.devices.sync_on_gpu)
        # Every actor exists now: show where, before waiting on anything they must do.
        self.cluster.report_placement(self.spec, self.weight_sync)
        w.trainers.set_publisher(store, str(self.workdir / "weights"), self.state.weight_version,
                                 w.devices.sync_on_gpu)
        try:
            w.trainers.wait_for_engines(len(w.engines), ENGINE_JOIN_TIMEOUT_S)
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, TimeoutError):
                raise JobError(exits.FAILED, f"WeightSyncFailed: {err.cause}; every "
                               "engine needs its weight-sync sidecar (in a pod: a weight-sync "
                               "container)") from None
            raise

    # ---- the steps' parts --------------------------------------------------------------

    def save(self) -> Verified:
        w = self.workers
        return self.checkpoints.save(self.state, w.trainers, self.batches,
                                     hf_export=self.spec.checkpoint.format == "hf",
                                     stopping=self.stop.requested)

    def stop_if_nonfinite(self, m: dict[str, Any], samples: list[dict[str, Any]]) -> None:
        """Stop (not retryable, evidence kept) after too many skipped optimizer steps in a row
        or when a weight became NaN/Inf: nothing non-finite reaches the engines."""
        limit = self.spec.algorithm.max_consecutive_nonfinite
        if self.state.consecutive_nonfinite >= limit:
            reasons = "; ".join(m["nonfinite"])
            where = self.save_evidence(samples, reasons)
            message = (f"{self.state.consecutive_nonfinite} optimizer steps in a row had "
                       f"non-finite loss or gradients ({reasons}); batch and state saved in "
                       f"{where}")
            self.fail("NonFiniteLoss", message, retryable=False)
            raise JobError(exits.NONFINITE, f"NonFiniteLoss: {message}")
        bad = self.workers.trainers.nonfinite_weights()
        if bad:
            where = self.save_evidence(samples, f"non-finite weights {bad[:5]}")
            message = f"weights became non-finite ({', '.join(bad[:5])}); not sent to engines; " \
                      f"evidence in {where}"
            self.fail("NonFiniteWeights", message, retryable=False)
            raise JobError(exits.NONFINITE, f"NonFiniteWeights: {message}")

    def save_evidence(self, samples: list[dict[str, Any]], reason: str) -> Path:
        return self.checkpoints.save_evidence(self.workdir / EVIDENCE_DIR, self.state,
                                              self.workers.trainers, samples, reason)

    def publish(self, again: bool = False) -> None:
        """Deliver `state.weight_version` to every engine, or stop the run.

        Engines that reject a version keep serving the previous one and are resynced by
        the publisher within the deadline; one still stale after that fails the run
        (retryable: a restart resyncs every engine from the checkpoint). `again` sends the
        version to engines that already had it (they dropped their weights).
        """
        version = self.state.weight_version
        try:
            result = self.workers.trainers.publish(version, again)
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, NonFiniteWeights):
                message = f"{err.cause}; nothing was sent to the engines"
                self.checkpoints.check_writer()  # one left behind reports no terminal failure
                self.fail("NonFiniteWeights", message, retryable=False)
                raise JobError(exits.NONFINITE, f"NonFiniteWeights: {message}") from None
            raise
        metrics_log.append(self.workdir / WEIGHT_SYNC_LOG, {
            "version": result.version, "acked": result.acked, "stale": result.stale,
            "attempts": result.attempts, "seconds": result.seconds,
            "bytes_per_engine": result.bytes_per_engine, "rejections": list(result.rejections),
        })
        for rejection in result.rejections:
            print(f"weight sync: version {version}: {rejection}", file=sys.stderr, flush=True)
        if result.stale:
            reasons = "; ".join(f"{name}: {why}" for name, why in sorted(result.stale.items()))
            raise JobError(exits.FAILED, f"WeightSyncFailed: engines did not install "
                           f"weight version {version}: {reasons}")
        self.engine_version = version

    def report(self, m: dict[str, Any], rollout: dict[str, Any], train_seconds: float,
               step_seconds: float) -> None:
        """One finished step into metrics.jsonl, the trackers and the RLJob's status.progress."""
        state = self.state
        row: dict[str, Any] = {
            "step": state.step,
            **{k: v for k, v in m.items() if k not in ("step_skipped", "nonfinite", "skipped")},
            **rollout,  # seconds, tokens/s, generation rounds, dynamic sampling's counts
            "train_seconds": train_seconds,
            "step_seconds": step_seconds,
            "weight_version": self.engine_version,
            "policy_version": state.weight_version,
            "total_skipped_steps": state.skipped_steps,
        }
        if not self.last_eval_read:  # a resumed attempt reports the eval it resumed after
            self.last_eval = metrics_log.last_eval(self.metrics_path)
            self.last_eval_read = True
        evaluation = self.spec.eval
        if evaluation.dataset and evaluation.interval and (
                state.step % evaluation.interval == 0
                or state.step == self.spec.algorithm.total_steps):
            # Not beside a batch generating ahead: its step's cut would abort the eval's
            # requests too (partial rollout aborts every request of the engines).
            self.batches.settle()
            result = ray.get(self.workers.rollout.evaluate.remote())
            row.update(result.metrics())
            self.last_eval = (state.step, result.reward)
        # A driver left behind by a restart (a partitioned node) learns here that another
        # took the store over, and stops before it writes metrics or status again.
        self.checkpoints.check_writer()
        metrics_log.append(self.metrics_path, row)
        self.tracking.log(row)
        self.reporter.progress(Progress(
            rollout_step=state.step, train_step=state.train_step,
            total_steps=self.spec.algorithm.total_steps, samples=state.samples,
            mean_reward=m["reward"], tokens_per_second=rollout["tokens_per_second"],
            weight_version=self.engine_version, skipped_steps=state.skipped_steps,
            policy_version=state.weight_version, staleness_mean=rollout["staleness_mean"],
            staleness_max=int(rollout["staleness_max"]),
            filtered_groups=(int(rollout["filtered_groups"]) if "filtered_groups" in rollout
                             else None),
            logprob_gap=m.get("logprob_gap"), updated_at=timestamp(),
            eval_reward=self.last_eval[1] if self.last_eval else None,
            eval_step=self.last_eval[0] if self.last_eval else None))

    # ---- reports -----------------------------------------------------------------------

    def report_resume(self, loaded: Verified | None) -> None:
        """Tell the RLJob what this attempt loaded (the operator derives resumedFromStep and
        lostSteps from it): the checkpoint's step, path and verified manifest digest, or that
        there was none and the attempt starts at step 0."""
        self.reporter.resumed(ResumeReport(
            attempt=attempt_number(dict(os.environ)), found=loaded is not None,
            step=self.state.step, path=str(loaded.path) if loaded else None,
            checksum=loaded.checksum if loaded else None, at=timestamp(),
            driver_pod_uid=os.environ.get(env.POD_UID) or None))

    def fail(self, reason: str, message: str, retryable: bool,
             lost_pods: list[str] | None = None) -> None:
        self.reporter.failure(RuntimeFailure(reason=reason, message=message, retryable=retryable,
                                             step=self.state.step, time=timestamp(),
                                             lost_pods=lost_pods or []))

    def report_stop(self, aborted: bool) -> None:
        """Tell the RLJob this attempt stopped on a signal (not a failure): where it was,
        the checkpoint the next attempt resumes from, and whether it stopped at once."""
        signum = self.stop.signum or 0
        self.reporter.stopped(RuntimeStop(
            signal=self.stop.name, attempt=attempt_number(dict(os.environ)),
            step=self.state.step, checkpoint_step=self.checkpoints.latest_step(),
            aborted=aborted, exit_code=exits.for_signal(signum), time=timestamp()))

    def summary(self, rows: list[dict[str, Any]], seconds: float, code: int) -> None:
        rewards = [float(r["reward"]) for r in rows if isinstance(r.get("reward"), int | float)]
        head = rewards[:5]
        tail = rewards[-5:]
        latest = self.checkpoints.latest()
        lines = [
            "done" if code == exits.OK else
            "interrupted; state saved" if code == exits.INTERRUPTED else
            f"stopped by {self.stop.name}; state saved",
            f"  steps        {self.state.step}/{self.spec.algorithm.total_steps} "
            f"({self.state.train_step} optimizer steps, {self.state.skipped_steps} skipped)",
        ]
        if rewards:
            lines.append(f"  mean reward  first {len(head)} steps {np.mean(head):.3f} → "
                         f"last {len(tail)} steps {np.mean(tail):.3f}")
        lines += [
            f"  wall time    {seconds:.1f}s this run",
            f"  checkpoint   {latest.path if latest else '-'}",
            f"  metrics      {self.metrics_path}",
            f"  curves       {self.workdir / metrics_log.PLOT_FILE}",
        ]
        lines += [f"  {field:<12} {outcome}" for field, outcome in self.tracking.outcome.items()]
        print("\n".join(lines), flush=True)

    def shutdown(self, exit_code: int) -> None:
        """Stop sidecars, engines and trainers, free the slots, stop Ray if this run started
        it; finish the trackers a failure left open (marked with `exit_code`); then let the
        next writer of the checkpoint store in. After an abort (or when a signal arrives
        meanwhile) nothing is waited for: every actor is killed at once."""
        try:
            self.cluster.shutdown(self.weight_sync, graceful=not self.stop.aborted)
        finally:
            self.tracking.close(exit_code)
            self.checkpoints.release()


def _run(job: Job) -> int:
    """`job.run()`, its failures and stops turned into exit codes and status reports."""
    try:
        return job.run()
    except KeyboardInterrupt:  # Aborted, or what ray.get raises in its place
        if not job.stop.aborted:
            # Ctrl-C where the stop handler could not be installed (not the main thread):
            # nothing saved here; the latest checkpoint, if any, is untouched.
            print("rljob run: interrupted; nothing was saved", file=sys.stderr, flush=True)
            return exits.INTERRUPTED
        # During start-up, or a second signal: the step and save in progress are abandoned;
        # published checkpoints are whole (a save appears only by its final rename).
        if job.loop_started:
            step = job.checkpoints.step
            what = (f"at once; the next run resumes from the checkpoint of step "
                    f"{step}" if step is not None else
                    "at once; no checkpoint was saved yet")
        else:
            what = "during start-up; nothing was trained"
        print(f"rljob run: stopped by {job.stop.name} {what}", file=sys.stderr, flush=True)
        job.report_stop(aborted=True)
        return exits.for_signal(job.stop.signum or 0)
    except JobError as err:
        print(f"rljob run: {err}", file=sys.stderr, flush=True)
        if err.code == exits.FAILED:
            job.fail(str(err).split(":", 1)[0], str(err), retryable=True)
        elif err.code == exits.INVALID:
            # The status says why (the field and the fix), not only the exit code.
            job.fail(exits.TERMINAL_REASONS[exits.INVALID], str(err), retryable=False)
        return err.code
    except (LeaseLost, CheckpointConflict) as err:
        # Another driver of this job owns the checkpoint store, and the job's status with it:
        # this one stops without publishing or reporting anything more (a report queued
        # before it lost the store may still be written).
        print(f"rljob run: CheckpointStoreLost: {err}", file=sys.stderr, flush=True)
        return exits.FAILED
    except ray.exceptions.RayError as err:
        # A worker or engine died or raised: a restart from the checkpoint may help.
        print(f"rljob run: a worker failed: {err}", file=sys.stderr, flush=True)
        # A stop (SIGTERM) takes compute away too: no time to spend asking Ray what died.
        lost = {} if job.stop.requested else job.cluster.lost_pods(NODE_DEATH_WAIT_S)
        if lost:
            pods = "; ".join(f"{pod} ({why})" for pod, why in sorted(lost.items()))
            print(f"rljob run: Ray lost the node of {pods}", file=sys.stderr, flush=True)
            job.fail("WorkerLost", f"Ray lost the node of {pods}; first error: {str(err)[:3000]}",
                     retryable=True, lost_pods=sorted(lost))
        else:
            job.fail("WorkerFailed", str(err)[:4000], retryable=True)
        return exits.FAILED
    except OSError as err:
        # Storage failed under the run (full, read-only, gone), or another I/O error reached
        # the loop: published checkpoints are whole, so a restart resumes from the latest.
        name = str(err.filename or "")
        in_workdir = bool(name) and Path(name).resolve().is_relative_to(job.workdir.resolve())
        reason = "StorageError" if in_workdir else "IOError"
        what = (f"a file operation in the workdir {job.workdir} failed" if in_workdir
                else "an I/O operation failed")
        where = f" ({name})" if name else ""
        message = f"{what}: {err.strerror or err}{where}; published checkpoints are unaffected"
        print(f"rljob run: {reason}: {message}", file=sys.stderr, flush=True)
        job.fail(reason, message, retryable=True)
        return exits.FAILED


def run_job(name: str, spec: RLJobSpec, options: RunOptions, reporter: Reporter) -> int:
    """Run `spec` to its end (or max_steps); return the process exit code (rljob_api.exits).
    SIGTERM and SIGINT stop it as `rljob.driver.stop` describes."""
    try:
        job = Job(name, spec, options, reporter)
    except OSError as err:
        # The workdir (on a cluster: the checkpoint volume) cannot be written: a restart on
        # the same volume cannot help, so the reason is reported as not retryable.
        message = (f"the workdir {options.workdir} cannot be written ({err.strerror}: "
                   f"{err.filename}); on a cluster, spec.checkpoint's volume must be writable "
                   "by the pods' user")
        print(f"rljob run: {message}", file=sys.stderr, flush=True)
        reporter.failure(RuntimeFailure(reason="WorkdirNotWritable", message=message,
                                        retryable=False, step=0, time=timestamp()))
        return exits.INVALID
    with job.stop.installed():
        code = exits.FAILED  # what the trackers are told when _run itself raised
        try:
            try:
                code = _run(job)
                return code
            finally:
                job.shutdown(code)
        except KeyboardInterrupt:
            # A first signal while a failure was being handled, or during the shutdown.
            return exits.for_signal(job.stop.signum or signal.SIGINT)
