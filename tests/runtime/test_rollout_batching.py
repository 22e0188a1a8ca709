"""A group's samples go to each engine as one request, and the hf engine computes each
request's rows with their own sampling parameters.

The real rollout worker runs in-process against two real hf engines over HTTP; the engines
record the rows of every request they compute (a subclass that only remembers what it was
asked), so the test sees what the worker sent, not what it meant to send.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rljob.engine.client import EngineClient
from rljob.engine.hf_server import HFEngine, ServerThread
from rljob.model.tiny_model import write_tiny
from rljob.rollout.sample import Sample
from rljob.rollout.tasks import load_task
from rljob.rollout.worker import RolloutWorker
from rljob_api.spec import RLJobSpec, TinyModel
from tests.operator.edits import merge

pytestmark = pytest.mark.runtime

N = 4  # samples per prompt
GROUPS = 3


class RecordingEngine(HFEngine):
    """The hf engine, remembering the seeds of the rows of each request it computed."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.requests: list[list[int]] = []

    def generate(self, rows: list[list[int]], params: list[dict[str, Any]],
                 epoch: int | None = None) -> list[dict[str, Any]]:
        self.requests.append([int(p["sampling_seed"]) for p in params])
        return super().generate(rows, params, epoch)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    alphabet = load_task("builtin:arithmetic", "prompt", "label").alphabet
    return write_tiny(tmp_path / "model", TinyModel(), alphabet, 0, "float32")


@pytest.fixture
def engines(model: Path) -> Iterator[list[tuple[RecordingEngine, ServerThread]]]:
    made = []
    try:
        for _ in range(2):
            engine = RecordingEngine(str(model), "float32", "cpu", "0")
            made.append((engine, ServerThread(engine)))
        yield made
    finally:
        for _, server in made:
            server.stop()


def _worker(model: Path, urls: list[str], generate: str, seed: int = 7) -> RolloutWorker:
    spec = RLJobSpec.model_validate(merge({
        "algorithm": {"rolloutBatchSize": GROUPS, "nSamplesPerPrompt": N,
                      "globalBatchSize": GROUPS * N, "microBatchSize": GROUPS * N,
                      "seed": seed},
        "rollout": {"engines": 2, "sampling": {"maxNewTokens": 3}},
        "data": {"dataset": "builtin:arithmetic", "shuffle": False},
        "generate": {"function": generate},
    }, {}))
    worker = RolloutWorker(spec.model_dump_json(by_alias=True), str(model), urls)
    assert worker.setup() == []
    return worker


def _step(model: Path, urls: list[str], generate: str, seed: int = 7) -> list[Sample]:
    samples, _ = asyncio.run(_worker(model, urls, generate, seed).generate(1))
    return samples


def _batches(seed_of: dict[tuple[int, int], int], slot: int) -> list[list[int]]:
    """The seeds of each request of engine slot `slot` (of 2): per group, its samples there."""
    return [[seed_of[g, i] for i in range(N) if (g * N + i) % 2 == slot] for g in range(GROUPS)]


def test_each_engine_gets_one_request_per_group_and_the_step_repeats(
        model: Path, engines: list[tuple[RecordingEngine, ServerThread]]) -> None:
    urls = [server.url for _, server in engines]
    samples = _step(model, urls, "builtin:default")
    assert len(samples) == GROUPS * N and all(s.response_length > 0 for s in samples)
    seed_of = {(s.group_index, s.index): s.seed for s in samples}
    # Engine e computes, per group, exactly that group's samples whose position maps to e
    # (HookArgs.engine_for), in index order, as one request.
    for e, (engine, _) in enumerate(engines):
        assert sorted(engine.requests) == sorted(_batches(seed_of, e)), (e, engine.requests)
    # The same step again gives the same tokens and log-probs: batches repeat.
    again = _step(model, urls, "builtin:default")
    assert [(s.tokens, s.rollout_log_probs) for s in again] == \
        [(s.tokens, s.rollout_log_probs) for s in samples]


def test_a_generate_function_of_the_users_is_called_once_per_sample(
        model: Path, engines: list[tuple[RecordingEngine, ServerThread]]) -> None:
    urls = [server.url for _, server in engines]
    samples = _step(model, urls, "tests.runtime.hooks_for_tests:generate_to_the_limit")
    assert len(samples) == GROUPS * N
    requests = [r for engine, _ in engines for r in engine.requests]
    assert sorted(requests) == sorted([s.seed] for s in samples)


def test_rows_of_one_request_keep_their_own_sampling_parameters(
        engines: list[tuple[RecordingEngine, ServerThread]]) -> None:
    _, server = engines[0]

    async def go() -> list[dict[str, Any]]:
        async with EngineClient(server.url) as client:
            client.wait_healthy(30)
            # Same length, different limits: each row stops at its own max_new_tokens.
            return await client.generate_many(
                [[4, 5, 6], [4, 5, 6], [7, 8, 9]],
                [{"max_new_tokens": 1, "ignore_eos": True, "sampling_seed": 1},
                 {"max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 2},
                 {"max_new_tokens": 3, "ignore_eos": True, "sampling_seed": 3,
                  "temperature": 0}])

    one, five, greedy = asyncio.run(go())
    assert len(one["output_ids"]) == 1 and len(five["output_ids"]) == 5
    assert greedy["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert [meta["meta_info"]["finish_reason"]["type"] for meta in (one, five)] == \
        ["length", "length"]


def test_the_batches_stay_the_same_while_engines_are_lost_and_requests_wait_for_one(
        model: Path, engines: list[tuple[RecordingEngine, ServerThread]]) -> None:
    """With every engine lost when the step starts, requests wait for one to serve again;
    the one that rejoins then gets both engine slots' batches, as separate requests of the
    samples each slot has in a step where both engines serve."""
    urls = [server.url for _, server in engines]
    worker = _worker(model, urls, "builtin:default")

    async def go() -> list[Sample]:
        await worker.engine_lost(0, "test: lost")
        await worker.engine_lost(1, "test: lost")
        step = asyncio.create_task(worker.generate(1))
        deadline = asyncio.get_running_loop().time() + 30
        # Requests wait for an engine (the pool made its rejoin event) before one rejoins.
        while worker.pool._rejoined is None:
            assert not step.done(), step.result()
            assert asyncio.get_running_loop().time() < deadline, "nothing waited for an engine"
            await asyncio.sleep(0.01)
        assert engines[0][0].requests == []
        await worker.engine_joined(0, urls[0])
        samples, _ = await step
        return samples

    samples = asyncio.run(go())
    assert len(samples) == GROUPS * N and all(s.response_length > 0 for s in samples)
    seed_of = {(s.group_index, s.index): s.seed for s in samples}
    assert engines[1][0].requests == []
    assert sorted(engines[0][0].requests) == sorted(_batches(seed_of, 0) + _batches(seed_of, 1))
