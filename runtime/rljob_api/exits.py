"""Exit codes of the driver (`rljob run`) that the operator acts on.

The runtime exits with these codes (runtime/rljob/exit_codes.py holds the full list, and a
unit test checks the two agree); the operator reads them as the driver container's exit
code. Both sides import the API model, so the operator does not import the runtime for them.

Two codes say that a restart cannot help, so the job fails at once instead of retrying the
same doomed start until `maxRestarts` is used up. A signal stop (143, SIGTERM) is not a
failure of the job's own making: the runtime saved what it could, and a restart resumes.
"""

from __future__ import annotations

INVALID = 2  # invalid job: spec, dataset, model source or hooks
NONFINITE = 3  # stopped on non-finite loss, gradients or weights; evidence kept
TERMINATED = 143  # stopped by SIGTERM (128 + 15): deletion, preemption; state saved

# Exit code → the reason the job fails with when the runtime reported no reason of its own
# (`status.runtimeFailure`) for that attempt.
TERMINAL_REASONS: dict[int, str] = {
    INVALID: "InvalidSpec",
    NONFINITE: "NonFiniteValues",
}

TERMINAL_MEANING: dict[int, str] = {
    INVALID: "the job is invalid (spec, dataset, model source or hooks)",
    NONFINITE: "the runtime stopped on non-finite loss, gradients or weights",
}
