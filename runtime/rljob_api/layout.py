"""Which engine of its pod a placement slot's engine is: shared by operator and runtime.

The operator declares one engine port and one weight-sync sidecar per engine a pod holds; the
runtime starts the engine at a slot on the port of its place within the pod. Both read these
functions of the spec, so the ports the runtime binds are the ones the sidecars look at.

A colocated pod holds `gpusPerReplica` slots (the trainer's GPUs, shared with the engines), so
`gpusPerReplica / gpusPerEngine` engines; a disaggregated rollout pod holds one engine.
"""

from __future__ import annotations

from rljob_api.spec import Placement, RLJobSpec


def slots_per_pod(spec: RLJobSpec) -> int:
    """Placement slots one colocated pod offers: its GPUs, or one slot when it has none."""
    return max(spec.trainer.gpus_per_replica, 1)


def engines_per_pod(spec: RLJobSpec) -> int:
    """Engines (so engine ports and sidecars) in each pod that runs engines."""
    if spec.placement == Placement.colocated:
        return max(slots_per_pod(spec) // spec.rollout.gpus_per_engine, 1)
    return 1


def engine_local_index(spec: RLJobSpec, slot: int) -> int:
    """Position, among the engines of its pod, of the engine whose first slot is `slot`."""
    if spec.placement == Placement.colocated:
        return (slot % slots_per_pod(spec)) // spec.rollout.gpus_per_engine
    return 0


def engine_name(pod: str, index: int | None) -> str:
    """The engine's name in the weight-sync group: the pod's name, plus the engine's index
    in pods that hold several engines (`index` None: the pod's only engine)."""
    return pod if index is None else f"{pod}-{index}"
