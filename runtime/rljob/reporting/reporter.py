"""Report training progress and checkpoints to the job's RLJob status, or print them locally.

Inside a cluster the runtime owns `status.progress`, `status.checkpoint`, `status.resumed`,
`status.runtimeFailure` and `status.stopped` and writes them with server-side apply under its
own field manager (in a driver pod through the pod's status writer, which alone holds the
API token: `status_sink`), so the operator (another manager) never overwrites them and vice
versa. What an attempt resumed from (`resumed`) is reported by the runtime that loaded it,
because only it knows: the operator derives its recovery figures from that report.
Non-finite figures cannot travel in JSON: they are left out and named in
`progress.nonFinite`, never replaced by a number.

Writing status must never cost training: a StatusReporter hands every report to a writer
thread and returns. The thread applies the latest state of every field (a report made
while an older one is still pending replaces it: latest state wins), with a bounded
request timeout, and retries with capped exponential backoff while the API server is
unreachable or refuses. A report waits a moment for its write only while the API server
answers (so a healthy cluster shows it as soon as the call returns) and not at all during an
outage. At exit the owner flushes with a deadline; what cannot be written by then is lost,
never waited for.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from typing import Any, Protocol

from rljob.reporting.status_sink import ApiSink, SocketSink, StatusSink
from rljob_api import env
from rljob_api.status import (
    CheckpointStatus,
    EnginesStatus,
    Progress,
    ResumeReport,
    RuntimeFailure,
    RuntimeStop,
)

ENV_NAME = env.JOB_NAME
ENV_NAMESPACE = env.JOB_NAMESPACE
REQUEST_TIMEOUT_S = 5.0  # one request to the API server, to connect and to answer
SETTLE_S = 1.0  # the longest a report waits for its write while the API server answers
BACKOFF_S = (0.5, 15.0)  # first and longest pause between failed writes
FLUSH_TIMEOUT_S = 10.0  # what `rljob run` gives the last writes at exit
IDLE_S = 30.0  # a writer thread with nothing to write ends; the next report starts one


def finite_progress(progress: Progress) -> dict[str, Any]:
    """`progress` as JSON, with NaN/Inf figures left out and named in `nonFinite`."""
    body = progress.model_dump(by_alias=True, exclude_none=True, mode="python")
    bad = sorted(k for k, v in body.items() if isinstance(v, float) and not math.isfinite(v))
    for key in bad:
        del body[key]
    if bad:
        body["nonFinite"] = ",".join(bad)
    return body


class Reporter(Protocol):
    def progress(self, progress: Progress) -> None: ...
    def checkpoint(self, checkpoint: CheckpointStatus) -> None: ...
    def resumed(self, resumed: ResumeReport) -> None: ...
    def failure(self, failure: RuntimeFailure) -> None: ...
    def stopped(self, stop: RuntimeStop) -> None: ...
    def engines(self, engines: EnginesStatus) -> None: ...
    def close(self, timeout_s: float) -> bool: ...


class PrintReporter:
    """Local runs: the progress bar shows progress; checkpoints and failures are printed."""

    def progress(self, progress: Progress) -> None:
        return None

    def checkpoint(self, checkpoint: CheckpointStatus) -> None:
        print(f"checkpoint: step {checkpoint.step} verified at {checkpoint.path}", flush=True)

    def resumed(self, resumed: ResumeReport) -> None:
        return None  # the loop prints what it resumed from itself

    def failure(self, failure: RuntimeFailure) -> None:
        print(f"failure: {failure.reason}: {failure.message}", flush=True)

    def stopped(self, stop: RuntimeStop) -> None:
        return None  # the run's summary says how it stopped

    def engines(self, engines: EnginesStatus) -> None:
        return None  # each loss and rejoin is printed as it happens

    def close(self, timeout_s: float) -> bool:
        return True  # everything was printed when it was reported


class StatusReporter:
    """Delivers the runtime's status fields to a sink (the API server, or the pod's status
    writer), from a writer thread.

    Every delivery carries everything the runtime owns (the last progress, checkpoint and
    failure): an apply removes the fields its manager applied before and left out now.
    """

    def __init__(self, sink: StatusSink, *, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 settle_s: float = SETTLE_S, backoff_s: tuple[float, float] = BACKOFF_S,
                 idle_s: float = IDLE_S) -> None:
        self.sink = sink
        self.request_timeout_s = request_timeout_s
        self.settle_s = settle_s
        self.backoff_s = backoff_s
        self.idle_s = idle_s
        self._reported: dict[str, Any] = {}  # the latest value of every field reported
        self._version = 0  # bumped by every report
        self._written = 0  # the report the sink last accepted
        self._healthy = True  # the last write succeeded (or none was tried)
        self._closed = False
        self._failures = 0  # writes failed in a row
        self.last_error = ""
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls) -> StatusReporter | None:
        """The reporter for the job named by RLJOB_NAME/RLJOB_NAMESPACE, if set (in pods):
        through the status writer's socket where RLJOB_STATUS_SOCKET names one (a driver
        pod), else straight to the API server."""
        name = os.environ.get(ENV_NAME)
        if not name:
            return None
        socket_path = os.environ.get(env.STATUS_SOCKET)
        if socket_path:
            return cls(SocketSink(socket_path))
        return cls(ApiSink(name, os.environ.get(ENV_NAMESPACE, "default")))

    # ---- the caller's side: never blocks for more than `settle_s` -----------------------

    def report_fields(self, fields: dict[str, Any], *, replace: bool = False) -> bool:
        """Report `fields` (latest state wins); `replace`: they are the whole set, and a
        field reported before but not now is dropped (the status writer takes every
        delivery of a driver this way, so nothing but the driver's latest set is applied).
        False when the reporter is closed and the fields were dropped."""
        with self._cond:
            if self._closed:
                return False
            if replace:
                self._reported.clear()
            self._reported.update(fields)
            self._version += 1
            mine = self._version
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rljob-status",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()
            if self._healthy and self.settle_s > 0:
                self._cond.wait_for(lambda: self._written >= mine or not self._healthy,
                                    timeout=self.settle_s)
            return True

    @property
    def writing(self) -> bool:
        """A writer thread is alive (it ends after `idle_s` with nothing to write)."""
        with self._cond:
            return self._thread is not None

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until everything reported is written; True if it is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._written >= self._version, timeout=timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Flush with a deadline (this reporter's queue, then the sink's own), then stop
        the writer; later reports are dropped."""
        deadline = time.monotonic() + timeout_s
        flushed = self.flush(timeout_s)
        if flushed:
            try:
                flushed = self.sink.flush(max(0.0, deadline - time.monotonic()))
            except Exception as err:  # the sink is gone: what it held is lost
                self.last_error = str(err)[:300]
                flushed = False
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if not flushed:
            print(f"status: the last status report was not written within {timeout_s:.0f}s "
                  f"({self.last_error}); giving up on it", file=sys.stderr, flush=True)
        return flushed

    # ---- the writer thread ------------------------------------------------------------

    def _run(self) -> None:
        delay = self.backoff_s[0]
        while True:
            with self._cond:
                busy = self._cond.wait_for(
                    lambda: self._closed or self._version > self._written, timeout=self.idle_s)
                if self._closed or not busy:
                    self._thread = None  # idle: the next report starts a writer again
                    return
                version, fields = self._version, dict(self._reported)
            try:
                self.sink.write(fields, self.request_timeout_s)
            except Exception as err:  # any API or network error: retried, never raised
                self._failed(err, delay)
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, timeout=delay)
                delay = min(delay * 2, self.backoff_s[1])
                continue
            with self._cond:
                self._written = max(self._written, version)
                self._healthy = True
                self._cond.notify_all()
            if self._failures:
                print(f"status: written again after {self._failures} failed attempt(s)",
                      file=sys.stderr, flush=True)
                self._failures = 0
            delay = self.backoff_s[0]

    def _failed(self, err: Exception, delay: float) -> None:
        reason = getattr(err, "reason", None) or type(err).__name__
        status = getattr(err, "status", None)
        self.last_error = f"{status} {reason}".strip() if status else str(reason)[:300]
        with self._cond:
            self._healthy = False
            self._cond.notify_all()
        self._failures += 1
        if self._failures == 1:
            print(f"status: cannot write the status to {self.sink} "
                  f"({self.last_error}); retrying with backoff, training goes on",
                  file=sys.stderr, flush=True)

    # ---- what the runtime reports -----------------------------------------------------

    def progress(self, progress: Progress) -> None:
        self.report_fields({"progress": finite_progress(progress)})

    def checkpoint(self, checkpoint: CheckpointStatus) -> None:
        self.report_fields({"checkpoint": checkpoint.model_dump(by_alias=True, exclude_none=True)})

    def resumed(self, resumed: ResumeReport) -> None:
        self.report_fields({"resumed": resumed.model_dump(by_alias=True, exclude_none=True)})

    def failure(self, failure: RuntimeFailure) -> None:
        self.report_fields({"runtimeFailure": failure.model_dump(by_alias=True, exclude_none=True)})

    def stopped(self, stop: RuntimeStop) -> None:
        self.report_fields({"stopped": stop.model_dump(by_alias=True, exclude_none=True)})

    def engines(self, engines: EnginesStatus) -> None:
        self.report_fields({"engines": engines.model_dump(by_alias=True, exclude_none=True,
                                                          mode="json")})
