"""The loop's state and its save and resume: everything a run needs to continue after a
crash — step, weight version, data cursor, buffer, RNG — goes into one verified checkpoint
with the trainers' weights and optimizer state, and comes back from the latest one.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from rljob.checkpoint.lease import writer_identity
from rljob.checkpoint.store import CheckpointStore, LeaseHeld, Verified
from rljob.cluster.rollout_pipeline import RolloutPipeline
from rljob.cluster.trainer_group import TrainerGroup
from rljob.driver.state import LoopState
from rljob.reporting.reporter import Reporter
from rljob.rollout.sample import Sample
from rljob_api import exits
from rljob_api.exits import JobError
from rljob_api.status import CheckpointRecord, CheckpointStatus, timestamp

STATE_FILE = "state.json"
ROLLOUT_FILE = "rollout_state.json"
DRIVER_RNG_FILE = "driver_rng.pt"
HISTORY = 16  # checkpoints listed in status.checkpoint.history


def _mtime(path: Path) -> str:
    return timestamp(datetime.fromtimestamp(path.stat().st_mtime, UTC))


class Checkpoints:
    """The job's checkpoint store as the loop uses it: this attempt its only writer."""

    def __init__(self, root: Path, keep_last: int, attempt: int, reporter: Reporter) -> None:
        self.store = CheckpointStore(root, keep_last, writer=writer_identity(attempt))
        self.reporter = reporter
        self.step: int | None = None  # the latest verified one: resumed or saved
        self._resume_point: tuple[Verified | None, LoopState] | None = None

    def take(self) -> None:
        """Become the checkpoint store's only writer before reading or writing it: a driver
        of an earlier attempt that still runs is waited for, then this attempt gives up
        (retryable: the next attempt finds the store free)."""
        try:
            self.store.acquire(on_wait=lambda why: print(f"checkpoints: {why}",
                                                         file=sys.stderr, flush=True))
        except LeaseHeld as err:
            raise JobError(exits.FAILED, f"CheckpointStoreBusy: {err}") from None

    def check_writer(self) -> None:
        """Raise LeaseLost when another driver took the store over (this one was left
        behind by a restart, e.g. on a partitioned node)."""
        self.store.lease.check()

    def resume_point(self) -> tuple[Verified | None, LoopState]:
        """The latest verified checkpoint (None: there is none) and the loop state it holds,
        known before anything is placed. Found once an attempt: verifying reads every byte
        of a checkpoint, and this attempt, the store's only writer, adds none meanwhile."""
        if self._resume_point is None:
            latest = self.store.latest()
            state = (LoopState(**json.loads((latest.path / STATE_FILE).read_text()))
                     if latest is not None else LoopState())
            self._resume_point = latest, state
        return self._resume_point

    def resume(self, trainers: TrainerGroup, rollout: RolloutPipeline
               ) -> tuple[Verified, LoopState] | None:
        """Trainers, rollout worker (and the batch it had generated ahead) and this process's
        RNG back to the latest verified checkpoint (`resume_point`); None (nothing restored)
        when there is none."""
        # The point was found before placement, which can take minutes: still the writer?
        self.check_writer()
        latest, state = self.resume_point()
        if latest is None:
            return None
        trainers.load(str(latest.path))
        rollout.load(json.loads((latest.path / ROLLOUT_FILE).read_text()), latest.path)
        from rljob.checkpoint import rng  # torch: imported once Ray starts (driver.start)

        rng.load(latest.path / DRIVER_RNG_FILE)
        self.step = latest.step
        return latest, state

    def save(self, state: LoopState, trainers: TrainerGroup, rollout: RolloutPipeline,
             hf_export: bool, stopping: bool = False) -> Verified:
        """Write and publish the checkpoint of `state.step`. A failure of the batch being
        generated ahead is raised after the checkpoint is published (it holds the rollout
        state from before that batch), so the trained step is never lost to it."""
        tmp = self.store.begin(state.step)
        trainers.save(str(tmp), hf_export)
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        rollout_state, pending, failed = rollout.for_checkpoint(stopping)
        if pending is not None:
            pending.write(tmp)
        (tmp / ROLLOUT_FILE).write_text(json.dumps(rollout_state))
        from rljob.checkpoint import rng

        rng.save(tmp / DRIVER_RNG_FILE, cuda=False)
        verified = self.store.commit(tmp, state.step)
        self.step = verified.step
        history = [CheckpointRecord(step=s, path=str(p), saved_at=_mtime(p))
                   for s, p in self.store.published()[-HISTORY:]]
        self.reporter.checkpoint(CheckpointStatus(
            step=verified.step, path=str(verified.path), saved_at=timestamp(),
            size_bytes=verified.size_bytes, checksum=verified.checksum, verified=True,
            history=history))
        if failed is not None:
            raise failed
        return verified

    def latest_step(self) -> int | None:
        """The step the next attempt resumes from."""
        if self.step is not None:
            return self.step
        published = self.store.published()  # before this attempt resumed: the store's own
        return published[-1][0] if published else None

    def save_evidence(self, root: Path, state: LoopState, trainers: TrainerGroup,
                      samples: list[Sample], reason: str) -> Path:
        """The offending batch and the trainer state, to reproduce a non-finite stop (only by
        the store's writer: a driver left behind writes nothing, nor the failure after it)."""
        self.check_writer()
        target = root / f"step_{state.step + 1:08d}"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        (target / "batch.json").write_text(json.dumps([s.to_json() for s in samples], default=str))
        (target / "state.json").write_text(json.dumps({**asdict(state), "reason": reason}))
        trainers.save(str(target), False)
        return target

    def release(self) -> None:
        """Let the next writer in."""
        self.store.release()

    def latest(self) -> Verified | None:
        return self.store.latest()
