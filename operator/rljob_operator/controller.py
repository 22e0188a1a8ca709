"""Schedules reconciles: a deduplicating work queue with a periodic resync per job.

Watch events only *kick* a job; the reconcile reads the job's current state (from the watch
cache, fresh from the API server when the cache may be behind: see reconciler.py), so a
repeated event costs one reconcile from the cache and a lost kick at most one interval. A
job is never reconciled by two workers at once (a kick during a reconcile queues exactly
one more). Errors back off exponentially per job, capped, and the next resync retries: a
broken child cannot wedge the loop, and no handler retries forever against the same stale
state.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable

log = logging.getLogger("rljob_operator")
Key = tuple[str, str]


class Gone(enum.Enum):
    """A reconcile's answer when the API server no longer has the job: its deletion event
    may have been lost in a watch gap, and the job must leave the queue all the same."""

    GONE = "gone"


GONE = Gone.GONE
ReconcileFn = Callable[[str, str], "float | Gone | None"]


class Controller:
    def __init__(self, reconcile: ReconcileFn, interval: float, workers: int = 4,
                 max_error_backoff: float = 60.0) -> None:
        self.reconcile = reconcile
        self.interval = interval
        self.workers = workers
        self.max_error_backoff = max_error_backoff
        self.known: set[Key] = set()
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._running: set[Key] = set()
        self._dirty: set[Key] = set()
        self._due: dict[Key, float] = {}
        self._errors: dict[Key, int] = {}
        self.heartbeat = time.monotonic()

    def track(self, key: Key) -> None:
        self.known.add(key)
        self.kick(key)

    def forget(self, key: Key) -> None:
        self.known.discard(key)
        self._due.pop(key, None)
        self._errors.pop(key, None)

    def kick(self, key: Key) -> None:
        """Reconcile `key` soon (it must be a known job); call from the event loop only."""
        if key not in self.known:
            return
        if key in self._running:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]
        tasks.append(asyncio.create_task(self._ticker()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _ticker(self) -> None:
        tick = min(0.25, self.interval)
        while True:
            now = time.monotonic()
            self.heartbeat = now
            for key, due in list(self._due.items()):
                if due <= now:
                    del self._due[key]
                    self.kick(key)
            await asyncio.sleep(tick)

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            self._running.add(key)
            try:
                after = await asyncio.to_thread(self.reconcile, *key)
                self._errors.pop(key, None)
                if after is GONE and key not in self._dirty:
                    self.forget(key)  # unless an event came meanwhile (made again?)
                    continue
                delay = (self.interval if after is None or after is GONE
                         else max(0.0, min(after, self.interval)))
            except Exception as err:
                failures = self._errors[key] = self._errors.get(key, 0) + 1
                delay = min(2.0 ** failures, self.max_error_backoff)
                log.warning("reconcile of %s/%s failed (%d in a row, retry in %.0fs): %s",
                            *key, failures, delay, err)
            finally:
                self._running.discard(key)
            if key in self.known:
                self._due[key] = time.monotonic() + delay
            if key in self._dirty:
                self._dirty.discard(key)
                self.kick(key)
