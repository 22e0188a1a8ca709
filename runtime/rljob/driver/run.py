"""`run_job`: one attempt of a job, start to exit code. SIGTERM and SIGINT stop it as
`rljob.driver.stop` describes."""

from __future__ import annotations

import signal
import sys
import time

from rljob.cluster.cluster import RunOptions
from rljob.driver import loop, outcome
from rljob.driver.attempt import Attempt
from rljob.driver.plan_only import plan_only
from rljob.driver.report import summary
from rljob.driver.start import start
from rljob.reporting import metrics_log
from rljob.reporting.reporter import Reporter
from rljob_api import exits
from rljob_api.spec import RLJobSpec
from rljob_api.status import RuntimeFailure, timestamp


def run_job(name: str, spec: RLJobSpec, options: RunOptions, reporter: Reporter) -> int:
    """Run `spec` to its end (or max_steps); return the process exit code."""
    try:
        attempt = Attempt.begin(name, spec, options, reporter)
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
    with attempt.stop.installed():
        code = exits.FAILED  # what the trackers are told when the attempt itself raised
        try:
            try:
                code = outcome.exit_code(attempt, lambda: run_attempt(attempt))
                return code
            finally:
                attempt.shutdown(code)
        except KeyboardInterrupt:
            # A first signal while a failure was being handled, or during the shutdown.
            return exits.for_signal(attempt.stop.signum or signal.SIGINT)


def run_attempt(attempt: Attempt) -> int:
    """Start, train, and close the run: the curves plotted, the trackers finished, the
    summary printed. A stop before the end is reported (not a failure)."""
    if attempt.options.plan_only or attempt.spec.plan_only:
        return plan_only(attempt)
    job = start(attempt)
    started = time.monotonic()
    end = job.end_step()
    loop.train(job)
    code = exits.OK
    if attempt.stop.requested and job.state.step < end:  # stopped before its end: not done
        code = exits.for_signal(attempt.stop.signum or 0)
        attempt.report_stop(aborted=False)
    rows = metrics_log.read(job.metrics_path)
    if rows:
        metrics_log.plot(rows, job.workdir / metrics_log.PLOT_FILE)
    attempt.tracking.close(code)  # before the summary, which says what each one wrote
    print(summary(job, rows, time.monotonic() - started, code), flush=True)
    return code
