"""SIGTERM and SIGINT stop a run cleanly; a second one aborts it at once.

Kubernetes stops a pod (suspend, preemption, eviction, deletion) with SIGTERM, then SIGKILL
after the pod's grace period; a person stops `rljob run` with Ctrl-C (SIGINT). Both mean
"stop", neither is a failure. While the loop runs, the first signal lets the step in
progress finish and be saved, then the run exits with 128 + the signal number. During
start-up there is nothing to finish, so it stops at once; so does a second signal at any
time, abandoning the step and save in progress (published checkpoints stay whole: a save
becomes visible only by its final rename). After that the default actions are back: a
third signal ends the process outright.

The driver's process is PID 1 in its container: without a handler SIGTERM would be ignored
there, and Ray's own handler (installed by `ray.init`) would exit without saving, which is
why `install` is called again after `ray.init`.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Aborted(KeyboardInterrupt):
    """Raised in the main thread by a signal that stops the run at once.

    A KeyboardInterrupt: no `except Exception` on the way swallows it, and `ray.get` lets
    only that kind out of its wait (turning it into a plain KeyboardInterrupt, so callers
    catch KeyboardInterrupt and read the signal from `StopSignals`).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """The run's SIGINT/SIGTERM handling; `signum` is the first signal received."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.aborted = False
        self._deferring = False
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def install(self) -> None:
        """Handle both signals from now on (again after `ray.init` replaced SIGTERM's)."""
        if threading.current_thread() is not threading.main_thread() or self.aborted:
            return  # only the main thread may set handlers; after an abort defaults rule
        for signum in HANDLED:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def restore(self) -> None:
        """Put back the handlers found at the first `install`."""
        if threading.current_thread() is not threading.main_thread() or self.aborted:
            self._previous.clear()  # after an abort the defaults stay: a third signal kills
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        self.install()
        try:
            yield self
        finally:
            self.restore()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Inside: a first signal only asks the loop to stop after its step and save."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is None and self._deferring:
            self.signum = signum
            print(f"\n{name}: finishing this step, then saving (a second SIGTERM or Ctrl-C "
                  "aborts at once)", file=sys.stderr, flush=True)
            return
        if self.signum is None:
            self.signum = signum
        self.aborted = True
        for handled in HANDLED:
            signal.signal(handled, signal.SIG_DFL)
        print(f"\n{name}: stopping at once", file=sys.stderr, flush=True)
        raise Aborted(signum)
