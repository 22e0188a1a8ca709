"""The engines the rollout worker sends requests to, as engines are lost and rejoin.

A lost engine costs its requests, not the step: a request that fails on an engine that no
longer answers its /health is sent again to an engine still serving, with the same
sampling seed, so its group is generated once and its sample is the one an uninterrupted
run would have drawn from that engine's weights. The driver decides when an engine is back
(`rljob.cluster.engine_recovery`): only once its replacement installed the version the
other engines serve is it given requests again (`join`). While no engine serves, requests
wait for one, up to `WAIT_FOR_ENGINE_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rljob.engine.client import EngineClient, EngineError

T = TypeVar("T")

# How long requests wait for an engine to serve when every engine is lost: a replacement
# starts in a new pod (an image pull, a model load) and installs the current version first.
WAIT_FOR_ENGINE_S = 900.0
# An engine is taken as lost when a request to it failed and its /health does not answer
# within this many tries, one a second (a loaded engine may be slow to answer one).
HEALTH_TRIES = 3
# A request whose connection failed (no answer at all) on an engine that still answers its
# /health is sent again up to this many times: its pod may be stopping, or the connection
# was cut under it. An engine's own answer (an HTTP error, a malformed body) is not retried.
UNANSWERED_TRIES = 3


class NoEngineServing(RuntimeError):
    """Every engine was lost and none rejoined in time."""


class EnginePool:
    """Engine clients by engine index; `serving` is the list hooks see as `args.engines`,
    changed in place when an engine is lost or rejoins."""

    def __init__(self, urls: list[str], reissue: bool = True) -> None:
        """`reissue` False: a request that fails on a lost engine fails the step (the job
        does not replace engines: `RLJobSpec.replaces_engines`)."""
        self.reissue = reissue
        self.clients: dict[int, EngineClient] = {i: EngineClient(u) for i, u in enumerate(urls)}
        self.lost: dict[int, str] = {}  # engine index → why
        self.serving: list[EngineClient] = list(self.clients.values())
        self.reissued = 0  # samples sent again after their engine was lost
        self._rejoined: asyncio.Event | None = None

    def _rebuild(self) -> None:
        self.serving[:] = [c for i, c in sorted(self.clients.items()) if i not in self.lost]

    def index_of(self, url: str) -> int | None:
        for i, client in self.clients.items():
            if client.base_url == url.rstrip("/"):
                return i
        return None

    async def lose(self, index: int, why: str) -> None:
        """No more requests to engine `index`; those in flight on it fail at once (its
        session is closed) and are sent again elsewhere."""
        if index in self.lost or index not in self.clients:
            return
        self.lost[index] = why
        self._rebuild()
        self.clients[index].retired = True
        with contextlib.suppress(Exception):
            await self.clients[index].aclose()

    async def join(self, index: int, url: str) -> None:
        """Engine `index` serves again at `url` (a replacement with the current weights, or
        the engine itself when it answers after all)."""
        old = self.clients.get(index)
        if old is not None and old.retired:
            self.clients[index] = EngineClient(url)
        elif old is not None and old.base_url != url.rstrip("/"):
            with contextlib.suppress(Exception):
                await old.aclose()
            self.clients[index] = EngineClient(url)
        self.lost.pop(index, None)
        self._rebuild()
        if self._rejoined is not None:
            self._rejoined.set()

    async def _wait_serving(self) -> None:
        if self.serving:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_FOR_ENGINE_S
        while not self.serving:
            left = deadline - loop.time()
            if left <= 0:
                raise NoEngineServing(
                    f"no rollout engine has served for {WAIT_FOR_ENGINE_S:.0f}s: "
                    + "; ".join(f"engine-{i}: {why}" for i, why in sorted(self.lost.items())))
            self._rejoined = self._rejoined or asyncio.Event()
            self._rejoined.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._rejoined.wait(), min(left, 5.0))

    async def _answers(self, client: EngineClient) -> bool:
        for attempt in range(HEALTH_TRIES):
            if await asyncio.to_thread(client.healthy, 2.0):
                return True
            if attempt + 1 < HEALTH_TRIES:
                await asyncio.sleep(1.0)
        return False

    async def _lost_in(self, err: EngineError) -> bool:
        """Whether `err` came from an engine that is gone (then it is taken out): one the
        pool already took out, or one that no longer answers /health. An engine that
        answers refused the request itself, and that error is the caller's."""
        if not self.reissue:
            return False
        index = self.index_of(err.url)
        if index is None or index in self.lost:
            return True  # a replaced engine's old address, or one already taken out
        if await self._answers(self.clients[index]):
            return False
        await self.lose(index, f"a request failed and /health did not answer: {err}")
        return True

    async def run(self, request: Callable[[], Awaitable[T]], rows: int = 1) -> T:
        """`request()` (a generate hook call on `serving`, for `rows` samples), sent again
        while the engine it failed on turns out lost, or while its connection failed without
        an answer (at most UNANSWERED_TRIES times). `reissued` counts the samples sent
        again."""
        unanswered = 0
        while True:
            await self._wait_serving()
            try:
                return await request()
            except EngineError as err:
                if not await self._lost_in(err):
                    if err.answered or unanswered >= UNANSWERED_TRIES:
                        raise
                    unanswered += 1
                self.reissued += rows

    async def abort_all(self) -> None:
        """Partial rollout's cut on every engine serving; one lost meanwhile has nothing
        left to abort."""
        async def abort(client: EngineClient) -> None:
            with contextlib.suppress(EngineError):
                await client.abort_all()

        await asyncio.gather(*(abort(c) for c in list(self.serving)))

    async def aclose(self) -> None:
        """Close every engine's session at the end of a call (each opens again on use): an
        idle kept connection would be closed under the next step's first request."""
        await asyncio.gather(*(c.aclose() for c in self.clients.values()),
                             return_exceptions=True)
