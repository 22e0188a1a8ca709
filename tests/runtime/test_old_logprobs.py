"""`algorithm.oldLogprobs` in a real torch trainer rank (Ray, tiny model, CPU): which log-probs
the loss takes as the old policy decides which tokens its clip holds, and the
rollout/trainer gap is reported against the trainer's own recompute either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray
from transformers import AutoModelForCausalLM

from rljob.cluster.cluster import rendezvous_address
from rljob.cluster.trainer_group import TrainerGroup
from rljob.driver.model_files import prepare_model
from rljob.trainer.metrics import TrainMetrics
from rljob.trainer.torch.actor import TorchTrainer
from tests.logprob_samples import (
    ENGINE_EXCESS,
    NEGATIVE_ADVANTAGE_SHARE,
    TEMPERATURE,
    samples_of,
    with_engine_excess,
)
from tests.runtime.jobs import job_spec

pytestmark = pytest.mark.runtime


def _first_step(tmp_path: Path, changes: dict[str, Any]) -> TrainMetrics:
    """One optimizer step on `samples_of` with engine log-probs above the trainer's own."""
    spec = job_spec(tmp_path, {
        "rollout": {"sampling": {"temperature": TEMPERATURE}, **changes.get("rollout", {})},
        "algorithm": {"rolloutBatchSize": 2, "nSamplesPerPrompt": 4, "globalBatchSize": 8,
                      "stepsPerRollout": 1, "microBatchSize": 8,
                      **changes.get("algorithm", {})},
    })
    model_dir = prepare_model(spec, tmp_path)
    samples = samples_of(int(AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size))
    init = ray.get(ray.remote(rendezvous_address).remote())
    group = TrainerGroup.start(TorchTrainer, lambda slot: {"num_cpus": 1}, [0],
                               spec.model_dump_json(by_alias=True), str(model_dir), init, "cpu")
    try:
        metrics = group.train(with_engine_excess(samples, group.logprobs(samples)), True)
        group.shutdown(timeout_s=30)
    finally:
        group.kill()
    assert metrics.optimizer_steps == 1
    assert metrics.logprob_gap == pytest.approx(ENGINE_EXCESS, abs=1e-5)
    return metrics


@pytest.mark.parametrize(("changes", "clipped"), [
    ({}, 0.0),
    ({"algorithm": {"oldLogprobs": "rollout"}}, NEGATIVE_ADVANTAGE_SHARE),
    ({"rollout": {"mode": "async"}}, NEGATIVE_ADVANTAGE_SHARE),
    ({"rollout": {"mode": "async"}, "algorithm": {"oldLogprobs": "trainer"}}, 0.0),
], ids=["sync-default-trainer", "rollout", "async-default-rollout", "async-trainer"])
def test_the_old_policy_the_clip_measures_from(ray_local: None, tmp_path: Path,
                                               changes: dict[str, Any], clipped: float) -> None:
    clipfrac = _first_step(tmp_path, changes).step_means.clipfrac
    assert clipfrac == pytest.approx(clipped, abs=1e-6)
