"""`Job`: a started attempt's roles and the loop's state, and the parts of a step the loop
(`rljob.driver.loop`) calls in order. Built whole by `rljob.driver.start`; every call on
another process goes through a role handle (`rljob.cluster`)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from rljob.checkpoint.store import Verified
from rljob.cluster.cluster import Roles
from rljob.cluster.engine_recovery import EngineRecovery
from rljob.cluster.rollout_pipeline import RolloutBatch, Staleness
from rljob.cluster.weight_sync import engine_name
from rljob.driver.attempt import Attempt
from rljob.driver.state import LoopState
from rljob.reporting import metrics_log
from rljob.rollout.sample import Sample
from rljob.trainer.metrics import TrainMetrics
from rljob.weightsync.results import NonFiniteWeights, SyncResult
from rljob_api import exits
from rljob_api.exits import JobError
from rljob_api.spec import RLJobSpec

WEIGHT_SYNC_LOG = "weight_sync.jsonl"
# How long a sidecar Ray started again has to register before its engine is sent the version
# it missed (a new process: Python, torch, the store connection).
SIDECAR_REJOIN_TIMEOUT_S = 120.0
EVIDENCE_DIR = "nonfinite"


@dataclass
class Job:
    attempt: Attempt
    roles: Roles
    state: LoopState
    resumed: bool  # from a checkpoint
    # Async (rljob.cluster.rollout_pipeline): the next batch generates while the trainer
    # trains, and a trained sample may lag the policy by this many versions; None in sync.
    max_staleness: int | None
    engine_version: int  # the weight version the engines serve
    # (rollout step, eval reward) of the latest evaluation, reported with every step: the
    # one a resumed attempt finds in metrics.jsonl until it evaluates itself
    last_eval: tuple[int, float] | None
    # Lost rollout engines replaced while training goes on (`RLJobSpec.replaces_engines`);
    # None: a lost engine ends the attempt, as any lost worker.
    recovery: EngineRecovery | None = None

    @property
    def spec(self) -> RLJobSpec:
        return self.attempt.spec

    @property
    def workdir(self) -> Path:
        return self.attempt.options.workdir

    @property
    def metrics_path(self) -> Path:
        return self.workdir / metrics_log.METRICS_FILE

    def end_step(self) -> int:
        """Where this attempt stops: the job's last step, or --max-steps from here."""
        end = self.spec.algorithm.total_steps
        if self.attempt.options.max_steps is not None:
            end = min(end, self.state.step + self.attempt.options.max_steps)
        return end

    # ---- colocated turns: trainer and engines take turns on the GPUs' memory ------------

    def trainers_leave_gpus(self) -> None:
        if self.roles.offload:  # parameters, gradients and optimizer state
            self.roles.trainers.offload()

    def engines_leave_gpus(self) -> None:
        if self.roles.offload:  # weights and caches
            self.roles.engines.release()

    def engines_return(self) -> bool:
        """False when an engine came back without its weights (SGLang drops them)."""
        return self.roles.engines.resume() if self.roles.offload else True

    # ---- the step's parts ----------------------------------------------------------------

    def tend_engines(self) -> None:
        """Lost engines found and replaced, replacements brought back (`EngineRecovery`)."""
        if self.recovery is None:
            return
        # A replacement is sent the engines' version only while the trainer holds it.
        held = self.state.weight_version == self.engine_version
        self.recovery.tend(self.engine_version, resync=held)
        if not held and self.recovery.awaiting_weights():
            # Async, and no engine serves: the trainer moved past the engines' version, and
            # nothing generates that a delivery could disturb. The replacements get the
            # trainer's version now, as the next step would have delivered it; waiting for
            # that step would wait for a batch that needs them.
            print(f"engines: none serves; delivering the trainer's weight version "
                  f"{self.state.weight_version} to the replacements now", file=sys.stderr,
                  flush=True)
            self.publish()

    def take_batch(self) -> tuple[RolloutBatch, Staleness]:
        """This step's rewarded samples, and how far they lag the policy."""
        self.tend_engines()
        state, algo, bound = self.state, self.spec.algorithm, self.max_staleness
        batch = self.roles.rollout.take(
            state.step, self.engine_version,
            None if bound is None else state.weight_version - bound,
            algo.rollout_batch_size * algo.n_samples_per_prompt)
        return batch, Staleness.of(batch, state.weight_version, bound)

    def launch_next_batch(self) -> None:
        """Async mode: the next step's batch starts generating now, while this one trains,
        after the engines got the newest weights if it would otherwise lag more than the
        bound when it is trained (one version on). Started at the last step of a
        --max-steps run too: the checkpoint keeps it and the resumed run trains on it (a
        stop cancels it instead)."""
        state, bound = self.state, self.max_staleness
        if bound is None or state.step + 1 >= self.spec.algorithm.total_steps:
            return
        if state.weight_version + 1 - self.engine_version > bound:
            self.publish()
        self.roles.rollout.launch(state.step + 1, self.engine_version,
                                  state.weight_version + 1 - bound)

    def stop_if_nonfinite(self, metrics: TrainMetrics, samples: list[Sample]) -> None:
        """Stop (not retryable, evidence kept) after too many skipped optimizer steps in a row
        or when a weight became NaN/Inf: nothing non-finite reaches the engines."""
        limit = self.spec.algorithm.max_consecutive_nonfinite
        if self.state.consecutive_nonfinite >= limit:
            reasons = "; ".join(metrics.nonfinite)
            where = self.save_evidence(samples, reasons)
            message = (f"{self.state.consecutive_nonfinite} optimizer steps in a row had "
                       f"non-finite loss or gradients ({reasons}); batch and state saved in "
                       f"{where}")
            self.attempt.fail("NonFiniteLoss", message, retryable=False)
            raise JobError(exits.NONFINITE, f"NonFiniteLoss: {message}")
        bad = self.roles.trainers.nonfinite_weights()
        if bad:
            where = self.save_evidence(samples, f"non-finite weights {bad[:5]}")
            message = f"weights became non-finite ({', '.join(bad[:5])}); not sent to engines; " \
                      f"evidence in {where}"
            self.attempt.fail("NonFiniteWeights", message, retryable=False)
            raise JobError(exits.NONFINITE, f"NonFiniteWeights: {message}")

    def save_evidence(self, samples: list[Sample], reason: str) -> Path:
        return self.attempt.checkpoints.save_evidence(
            self.workdir / EVIDENCE_DIR, self.state, self.roles.trainers, samples, reason)

    def weights_after_step(self, metrics: TrainMetrics, weights_kept: bool) -> None:
        """A new version goes to the engines now in sync mode (async: at the start of the
        next step, when due; and after the last step). Engines that dropped their weights
        get the version they had again."""
        if metrics.optimizer_steps:
            if self.max_staleness is None or self.state.step == self.spec.algorithm.total_steps:
                self.publish()
        elif not weights_kept:
            self.publish(again=True)

    def publish(self, again: bool = False) -> None:
        """Deliver `state.weight_version` to every engine, or stop the run.

        Engines that reject a version keep serving the previous one and are resynced by
        the publisher within the deadline; one still stale after that fails the run
        (retryable: a restart resyncs every engine from the checkpoint). `again` sends the
        version to engines that already had it (they dropped their weights).
        """
        version = self.state.weight_version
        try:
            result = self.roles.trainers.publish(version, again)
        except NonFiniteWeights as err:
            message = f"{err}; nothing was sent to the engines"
            self.attempt.checkpoints.check_writer()  # one left behind reports nothing
            self.attempt.fail("NonFiniteWeights", message, retryable=False)
            raise JobError(exits.NONFINITE, f"NonFiniteWeights: {message}") from None
        self.log_sync(result)
        if result.stale and self.recovery is not None:
            # Engines lost meanwhile are being replaced: each gets this version when back.
            self.recovery.check(stale=set(result.stale))
            down = self.recovery.down()
            result = dataclasses.replace(result, stale={
                name: why for name, why in result.stale.items() if name not in down})
        if result.stale:
            result = self.after_lost_sidecars(result)
        elif result.attempts > 1:
            # Repaired within the delivery (a sidecar Ray started again rejoined in time):
            # what the sidecars are now is the baseline a later loss is measured from.
            self.attempt.cluster.check_sidecars()
        if result.stale:
            reasons = "; ".join(f"{name}: {why}" for name, why in sorted(result.stale.items()))
            raise JobError(exits.FAILED, f"WeightSyncFailed: engines did not install "
                           f"weight version {version}: {reasons}")
        self.engine_version = version
        if self.recovery is not None:
            self.recovery.served(version)
            # The trainer holds exactly this version now: replacements may get it.
            self.recovery.advance(version, resync=True)

    def after_lost_sidecars(self, result: SyncResult) -> SyncResult:
        """A delivery with stale engines whose sidecars died: those Ray started again are
        sent the version once more when they have registered; one that stays lost, or
        stale after that, ends the attempt as `WeightSyncSidecarLost` (the job restarts
        from its checkpoint, counted against spec.recovery.maxRestarts). Stale engines whose
        sidecars are fine are left to the caller."""
        cluster = self.attempt.cluster
        check = cluster.check_sidecars().of_engines(result.stale)
        if check.node_gone and self.recovery is not None:
            # Their engines went with the node: lost engines, replaced like any other.
            for i in sorted(check.node_gone):
                self.recovery.lose(i, check.dead[i])
            gone = {engine_name(i) for i in check.node_gone}
            result = dataclasses.replace(result, stale={
                name: why for name, why in result.stale.items() if name not in gone})
            check = dataclasses.replace(check, dead={
                i: why for i, why in check.dead.items() if i not in check.node_gone},
                node_gone=set())
        if not check.dead and not check.restarted:
            return result
        version = result.version
        if not check.dead and cluster.sidecars_registered(check.restarted,
                                                          SIDECAR_REJOIN_TIMEOUT_S):
            print(f"weight sync: {check.describe()}; sending version {version} again",
                  file=sys.stderr, flush=True)
            result = self.roles.trainers.publish(version, True)
            self.log_sync(result)
            if not result.stale:
                return result
        reasons = "; ".join(f"{name}: {why}" for name, why in sorted(result.stale.items()))
        raise JobError(exits.FAILED, f"WeightSyncSidecarLost: {check.describe()}; engines "
                       f"did not install weight version {version}: {reasons}")

    def log_sync(self, result: SyncResult) -> None:
        metrics_log.append(self.workdir / WEIGHT_SYNC_LOG, {
            "version": result.version, "acked": result.acked, "stale": result.stale,
            "attempts": result.attempts, "seconds": result.seconds,
            "bytes_per_engine": result.bytes_per_engine, "rejections": list(result.rejections),
        })
        for rejection in result.rejections:
            print(f"weight sync: version {result.version}: {rejection}", file=sys.stderr,
                  flush=True)

    def evaluate_if_due(self) -> dict[str, float]:
        """The eval figures of this step when `spec.eval` evaluates it, else none."""
        evaluation, step = self.spec.eval, self.state.step
        if not (evaluation.dataset and evaluation.interval) or not (
                step % evaluation.interval == 0 or step == self.spec.algorithm.total_steps):
            return {}
        result = self.roles.rollout.evaluate()
        self.last_eval = (step, result.reward)
        return result.metrics()

    def save_due(self, end: int) -> bool:
        return self.state.step % self.spec.checkpoint.interval == 0 or self.state.step == end

    def save(self) -> Verified:
        return self.attempt.checkpoints.save(
            self.state, self.roles.trainers, self.roles.rollout,
            hf_export=self.spec.checkpoint.format == "hf", stopping=self.attempt.stop.requested)
