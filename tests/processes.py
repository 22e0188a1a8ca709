"""Child processes the tests start in their own process group (`start_new_session=True`)."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


def reap(proc: subprocess.Popen[Any]) -> None:
    """Kill the whole group of a child still running (Ray and engines included) and wait."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
