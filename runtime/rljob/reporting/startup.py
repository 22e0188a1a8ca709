"""How long a run takes to start, phase by phase: one `startup:` line per attempt, from the
driver process's own start (the interpreter and its imports count) to the first rollout
request. The same line is printed by `rljob run` on a laptop and by the driver pod on a
cluster, so a slow start shows where it went: imports, Ray, placement, each actor's
constructor, the first weights. `benchmarks/startup.py` reads it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

PREFIX = "startup:"
SEPARATOR = " · "
# The last mark: from here on the loop is generating.
FIRST_ROLLOUT = "first rollout request"
CALLBACK_WAIT_S = 5.0

_IMPORTED_AT = time.time()


def process_started_at() -> float:
    """Wall-clock time this process started: the kernel's record of it on Linux (so the
    interpreter's start and every import count), else when this module was first imported."""
    try:
        with open("/proc/self/stat") as stat_file:
            # Field 22 (starttime, in clock ticks after boot); the command name in field 2
            # may hold spaces, so fields are counted after its closing parenthesis.
            start_ticks = int(stat_file.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime_file:
            uptime = float(uptime_file.read().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


@dataclass(frozen=True)
class Mark:
    name: str
    at_s: float  # seconds after the start


class StartupClock:
    """Marks of one attempt's start-up, each the seconds since `started_at`. Actor readiness
    is marked when Ray reports the actor's constructor done (a callback, never a wait), so
    marking costs the start-up nothing."""

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self.marks: list[Mark] = []
        self.printed = False
        self._lock = threading.Lock()
        self._watched: set[str] = set()  # actors whose readiness is not marked yet

    def mark(self, name: str) -> None:
        with self._lock:
            if not self.printed:
                self.marks.append(Mark(name, time.time() - self.started_at))

    def watch(self, name: str, handle: Any) -> None:
        """Mark `<name> ready` when the actor `handle` has finished its constructor."""
        future = handle.__ray_ready__.remote().future()
        with self._lock:
            self._watched.add(name)

        def done(result: Any) -> None:
            if result.exception() is None:
                self.mark(f"{name} ready")
            with self._lock:
                self._watched.discard(name)

        future.add_done_callback(done)

    def line(self) -> str:
        with self._lock:
            marks = sorted(self.marks, key=lambda m: m.at_s)
        return PREFIX + " " + SEPARATOR.join(f"{m.name} {m.at_s:.2f}s" for m in marks)

    def finish(self) -> None:
        """Mark the first rollout request and print the line, once per attempt."""
        if self.printed:
            return
        self.mark(FIRST_ROLLOUT)
        # Every actor is ready by now, but Ray runs the readiness callbacks on a thread of
        # its own, which may lag the driver by moments.
        deadline = time.monotonic() + CALLBACK_WAIT_S
        while time.monotonic() < deadline:
            with self._lock:
                if not self._watched:
                    break
            time.sleep(0.01)
        print(self.line(), file=sys.stderr, flush=True)
        with self._lock:
            self.printed = True


def parse(line: str) -> list[Mark]:
    """The marks of a printed `startup:` line (from the prefix on: a progress bar redrawn
    with carriage returns may share the terminal line), in order."""
    body = line.split(PREFIX, 1)[1].strip()
    marks = []
    for part in body.split(SEPARATOR):
        name, _, seconds = part.rpartition(" ")
        marks.append(Mark(name, float(seconds.rstrip("s"))))
    return marks
