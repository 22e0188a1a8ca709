"""`python -m rljob.engine.die_with_parent PARENT_PID -- COMMAND...`: exec COMMAND so that
it is SIGKILLed when the process that started it dies.

The parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGKILL)`, Linux) is set here, in a fresh
interpreter, and survives the `exec` into COMMAND, so COMMAND keeps this process's pid. It is
set in a program of its own rather than in a `preexec_fn`: the engine's parent is a Ray
worker with many threads, and Python code between fork and exec in such a process can
deadlock (the `subprocess` documentation says so).

If PARENT_PID is no longer this process's parent once the signal is armed, the parent died
in between and nothing would ever deliver it, so COMMAND is not started.

The kernel sends the signal when the *thread* that forked this process exits; the engine
actors call `sglang_launcher.spawn` from their task thread, which lives as long as the actor.

Elsewhere than Linux there is no parent-death signal: COMMAND is started as it is.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
# What this program exits with when its parent was already gone (nothing is started).
PARENT_GONE = 70


def arm_parent_death_signal() -> None:
    """Ask the kernel to SIGKILL this process when its parent thread exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.exit("usage: python -m rljob.engine.die_with_parent PARENT_PID -- COMMAND...")
    parent, command = int(argv[0]), argv[2:]
    arm_parent_death_signal()
    if os.getppid() != parent:
        sys.exit(PARENT_GONE)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
