"""Where the trainer ranks and rollout engines go: one Ray placement group, slime's layout.

Colocated: trainer and engines share the same slots (each takes a little under half a
slot); disaggregated: trainer slots first, engine slots after them. Every slot leaves
`SIDECAR_SHARE` unclaimed for the weight-sync sidecar of the engine that starts there,
which asks Ray for that engine's GPU (`rljob.weightsync.wiring`). An engine of `gpusPerEngine`
GPUs holds that many consecutive slots (`engine_slot_groups`): SGLang runs one
tensor-parallel rank on each. A slot is a GPU on a GPU
cluster and a CPU when the job runs on CPUs (a laptop, the tests), so the same spec
places the same way everywhere. On a Kubernetes cluster every bundle also asks for one unit
of the custom resource the operator gives its worker group's pods (`rljob_trainer`,
`rljob_rollout`, `rljob_colocated`: one unit per slot), so trainer ranks land on trainer pods
and engines on rollout pods. Engine ports in pods follow `rljob_api.layout`, which the
operator reads too.
"""

from __future__ import annotations

from dataclasses import dataclass

from rljob_api.layout import (
    COLOCATED,
    ROLLOUT,
    TRAINER,
    engine_count,
    engine_local_index,
    group_resource,
    slots_per_pod,
)
from rljob_api.spec import Placement, RLJobSpec

# What a weight-sync sidecar asks of its engine's first slot. It stages each version on
# that GPU, so it must hold a share of that very GPU (Ray then shows it that GPU alone);
# the actors that place the slot's main work take the rest.
SIDECAR_SHARE = 0.05


@dataclass(frozen=True)
class Layout:
    slots: int
    trainer_slots: tuple[int, ...]  # one per trainer rank
    engine_slots: tuple[int, ...]  # first slot of each engine
    share: float  # fraction of a slot each actor requests
    colocated: bool = False
    per_engine: int = 1  # slots of each engine (spec.rollout.gpusPerEngine)

    def engine_slot_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every slot of each engine, its first slot first."""
        return tuple(tuple(range(first, first + self.per_engine)) for first in self.engine_slots)

    def slot_resource(self, slot: int) -> str:
        """The operator's custom Ray resource of the worker group that holds `slot`."""
        if self.colocated:
            return group_resource(COLOCATED)
        return group_resource(TRAINER if slot < len(self.trainer_slots) else ROLLOUT)

    def bundles(self, use_gpu: bool, on_cluster: bool = False) -> list[dict[str, float]]:
        device = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
        if not on_cluster:
            return [dict(device) for _ in range(self.slots)]
        return [{**device, self.slot_resource(i): 1.0} for i in range(self.slots)]


def trainer_world(spec: RLJobSpec) -> int:
    """Trainer ranks: one per GPU, or one per replica when replicas train on CPU."""
    return spec.trainer.replicas * slots_per_pod(spec)


def plan(spec: RLJobSpec) -> Layout:
    world = trainer_world(spec)
    per_engine = spec.rollout.gpus_per_engine
    engines = engine_count(spec)
    if spec.placement == Placement.colocated:
        return Layout(max(world, spec.rollout.gpus), tuple(range(world)),
                      tuple(i * per_engine for i in range(engines)), (1.0 - SIDECAR_SHARE) / 2,
                      colocated=True,
                      per_engine=per_engine)
    return Layout(world + spec.rollout.gpus, tuple(range(world)),
                  tuple(world + i * per_engine for i in range(engines)), 1.0 - SIDECAR_SHARE,
                  per_engine=per_engine)


def engine_port(spec: RLJobSpec, base: int, slot: int) -> int:
    """Port of the engine whose first slot is `slot`: 0 (any free one) when `base` is 0, as on
    one machine; in pods `base` + the engine's index within its pod, where the operator's
    sidecar for that engine looks."""
    return base + engine_local_index(spec, slot) if base else 0


def port_clashes(nodes: list[str], ports: list[int]) -> list[str]:
    """Engines that Ray put on one node with one port (engine i on nodes[i], ports[i]): the
    pod layout assumes a pod's slots are consecutive bundles, which PACK normally gives."""
    seen: dict[tuple[str, int], int] = {}
    clashes = []
    for i, key in enumerate(zip(nodes, ports, strict=True)):
        if key in seen:
            clashes.append(f"engines {seen[key]} and {i} on node {key[0]} both need port {key[1]}")
        seen.setdefault(key, i)
    return clashes
