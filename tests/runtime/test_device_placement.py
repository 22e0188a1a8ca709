"""The driver's device decision against a Ray that has GPUs: `Cluster.choose_devices` reads
what Ray reports, `Cluster.reserve` asks for each role's slots on its own device, and every
actor placed with `slot_options` (trainer ranks, engines, slot holders) or `sidecar_placement`
gets the device of its slot.

Ray's GPU accounting needs no real GPU: a local Ray told it has one schedules and sets each
actor's GPU ids exactly as on a GPU node, and nothing here creates a CUDA tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from rljob.cluster.cluster import Cluster, RunOptions, slot_options, worker_env
from rljob.cluster.placement import Devices, plan
from rljob.cluster.weight_sync import sidecar_placement
from rljob.driver.stop import StopSignals
from rljob.engine.slots import SlotHolder
from rljob_api import exits
from rljob_api.exits import JobError
from rljob_api.spec import RLJobSpec

pytestmark = pytest.mark.runtime

START_S = 300.0  # each actor is a fresh worker process: slow on a loaded 2-core machine


@pytest.fixture(scope="module")
def one_declared_gpu() -> Iterator[None]:
    ray.init(num_cpus=3, num_gpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": worker_env()})
    try:
        yield
    finally:
        ray.shutdown()


def _spec(placement: str, trainer_gpus: int, engines: int) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "placement": placement,
        "trainer": {"backend": "torch", "replicas": 1, "gpusPerReplica": trainer_gpus},
        "rollout": {"backend": "hf", "engines": engines, "gpusPerEngine": 1},
    })


def _gpu_ids(handles: list[Any]) -> list[list[str]]:
    """The GPU ids Ray gave each SlotHolder."""
    return [ids for _, ids in ray.get([h.where.remote() for h in handles], timeout=START_S)]


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_each_actor_gets_the_device_of_its_slot(
    one_declared_gpu: None, tmp_path: Path, placement: str
) -> None:
    """One GPU and an hf engine: disaggregated, the trainer keeps the GPU and the engine,
    its slot holder and its sidecar run on CPU (weights staged on the CPU); colocated, all
    of them share the GPU and the sidecar stages on it."""
    spec = _spec(placement, 1, 1)
    cluster = Cluster(RunOptions(tmp_path), StopSignals().install)
    devices = cluster.choose_devices(spec)
    colocated = placement == "colocated"
    assert devices == (Devices(True, True) if colocated else Devices(True, False))
    layout = plan(spec)
    pg = cluster.reserve(layout, devices)
    started: list[Any] = []
    try:
        bundles = ray.util.placement_group_table(pg)["bundles"]
        assert [b.get("GPU", 0) for _, b in sorted(bundles.items())] == (
            [1.0] if colocated else [1.0, 0])
        holder: Any = ray.remote(SlotHolder)
        trainer = holder.options(**slot_options(pg, layout, devices, layout.trainer_slots[0]))
        engine = holder.options(**slot_options(pg, layout, devices, layout.engine_slots[0]))
        started += [trainer.remote(), engine.remote()]
        trainer_ids, engine_ids = _gpu_ids(started)
        assert trainer_ids == ["0"]
        assert engine_ids == (["0"] if colocated else [])
        # The sidecar, placed as `WeightSyncActors.start_sidecars` places it: on the node of
        # its engine's first bundle, on GPU when the engine is.
        node = ray.util.placement_group_table(pg)["bundles_to_node_id"][layout.engine_slots[0]]
        device, options = sidecar_placement(pg, layout.engine_slots[0], node,
                                            bool(engine_ids), devices.sync_on_gpu)
        assert device == ("cuda:0" if colocated else "cpu")
        started.append(holder.options(**options).remote())
        assert _gpu_ids(started[-1:]) == [engine_ids]
    finally:
        for handle in started:
            ray.kill(handle)
        if cluster.pg is not None:
            ray.util.remove_placement_group(cluster.pg)


def test_a_trainer_asking_for_more_gpus_than_ray_has_stops_the_run(
    one_declared_gpu: None, tmp_path: Path
) -> None:
    """Never a silent run on CPU: an INVALID stop naming the field, Ray's count and the fix,
    before anything is placed."""
    cluster = Cluster(RunOptions(tmp_path), StopSignals().install)
    with pytest.raises(JobError) as err:
        cluster.choose_devices(_spec("disaggregated", 2, 1))
    assert err.value.code == exits.INVALID
    message = str(err.value)
    assert message.startswith("spec.trainer.gpusPerReplica: the trainer asks for 2 GPUs")
    assert "Ray reports 1 GPU on this machine" in message
    assert "set spec.trainer.gpusPerReplica: 0 to train on CPU" in message
    assert cluster.pg is None
