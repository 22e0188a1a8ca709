"""Evaluation during training (spec.eval): what the rollout worker measures against a real
hf engine, and where a run puts it (metrics.jsonl, status.progress, curves.png)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rljob.cluster.cluster import RunOptions
from rljob.driver.model_files import prepare_model
from rljob.driver.run import run_job
from rljob.engine.hf_server import HFEngine, ServerThread
from rljob.reporting import metrics_log
from rljob.rollout.sample import Sample
from rljob.rollout.stats import EvalResult
from rljob.rollout.worker import RolloutWorker, sample_seed
from rljob_api.exits import OK as EXIT_OK
from rljob_api.spec import RLJobSpec
from tests.runtime import hooks_for_tests
from tests.runtime.conftest import RecordingReporter
from tests.runtime.jobs import job_spec

pytestmark = pytest.mark.runtime

RECORDING = {"function": "tests.runtime.hooks_for_tests:recording_reward"}


def held_out(tmp: Path) -> dict[str, Any]:
    """spec.eval every 2 steps on 12 sums the training set (builtin:arithmetic) also has, in
    a JSONL file: small, so every evaluation takes seconds on a busy 2-core machine."""
    path = tmp / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n"
                            for a in range(4) for b in range(3)))
    return {"dataset": str(path), "interval": 2}


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """The tiny model of the test job, served by an hf engine in this process."""
    model = prepare_model(job_spec(tmp_path, {"eval": held_out(tmp_path)}), tmp_path / "work")
    server = ServerThread(HFEngine(str(model), "float32", "cpu", "0"))
    try:
        yield model, server.url
    finally:
        server.stop()


def _evaluate(tmp_path: Path, engine: tuple[Path, str],
              *overrides: dict[str, Any]) -> tuple[EvalResult, list[Sample]]:
    """One evaluation by a rollout worker in this process; the result and every eval sample
    the reward function scored, in (prompt, sample) order."""
    spec = job_spec(tmp_path, {"eval": held_out(tmp_path), "reward": RECORDING}, *overrides)
    model, url = engine
    worker = RolloutWorker(spec.model_dump_json(by_alias=True), str(model), [url])
    assert worker.setup() == []
    hooks_for_tests.REWARDED.clear()
    result = asyncio.run(worker.evaluate())
    samples = sorted(hooks_for_tests.REWARDED, key=lambda s: (s.group_index, s.index))
    return result, samples


def test_greedy_eval_ignores_the_seeds_and_sampling_does_not(
        tmp_path: Path, engine: tuple[Path, str]) -> None:
    def responses(seed: int, greedy: bool) -> tuple[float, list[str]]:
        result, samples = _evaluate(tmp_path, engine, {
            "algorithm": {"seed": seed}, "eval": {"greedy": greedy},
            "rollout": {"sampling": {"temperature": 2.0}}})
        assert result.prompts == len(samples) and result.samples_per_prompt == 1
        return result.reward, [s.response for s in samples]

    greedy_a, greedy_b = responses(1, True), responses(2, True)
    assert greedy_a == greedy_b  # the same weights decode the same answers at any seed
    sampled_a, sampled_b = responses(1, False), responses(2, False)
    assert sampled_a[1] != sampled_b[1]  # while sampling does depend on the seeds
    assert sampled_a == responses(1, False)  # ... which are fixed per prompt and sample


def test_several_samples_per_prompt_score_mean_and_best(
        tmp_path: Path, engine: tuple[Path, str]) -> None:
    result, samples = _evaluate(tmp_path, engine, {"eval": {"samplesPerPrompt": 3,
                                                            "maxNewTokens": 2}})
    assert (result.prompts, result.samples_per_prompt, result.aborted) == (12, 3, 0)
    assert len(samples) == 3 * 12 and len({s.prompt for s in samples}) == 12
    assert all(s.response_length <= 2 for s in samples)  # eval.maxNewTokens, not sampling's 4
    rewards = [s.reward or 0.0 for s in samples]
    best = [max(rewards[i:i + 3]) for i in range(0, len(rewards), 3)]
    assert result.reward == pytest.approx(sum(rewards) / len(rewards))
    assert result.best_reward == pytest.approx(sum(best) / len(best))
    assert 0.0 <= result.reward <= result.best_reward <= 1.0
    assert set(result.metrics()) == {"eval_reward", "eval_reward_max", "eval_seconds"}
    # one seed per (prompt, sample), none of them a training sample's seed
    seeds = [s.seed for s in samples]
    assert len(set(seeds)) == len(seeds)
    seed = RLJobSpec().algorithm.seed
    training = {sample_seed(seed, step, g, i)
                for step in range(100) for g in range(64) for i in range(8)}
    assert not training & set(seeds)


def test_a_run_reports_eval_at_its_interval_and_last_step_across_a_resume(
        ray_local: None, tmp_path: Path) -> None:
    """Steps 1-2, then a resumed attempt runs 3-5: evaluations at 2, 4 and the last step 5,
    and the resumed attempt's status shows step 2's evaluation until its own."""
    spec = job_spec(tmp_path, {  # small steps: the test is about when evaluations happen
        "algorithm": {"rolloutBatchSize": 4, "nSamplesPerPrompt": 2, "globalBatchSize": 8,
                      "stepsPerRollout": 1, "microBatchSize": 8, "totalSteps": 5},
        "eval": {**held_out(tmp_path), "samplesPerPrompt": 2}})
    workdir = tmp_path / "w"
    first, second = RecordingReporter(), RecordingReporter()
    assert run_job("job", spec, RunOptions(workdir, max_steps=2), first) == EXIT_OK
    assert run_job("job", spec, RunOptions(workdir), second) == EXIT_OK
    rows = metrics_log.read(workdir / metrics_log.METRICS_FILE)
    evaluated = {int(r["step"]): r for r in rows if "eval_reward" in r}
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert sorted(evaluated) == [2, 4, 5]  # every 2 steps, and the last one
    for row in evaluated.values():
        assert isinstance(row["eval_reward"], float) and 0.0 <= row["eval_reward"] <= 1.0
        assert row["eval_reward"] <= row["eval_reward_max"] <= 1.0
        assert row["eval_seconds"] > 0
    assert not any("eval_reward_max" in r or "eval_seconds" in r
                   for r in rows if r["step"] not in evaluated)
    # status.progress carries the latest eval, also on the steps between evaluations
    shown = [(p.rollout_step, p.eval_step, p.eval_reward)
             for p in [*first.progresses, *second.progresses]]
    assert shown == [
        (0, None, None),  # each attempt shows where it starts before its first step
        (1, None, None),
        (2, 2, evaluated[2]["eval_reward"]),
        (2, 2, evaluated[2]["eval_reward"]),  # resumed: step 2 and its eval, from the log
        (3, 2, evaluated[2]["eval_reward"]),  # the resumed attempt, before its first eval
        (4, 4, evaluated[4]["eval_reward"]),
        (5, 5, evaluated[5]["eval_reward"]),
    ]
    assert metrics_log.reward_curves(rows)["eval reward"] == (
        [2, 4, 5], [evaluated[s]["eval_reward"] for s in (2, 4, 5)])
    assert (workdir / metrics_log.PLOT_FILE).stat().st_size > 0
