"""What the operator remembers of each job between reconciles: one record per job.

Held in memory only; none of it is durable state. A restarted operator reads every job
fresh, checks its support objects at once, finds an object in the way at its next create
and learns of pod failures from the watch again. With hundreds of jobs made and deleted,
anything kept per job must go with the job: forgetting one is a single delete.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from rljob_operator.engine_events import Seen
from rljob_operator.observe import FailureHint, InTheWay

Key = tuple[str, str]  # namespace, name
MAX_HINTS_PER_JOB = 64


@dataclass(frozen=True)
class SupportCheck:
    """The last check of a job's support objects: for which job and spec (`version`), when
    (monotonic seconds), and the wait before the next one."""

    version: str
    at: float
    wait: float


@dataclass(frozen=True)
class Ensured:
    """When a check last made sure of every support object, and for which job and spec."""

    version: str
    at: float


@dataclass(frozen=True)
class ClaimModes:
    """The access modes found of the job's checkpoint claim (a claim's modes cannot change)."""

    claim: str
    modes: tuple[str, ...]


@dataclass
class JobMemory:
    # Pod failures seen on the watch stream, by pod, oldest first (KubeRay deletes failed
    # pods at once: these name the cause better than "deleted").
    hints: dict[str, FailureHint] = field(default_factory=dict)
    # The last object found in the way of a child's create; checked again at each reconcile.
    in_the_way: InTheWay | None = None
    # When the job was last read from the API server (monotonic seconds, shifted back by a
    # per-job offset after the first read).
    fresh_at: float | None = None
    support: SupportCheck | None = None
    ensured: Ensured | None = None
    claim: ClaimModes | None = None
    # status.engines as last seen (`engine_events.seen`).
    engines: Seen | None = None

    def holds_state(self) -> bool:
        """Whether anything besides failure hints is remembered."""
        return any(value is not None for value in (
            self.in_the_way, self.fresh_at, self.support, self.ensured, self.claim,
            self.engines))


class Memory:
    """A `JobMemory` per job. Thread-safe: watch events record pod failures on the event
    loop, reconciles read and update the records from worker threads."""

    def __init__(self) -> None:
        self._jobs: dict[Key, JobMemory] = {}
        self._lock = threading.Lock()

    @contextmanager
    def job(self, key: Key) -> Iterator[JobMemory]:
        """The job's record (made if there is none), held under the lock until the block
        ends; no API call belongs inside the block."""
        with self._lock:
            yield self._jobs.setdefault(key, JobMemory())

    def record_failure(self, key: Key, pod: str, hint: FailureHint) -> None:
        """Remember a pod's failure; a pod seen failed again (every watch re-list repeats its
        events) keeps the time it was first seen. The oldest go past MAX_HINTS_PER_JOB."""
        with self.job(key) as job:
            known = job.hints.get(pod)
            if known is not None and known.seen_at is not None:
                hint = replace(hint, seen_at=known.seen_at)
            job.hints[pod] = hint
            while len(job.hints) > MAX_HINTS_PER_JOB:
                job.hints.pop(next(iter(job.hints)))

    def snapshot(self, key: Key) -> JobMemory:
        """A copy of the job's record (an empty one when there is none; none is made)."""
        with self._lock:
            held = self._jobs.get(key)
            return replace(held, hints=dict(held.hints)) if held is not None else JobMemory()

    def hints(self, key: Key) -> dict[str, FailureHint]:
        return self.snapshot(key).hints

    def forget(self, key: Key, keep_reads: bool = False) -> None:
        """Drop the job's record; `keep_reads` keeps when it was last read fresh."""
        with self._lock:
            held = self._jobs.pop(key, None)
            if keep_reads and held is not None and held.fresh_at is not None:
                self._jobs[key] = JobMemory(fresh_at=held.fresh_at)

    def jobs_with_hints(self) -> int:
        with self._lock:
            return sum(1 for job in self._jobs.values() if job.hints)

    def jobs_with_state(self) -> int:
        """Jobs with anything besides failure hints remembered: none once every job is gone."""
        with self._lock:
            return sum(1 for job in self._jobs.values() if job.holds_state())
