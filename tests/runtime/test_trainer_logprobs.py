"""`TrainerActor.logprobs` through `TrainerGroup`, on two torch trainer ranks in Ray: the
policy's response log-probs at the rollout temperature, the same on every rank, equal to a
float64 forward of the model files, what `train` then takes as the old policy's, and
moved by its optimizer steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from transformers import AutoModelForCausalLM

from rljob.cluster import rendezvous_address
from rljob.model_files import prepare_model
from rljob.torch_backend.actor import TorchTrainer
from rljob.trainer.trainer_group import TrainerGroup
from tests.logprob_samples import TEMPERATURE, float64_logprobs, samples_of
from tests.runtime.jobs import job_spec

pytestmark = pytest.mark.runtime

def test_both_ranks_give_the_policys_logprobs_that_train_starts_from(
    ray_local: None, tmp_path: Path
) -> None:
    spec = job_spec(tmp_path, {
        "trainer": {"replicas": 2},
        "rollout": {"sampling": {"temperature": TEMPERATURE}},
        "algorithm": {"rolloutBatchSize": 2, "nSamplesPerPrompt": 4, "globalBatchSize": 4,
                      "stepsPerRollout": 2, "microBatchSize": 2},
    })
    model_dir = prepare_model(spec, tmp_path)
    vocab = int(AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size)
    samples = samples_of(vocab)
    init = ray.get(ray.remote(rendezvous_address).remote())
    group = TrainerGroup.start(TorchTrainer, lambda slot: {"num_cpus": 1}, [0, 1],
                               spec.model_dump_json(by_alias=True), str(model_dir), init, "cpu")
    try:
        per_rank = ray.get([t.logprobs.remote(samples) for t in group.handles], timeout=120)
        before = group.logprobs(samples)
        assert per_rank[0] == per_rank[1] == before
        assert [len(lp) for lp in before] == [s["response_length"] for s in samples]
        expected = float64_logprobs(model_dir, samples)
        for got, want in zip(before, expected, strict=True):
            assert got == pytest.approx(want, abs=1e-4)
        # The engines' log-probs set to these: train sees no gap between them and its own
        # old-policy log-probs.
        for s, lp in zip(samples, before, strict=True):
            s["rollout_log_probs"] = lp
        metrics = group.train(samples, check_initial_kl=True)
        assert metrics["optimizer_steps"] == 2
        assert metrics["logprob_gap_max"] < 1e-6
        after = group.logprobs(samples)
        moved = max(abs(a - b) for ra, rb in zip(after, before, strict=True)
                    for a, b in zip(ra, rb, strict=True))
        assert moved > 1e-4
        group.shutdown(timeout_s=30)
    finally:
        group.kill()
