"""Dynamic sampling in the rollout worker: zero-variance groups are dropped and replaced,
the bound fills the batch with dropped groups, the counts are reported, and the data cursor
resumes exactly. Runs the real worker in-process with scripted hooks (no engine), so which
groups have equal rewards is known in advance."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from rljob.model.tiny_model import write_tiny
from rljob.rollout.hooks import HookError
from rljob.rollout.sample import Sample
from rljob.rollout.stats import RolloutStats
from rljob.rollout.tasks import load_task
from rljob.rollout.worker import RolloutWorker
from rljob_api.spec import RLJobSpec, TinyModel
from tests.operator.edits import merge

pytestmark = pytest.mark.unit

# Label `v`: rewards differ within the group; `u`: all equal (label_decides_variance).
LABELS = ["u", "v", "u", "u", "v", "u", "v", "u"]
HOOKS = "tests.runtime.hooks_for_tests"


def _worker(tmp_path: Path, generate: str = "scripted_generate", tis: bool = False,
            dynamic: bool = True, more: dict[str, Any] | None = None) -> RolloutWorker:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "label": label}) + "\n"
                            for i, label in enumerate(LABELS)))
    spec = RLJobSpec.model_validate(merge({
        "algorithm": {"rolloutBatchSize": 2, "nSamplesPerPrompt": 2, "globalBatchSize": 4,
                      "microBatchSize": 4, "tis": {"enabled": tis},
                      "dynamicSampling": {"enabled": dynamic, "maxRounds": 3}},
        "data": {"dataset": str(data), "shuffle": False},
        "generate": {"function": f"{HOOKS}:{generate}"},
        "reward": {"function": f"{HOOKS}:label_decides_variance"},
    }, more or {}))
    alphabet = load_task(str(data), "prompt", "label").alphabet
    model = write_tiny(tmp_path / "model", TinyModel(), alphabet, 0, "float32")
    worker = RolloutWorker(spec.model_dump_json(by_alias=True), str(model),
                           ["http://127.0.0.1:9"])  # never dialled: the hooks use no engine
    assert worker.setup() == []
    return worker


def _step(worker: RolloutWorker, step: int) -> tuple[list[Sample], RolloutStats]:
    return asyncio.run(worker.generate(step))


def _prompts(samples: list[Sample]) -> list[tuple[int, str]]:
    return [(s.group_index, s.prompt) for s in samples]


def test_zero_variance_groups_are_replaced_then_fill_the_batch_at_the_bound(
        tmp_path: Path) -> None:
    worker = _worker(tmp_path)
    samples, stats = _step(worker, 0)
    # round 1: p0 (u, set aside), p1 (v, kept); round 2: p2 (u); round 3 (the bound): p3 (u);
    # then the first set-aside group, p0, fills the one missing group.
    assert _prompts(samples) == [(0, "p1"), (0, "p1"), (1, "p0"), (1, "p0")]
    assert (stats.generation_rounds, stats.generated_groups, stats.filtered_groups,
            stats.filtered_groups_kept) == (3.0, 4.0, 3.0, 1.0)
    # every group generated this step had its own seeds (p1 was group 1 of round 1)
    assert samples[0].seed != samples[2].seed
    assert worker.state() == {"epoch": 0, "index": 4, "buffer": []}  # dropped prompts consumed

    samples, stats = _step(worker, 1)
    # round 1: p4 (v) kept, p5 (u) dropped; round 2: p6 (v) kept: full, nothing filled in
    assert _prompts(samples) == [(0, "p4"), (0, "p4"), (1, "p6"), (1, "p6")]
    assert (stats.generation_rounds, stats.filtered_groups,
            stats.filtered_groups_kept) == (2.0, 1.0, 0.0)
    assert worker.state() == {"epoch": 0, "index": 7, "buffer": []}


def test_a_resumed_worker_generates_what_an_uninterrupted_one_does(tmp_path: Path) -> None:
    straight = _worker(tmp_path / "a")
    _step(straight, 0)
    saved = straight.state()
    expected = _step(straight, 1)[0]
    resumed = _worker(tmp_path / "b")
    resumed.load(json.loads(json.dumps(saved)))  # as a checkpoint stores it
    assert _step(resumed, 1)[0] == expected


def test_without_dynamic_sampling_equal_reward_groups_are_trained_on(tmp_path: Path) -> None:
    worker = _worker(tmp_path, dynamic=False)
    samples, stats = _step(worker, 0)
    assert _prompts(samples) == [(0, "p0"), (0, "p0"), (1, "p1"), (1, "p1")]
    assert stats.generation_rounds == 1.0 and stats.filtered_groups is None


@pytest.mark.parametrize(("tis", "more", "named"), [
    (True, None, r"spec\.algorithm\.tis is enabled"),
    (False, {"rollout": {"mode": "async"}},
     r"spec\.algorithm\.oldLogprobs is rollout \(the default with rollout\.mode async\)"),
    (False, {"algorithm": {"oldLogprobs": "rollout"}},
     r"spec\.algorithm\.oldLogprobs is rollout but"),
], ids=["tis", "async-rollout-old-logprobs", "rollout-old-logprobs-set"])
def test_engine_log_probs_are_required_where_the_loss_uses_them(
        tmp_path: Path, tis: bool, more: dict[str, Any] | None, named: str) -> None:
    worker = _worker(tmp_path, generate="scripted_generate_without_log_probs", tis=tis,
                     more=more)
    with pytest.raises(HookError, match=named + r" .* Sample\.rollout_log_probs"):
        _step(worker, 0)
    assert _step(_worker(tmp_path / "ok", tis=tis, more=more), 0)[0]  # with log-probs it runs
    # a sync run without tis takes the trainer's log-probs: the engine's are not needed
    assert _step(_worker(tmp_path / "sync", generate="scripted_generate_without_log_probs",
                         dynamic=True), 0)[0]
