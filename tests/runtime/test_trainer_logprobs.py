"""`TrainerActor.logprobs` through `TrainerGroup`, on two torch trainer ranks in Ray: the
policy's response log-probs at the rollout temperature, the same on every rank, equal to a
float64 forward of the model files, what `train` then takes as the old policy's, and
moved by its optimizer steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from transformers import AutoModelForCausalLM

from rljob.cluster.cluster import rendezvous_address
from rljob.cluster.trainer_group import TrainerGroup
from rljob.driver.model_files import prepare_model
from rljob.trainer.torch.actor import TorchTrainer
from tests.logprob_samples import TEMPERATURE, check_policy_logprobs, samples_of
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
        before = check_policy_logprobs(group.logprobs, group.train, model_dir, samples)
        assert per_rank[0] == per_rank[1] == before
        group.shutdown(timeout_s=30)
    finally:
        group.kill()
