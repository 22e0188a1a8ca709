"""`rljob run --plan-only`'s plan against a Ray that hands out GPUs as on a GPU node: each
probe is placed with its worker's options and derives its devices with its worker's code.

Ray's GPU accounting needs no GPU: a local Ray told it has four sets each actor's
CUDA_VISIBLE_DEVICES as on a GPU node, and NVIDIA_VISIBLE_DEVICES (what NVIDIA's device
plugin sets in a container) names the four as an allocation would. Nothing creates a CUDA
tensor. The same plan in pods with a device plugin's allocation: e2e/kind/test_kind_gpu_plan.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from rljob.cluster.cluster import Cluster, RunOptions, worker_env
from rljob.cluster.device_plan import ProcessDevices, physical, problems
from rljob.driver.stop import StopSignals
from rljob_api.spec import RLJobSpec

pytestmark = pytest.mark.runtime

ALLOCATED = ["GPU-node-4", "GPU-node-5", "GPU-node-6", "GPU-node-7"]  # the container's


@pytest.fixture(scope="module")
def four_allocated_gpus() -> Iterator[None]:
    env = {**worker_env(), "NVIDIA_VISIBLE_DEVICES": ",".join(ALLOCATED)}
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.parametrize("backend", ["sglang", "hf"])
def test_a_tp2_job_plans_every_process_on_its_own_allocated_gpus(
    four_allocated_gpus: None, tmp_path: Path, backend: str
) -> None:
    """Two trainer ranks and one engine of two ranks on four GPUs: every process uses
    allocated GPUs only, no two trainer ranks or engines share one, the sidecar holds its
    share of the engine's first GPU and puts rank r's entry on the GPU of the engine's rank
    r: SGLang's rank r on the engine's r-th GPU, every rank of the `hf` engine on its first
    (one process computes them all)."""
    spec = RLJobSpec.model_validate({
        "placement": "disaggregated",
        "trainer": {"backend": "torch", "replicas": 1, "gpusPerReplica": 2},
        "rollout": {"backend": backend, "engines": 1, "gpusPerEngine": 2},
    })
    cluster = Cluster(RunOptions(tmp_path, plan_only=True), StopSignals().install)
    try:
        reports = cluster.plan_devices(spec)
    finally:
        if cluster.pg is not None:
            ray.util.remove_placement_group(cluster.pg)
    by_role: dict[str, list[ProcessDevices]] = {}
    for r in reports:
        by_role.setdefault(r.role, []).append(r)
    assert [len(by_role[k]) for k in ("trainer", "engine", "sidecar")] == [2, 1, 1]
    for r in reports:
        assert r.allocation == ALLOCATED
        assert set(r.gpus) <= set(ALLOCATED), r
    trainer_gpus = [g for t in by_role["trainer"] for g in t.gpus]
    (engine,), (sidecar,) = by_role["engine"], by_role["sidecar"]
    assert len(set(trainer_gpus)) == 2 and [len(t.gpus) for t in by_role["trainer"]] == [1, 1]
    assert len(engine.gpus) == 2 and not set(engine.gpus) & set(trainer_gpus)
    assert len(set(engine.gpus)) == (2 if backend == "sglang" else 1)
    # Ray placed the sidecar's share on the engine's first GPU; it stages there and puts
    # each rank's entry on that rank's GPU.
    assert physical(sidecar.visible, ALLOCATED) == engine.gpus[:1]
    assert sidecar.device == "cuda:0"
    assert sidecar.gpus == engine.gpus
    assert problems(reports) == []
