"""A trainer on the GPU beside `hf` engines on the CPU, on one machine: the layout a one-GPU
machine gets when the trainer takes the GPU and no GPU is left for the engines.

Weights then leave the GPU for a gloo group staged on the CPU (an NCCL group refuses a member
on the CPU). The job runs the way `rljob run` does; the engines must end bit-equal to the
trainer's GPU weights, serving the last version.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from rljob.cluster.cluster import RunOptions
from rljob.cluster.placement import Devices
from rljob.driver.attempt import Attempt
from rljob.driver.run import run_attempt
from rljob.engine.client import EngineClient
from rljob_api.exits import OK as EXIT_OK
from tests.runtime.conftest import RecordingReporter
from tests.runtime.jobs import job_spec
from tests.runtime.test_weight_sync_loop import engine_weights, local_ray

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 2


def test_a_gpu_trainer_feeds_cpu_engines_over_gloo(tmp_path: Path) -> None:
    # Ray hands out one GPU: the trainer takes it and the engines find none left.
    spec = job_spec(tmp_path, {"trainer": {"gpusPerReplica": 1},
                               "algorithm": {"totalSteps": STEPS},
                               "checkpoint": {"interval": STEPS}})
    with local_ray({}, num_gpus=1):
        attempt = Attempt.begin("job", spec, RunOptions(tmp_path / "w"), RecordingReporter())
        try:
            assert run_attempt(attempt) == EXIT_OK
            job = attempt.job
            assert job is not None
            assert job.roles.devices == Devices(trainer_gpu=True, engine_gpu=False)
            trainer = dict(ray.get(job.roles.trainers.rank0.named_weights.remote()))
            assert {t.device.type for t in trainer.values()} == {"cuda"}
            on_cpu = {n: t.cpu() for n, t in trainer.items()}
            for url in job.roles.engines.urls:
                got = engine_weights(url, on_cpu)
                differing = [n for n, t in on_cpu.items() if not torch.equal(got[n], t)]
                assert not differing, f"engine {url} differs from the trainer in {differing}"
                assert EngineClient(url).weight_version() == str(STEPS)
        finally:
            attempt.shutdown(EXIT_OK)
