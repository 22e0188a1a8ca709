"""Exit codes of `rljob run` and `rljob validate`, in one place so both commands, the driver,
the docs and the operator agree (README "Exit codes"; the operator reads them as the driver
container's exit code). Both sides import the API model, so the operator does not import the
runtime for them.

Three codes say that a restart cannot help, so the job fails at once instead of retrying the
same doomed start until `maxRestarts` is used up. A signal stop is not a failure of the job's
own making: the run finished or abandoned its step, saved what it could and reported
`status.stopped`; its code is the shell's convention, 128 + the signal number.
"""

from __future__ import annotations

import signal

OK = 0
FAILED = 1  # runtime failure: a worker, engine or weight sync failed; a restart may help
INVALID = 2  # invalid job: spec, dataset, model source or hooks
NONFINITE = 3  # stopped on non-finite loss, gradients or weights; evidence kept
ENGINES_EXHAUSTED = 4  # rollout engines lost more often than spec.recovery.maxEngineRestarts
INTERRUPTED = 128 + signal.SIGINT  # 130: stopped by SIGINT (Ctrl-C)
TERMINATED = 128 + signal.SIGTERM  # 143: deletion, suspension, preemption; state saved

# Exit code → the reason the job fails with when the runtime reported no reason of its own
# (`status.runtimeFailure`) for that attempt.
TERMINAL_REASONS: dict[int, str] = {
    INVALID: "InvalidSpec",
    NONFINITE: "NonFiniteValues",
    ENGINES_EXHAUSTED: "EngineRestartsExhausted",
}

# The runtime's reason (`status.runtimeFailure.reason`) for a worker or engine that died or
# raised when Ray could not say which pods went (Ray's head went with its node, say): the
# operator looks for a node that is not Ready behind it.
WORKER_FAILED = "WorkerFailed"

TERMINAL_MEANING: dict[int, str] = {
    INVALID: "the job is invalid (spec, dataset, model source or hooks)",
    NONFINITE: "the runtime stopped on non-finite loss, gradients or weights",
    ENGINES_EXHAUSTED: ("rollout engines were lost more often than "
                        "spec.recovery.maxEngineRestarts allows"),
}


def for_signal(signum: int) -> int:
    """The exit code of a run stopped by signal `signum`."""
    return 128 + signum


class JobError(Exception):
    """Stops the run with exit code `code` and a message (no traceback): a failure the run
    names itself, as opposed to one raised from a worker."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)
