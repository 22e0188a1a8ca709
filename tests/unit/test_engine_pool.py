"""The rollout worker's engine pool on requests that fail: one whose connection failed on an
engine that still answers /health is sent again (a bounded number of times), one the engine
answered with an error is the caller's, and one on an engine whose /health is silent takes
that engine out and goes elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from rljob.engine.client import EngineError
from rljob.rollout.engine_pool import UNANSWERED_TRIES, EnginePool

pytestmark = pytest.mark.unit

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def pool(healthy: dict[str, bool]) -> EnginePool:
    engines = EnginePool(URLS)
    for client in engines.clients.values():
        client.healthy = lambda timeout, url=client.base_url: healthy[url]  # type: ignore[method-assign,assignment,misc]
    return engines


def failing(errors: list[EngineError]) -> tuple[list[str], Callable[[], Awaitable[str]]]:
    """A request that raises each of `errors` in turn, then succeeds; records each try."""
    tries: list[str] = []

    async def request() -> str:
        tries.append("try")
        if len(tries) <= len(errors):
            raise errors[len(tries) - 1]
        return "done"

    return tries, request


def test_a_cut_connection_on_an_engine_that_answers_is_sent_again_a_few_times() -> None:
    engines = pool({URLS[0]: True, URLS[1]: True})
    cut = EngineError(URLS[0], "POST /generate", "ServerDisconnectedError")
    tries, request = failing([cut] * UNANSWERED_TRIES)
    assert asyncio.run(engines.run(request)) == "done"
    assert len(tries) == UNANSWERED_TRIES + 1 and engines.reissued == UNANSWERED_TRIES
    assert not engines.lost

    tries, request = failing([cut] * (UNANSWERED_TRIES + 1))
    with pytest.raises(EngineError, match="ServerDisconnectedError"):
        asyncio.run(engines.run(request))
    assert len(tries) == UNANSWERED_TRIES + 1


def test_an_engines_own_error_answer_is_the_callers() -> None:
    engines = pool({URLS[0]: True, URLS[1]: True})
    refused = EngineError(URLS[0], "POST /generate", "HTTP 400: bad input", answered=True)
    tries, request = failing([refused])
    with pytest.raises(EngineError, match="HTTP 400"):
        asyncio.run(engines.run(request))
    assert len(tries) == 1 and engines.reissued == 0 and not engines.lost


def test_a_failure_on_an_engine_whose_health_is_silent_takes_it_out() -> None:
    engines = pool({URLS[0]: False, URLS[1]: True})
    engines_sleep = asyncio.sleep

    async def no_wait(_: float) -> None:
        await engines_sleep(0)

    cut = EngineError(URLS[0], "POST /generate", "ClientConnectorError", answered=True)
    tries, request = failing([cut])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(asyncio, "sleep", no_wait)
        assert asyncio.run(engines.run(request)) == "done"
    assert engines.lost.keys() == {0} and [c.base_url for c in engines.serving] == [URLS[1]]
    assert engines.reissued == 1 and len(tries) == 2
