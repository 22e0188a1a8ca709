"""`Attempt`: one run of the driver from its first moment to its exit.

It holds what exists whether or not start-up completes (the options, the status reporter,
the signal handling, the checkpoint store, this attempt's Ray and what it placed), reports
failures and stops in the RLJob's status, and shuts everything down. The loop's own state
lives in `Job`, built by `rljob.driver.start` once start-up completed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rljob.cluster.cluster import Cluster, RunOptions, attempt_number
from rljob.driver.checkpoints import Checkpoints
from rljob.driver.stop import StopSignals
from rljob.reporting.reporter import Reporter
from rljob.reporting.startup import StartupClock
from rljob.reporting.tracking import Trackers
from rljob_api import exits
from rljob_api.spec import RLJobSpec
from rljob_api.status import RuntimeFailure, RuntimeStop, timestamp

if TYPE_CHECKING:
    from rljob.driver.job import Job


@dataclass
class Attempt:
    name: str
    spec: RLJobSpec
    options: RunOptions
    reporter: Reporter
    stop: StopSignals
    cluster: Cluster
    checkpoints: Checkpoints
    number: int  # which attempt of the job this is (the operator's restart count; 0 locally)
    startup: StartupClock  # from the run's start to the first rollout request
    tracking: Trackers = field(default_factory=Trackers)  # none until start-up starts them
    job: Job | None = None  # once start-up completed
    loop_started: bool = False  # from here on a first signal lets the step finish

    @classmethod
    def begin(cls, name: str, spec: RLJobSpec, options: RunOptions, reporter: Reporter
              ) -> Attempt:
        """Raises OSError when the workdir cannot be written."""
        startup = StartupClock(options.started_at or time.time())
        startup.mark("imports")  # every module the driver needs before Ray
        stop = StopSignals()
        number = attempt_number(dict(os.environ))
        checkpoints = Checkpoints(options.workdir / "checkpoints", spec.checkpoint.keep_last,
                                  number, reporter)
        return cls(name, spec, options, reporter, stop, Cluster(options, stop.install, startup),
                   checkpoints, number, startup)

    @property
    def step(self) -> int:
        """The rollout step this attempt is at: resumed from, or reached."""
        if self.job is not None:
            return self.job.state.step
        return self.checkpoints.step or 0

    def fail(self, reason: str, message: str, retryable: bool,
             lost_pods: list[str] | None = None) -> None:
        self.reporter.failure(RuntimeFailure(reason=reason, message=message, retryable=retryable,
                                             step=self.step, time=timestamp(),
                                             lost_pods=lost_pods or []))

    def report_stop(self, aborted: bool) -> None:
        """Tell the RLJob this attempt stopped on a signal (not a failure): where it was,
        the checkpoint the next attempt resumes from, and whether it stopped at once."""
        signum = self.stop.signum or 0
        self.reporter.stopped(RuntimeStop(
            signal=self.stop.name, attempt=self.number,
            step=self.step, checkpoint_step=self.checkpoints.latest_step(),
            aborted=aborted, exit_code=exits.for_signal(signum), time=timestamp()))

    def shutdown(self, exit_code: int) -> None:
        """Stop sidecars, engines and trainers, free the slots, stop Ray if this run started
        it; finish the trackers a failure left open (marked with `exit_code`); then let the
        next writer of the checkpoint store in. After an abort (or when a signal arrives
        meanwhile) nothing is waited for: every actor is killed at once."""
        try:
            self.cluster.shutdown(graceful=not self.stop.aborted)
        finally:
            self.tracking.close(exit_code)
            self.checkpoints.release()
