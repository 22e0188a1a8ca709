"""Where Ray puts the weight-sync sidecar of a GPU engine: in the placement-group bundle of
the engine's first slot, holding a share of that GPU, so Ray shows it the engine's GPU.

Ray's GPU accounting does not need real GPUs: a local Ray told it has two schedules and
sets CUDA_VISIBLE_DEVICES exactly as on a GPU node, which is what these tests read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rljob.cluster.cluster import worker_env
from rljob.cluster.placement import Devices, plan
from rljob.cluster.weight_sync import sidecar_options
from rljob_api.spec import RLJobSpec

pytestmark = pytest.mark.runtime

# Deadline for actors to start: each is a fresh worker process, slow on a loaded 2-core machine.
START_S = 300.0


class Seen:
    """What Ray gave this actor's process."""

    def gpus(self) -> str:
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())


@pytest.fixture(scope="module")
def two_declared_gpus() -> Iterator[None]:
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": worker_env()})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_each_sidecar_holds_a_share_of_its_engines_gpu(
    two_declared_gpus: None, placement: str
) -> None:
    trainer_gpus = 1 if placement == "disaggregated" else 2
    engines = 1 if placement == "disaggregated" else 2
    layout = plan(RLJobSpec.model_validate({
        "placement": placement,
        "trainer": {"backend": "torch", "replicas": 1, "gpusPerReplica": trainer_gpus},
        "rollout": {"engines": engines, "gpusPerEngine": 1},
    }))
    pg = placement_group(layout.bundles(Devices(True, True)), strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    seen: Any = ray.remote(Seen)

    def at(slot: int) -> dict[str, Any]:  # what the driver gives trainer ranks and engines
        return {"num_cpus": 0, "num_gpus": layout.share, "scheduling_strategy":
                PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=slot)}

    started: list[Any] = []
    try:
        trainers = [seen.options(**at(s)).remote() for s in layout.trainer_slots]
        engines = [seen.options(**at(s)).remote() for s in layout.engine_slots]
        started += [*trainers, *engines]
        node = ray.get(engines[0].node.remote(), timeout=START_S)
        sidecars = [seen.options(**sidecar_options(pg, s, node, on_gpu=True)).remote()
                    for s in layout.engine_slots]
        started += sidecars
        # Every actor starts: the sidecars fit beside whatever else holds their slot.
        engine_gpus = ray.get([e.gpus.remote() for e in engines], timeout=START_S)
        sidecar_gpus = ray.get([s.gpus.remote() for s in sidecars], timeout=START_S)
        trainer_gpus_seen = ray.get([t.gpus.remote() for t in trainers], timeout=START_S)
        assert sidecar_gpus == engine_gpus
        assert all(len(g.split(",")) == 1 for g in sidecar_gpus), sidecar_gpus
        if placement == "colocated":
            assert engine_gpus == trainer_gpus_seen and len(set(engine_gpus)) == 2
        else:
            assert set(engine_gpus).isdisjoint(trainer_gpus_seen)
    finally:
        for handle in started:
            ray.kill(handle)
        remove_placement_group(pg)
