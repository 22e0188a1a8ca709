"""Child processes the tests start in their own process group (`start_new_session=True`)."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

import psutil


def reap(proc: subprocess.Popen[Any]) -> None:
    """Kill the whole group of a child still running (Ray and engines included) and wait."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def listening_pid(port: int) -> int:
    """The pid of the process listening on TCP `port` (e.g. an engine's actor process)."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return int(conn.pid)
    raise AssertionError(f"no process listens on port {port}")
