"""Exit codes of `rljob run` and `rljob validate`, in one place so both commands, the driver
and the docs agree (README "Exit codes"; the operator sees them as the driver container's
exit code).

A signal stop is not a failure: the run finished or abandoned its step, saved what it could
and reported `status.stopped`; the code is the shell's convention, 128 + the signal number.
"""

from __future__ import annotations

import signal

from rljob_api.exits import INVALID, NONFINITE, TERMINATED

# INVALID (2: spec, dataset, model source or hooks; a restart cannot help), NONFINITE (3:
# non-finite loss, gradients or weights; evidence kept) and TERMINATED (143: SIGTERM, i.e.
# suspend, preemption, deletion) are the codes the operator acts on, defined with the API.
OK = 0
FAILED = 1  # runtime failure: a worker, engine or weight sync failed; a restart may help
INTERRUPTED = 128 + signal.SIGINT  # 130: stopped by SIGINT (Ctrl-C)
__all__ = ["FAILED", "INTERRUPTED", "INVALID", "NONFINITE", "OK", "TERMINATED", "JobError",
           "for_signal"]


def for_signal(signum: int) -> int:
    """The exit code of a run stopped by signal `signum`."""
    return 128 + signum


class JobError(Exception):
    """Stops the run with exit code `code` and a message (no traceback): a failure the run
    names itself, as opposed to one raised from a worker."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)
