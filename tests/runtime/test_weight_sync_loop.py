"""The RL loop with versioned broadcast weight sync (gloo): store, sidecars, acks, resyncs.

Each test runs the job the way `rljob run` does (Ray started here, sidecars started by
the driver) and inspects the live engines before the driver shuts everything down.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from rljob.cluster.cluster import RunOptions, worker_env
from rljob.driver.attempt import Attempt
from rljob.driver.job import WEIGHT_SYNC_LOG
from rljob.driver.run import run_attempt
from rljob.engine.client import EngineClient
from rljob_api.exits import OK as EXIT_OK
from tests.faults import CORRUPT_ENV, SETUP_HOOK
from tests.runtime.conftest import RecordingReporter
from tests.runtime.jobs import job_spec

pytestmark = pytest.mark.runtime

STEPS = 3


@contextmanager
def local_ray(env: dict[str, str], num_gpus: int | None = None) -> Iterator[None]:
    """Ray on this machine (`num_gpus`: how many GPUs it may hand out; None: all it finds).
    Every worker (the sidecars among them) installs the faults `env` asks for."""
    ray.init(num_cpus=2, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {**worker_env(), **env},
                          "worker_process_setup_hook": SETUP_HOOK})
    try:
        yield
    finally:
        ray.shutdown()


def engine_weights(url: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every parameter read back over the engine's `/get_weights_by_name`."""
    engine = EngineClient(url)
    out = {}
    for name, ref in like.items():
        status, body = engine._request(
            "POST", "/get_weights_by_name", {"name": name, "truncate_size": ref.shape[0]}, 30)
        assert status == 200, body
        out[name] = torch.tensor(body, dtype=ref.dtype)
    return out


def run_and_check_engines(tmp_path: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """Run STEPS rollout steps; every engine must end bit-equal to the trainer at STEPS."""
    spec = job_spec(tmp_path, {"algorithm": {"totalSteps": STEPS},
                               "checkpoint": {"interval": STEPS}})
    workdir = tmp_path / "w"
    with local_ray(env):
        attempt = Attempt.begin("job", spec, RunOptions(workdir), RecordingReporter())
        try:
            assert run_attempt(attempt) == EXIT_OK
            job = attempt.job
            assert job is not None
            trainer = dict(ray.get(job.roles.trainers.rank0.named_weights.remote()))
            for url in job.roles.engines.urls:
                got = engine_weights(url, trainer)
                differing = [n for n, t in trainer.items() if not torch.equal(got[n], t)]
                assert not differing, f"engine {url} differs from the trainer in {differing}"
                assert EngineClient(url).weight_version() == str(STEPS)
            assert attempt.cluster.weight_sync is not None
            health = attempt.cluster.weight_sync.health()
            assert [h["last_acked_version"] for h in health] == [STEPS]
        finally:
            attempt.shutdown(EXIT_OK)
    state = json.loads((workdir / "checkpoints" / f"step_{STEPS:08d}" / "state.json")
                       .read_text())
    assert state["weight_version"] == STEPS  # what a resume continues from
    log = [json.loads(line) for line in (workdir / WEIGHT_SYNC_LOG).read_text().splitlines()]
    # the initial sync (version 0, engines start from the model directory), then one a step
    assert [r["version"] for r in log] == list(range(STEPS + 1))
    assert all(r["acked"] == ["engine-0"] and r["stale"] == {} for r in log)
    return log


def test_engines_end_bit_equal_to_the_trainer(tmp_path: Path) -> None:
    log = run_and_check_engines(tmp_path, {})
    assert all(r["attempts"] == 1 and r["rejections"] == [] for r in log)


def test_a_nan_in_the_broadcast_is_rejected_and_the_engine_resynced(tmp_path: Path) -> None:
    log = run_and_check_engines(tmp_path, {CORRUPT_ENV: "engine-0:2"})
    by_version = {r["version"]: r for r in log}
    (rejection,) = by_version[2]["rejections"]
    assert rejection.startswith("engine-0: ") and "non-finite" in rejection, rejection
    assert "digest mismatch" in rejection
    assert "still serving version 1" in rejection  # the engine kept v−1 ...
    assert by_version[2]["attempts"] == 2  # ... until the trainer resynced it
    assert all(r["attempts"] == 1 for v, r in by_version.items() if v != 2)
