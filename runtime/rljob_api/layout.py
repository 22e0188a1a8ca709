"""Which engine of its pod a placement slot's engine is: shared by operator and runtime.

The operator declares one engine port per engine a pod holds; the runtime starts the engine
at a slot on the port of its place within the pod. Both read these functions of the spec, so
the ports the runtime binds are the ones the pod declares.

A colocated pod holds `gpusPerReplica` slots (the trainer's GPUs, shared with the engines), so
`gpusPerReplica / gpusPerEngine` engines; a disaggregated rollout pod holds one engine.

Placement uses custom Ray resources that the operator gives each kind of pod and the runtime
asks for: `rljob_<group>` on the worker groups' pods (one unit per slot) and
`rljob_driver` on the driver pod's own Ray node, so every actor lands on the pod meant for it.

The kinds of pod, their Ray resources and the ports below are the pod contract: the
operator's builders declare them and the runtime binds and asks for them, so each is
written here once.
"""

from __future__ import annotations

from rljob_api.spec import Placement, RLJobSpec, RolloutBackend

# The kinds of pod of a job: the Ray head, the worker groups of the RayCluster (`trainer`
# and `rollout`, or the one `colocated` group) and the driver pod. The operator labels each
# pod with its kind; the runtime tells from Ray's resources which kind a Ray node is.
HEAD = "head"
TRAINER = "trainer"
ROLLOUT = "rollout"
COLOCATED = "colocated"
DRIVER = "driver"
GROUPS = (TRAINER, ROLLOUT, COLOCATED)

# Ports. Engine i of a pod listens on ENGINE_PORT + i and its weight-sync sidecar serves
# /health and /metrics on WEIGHT_SYNC_HEALTH_PORT + i. The weight-sync store runs on the Ray
# head node (the driver starts it there), so every pod reaches it through the head Service
# on WEIGHT_SYNC_PORT, as the driver's Ray node reaches the head's GCS on RAY_GCS_PORT.
RAY_GCS_PORT = 6379
ENGINE_PORT = 30000
WEIGHT_SYNC_PORT = 29600
WEIGHT_SYNC_HEALTH_PORT = 8090


def group_resource(group: str) -> str:
    """The custom Ray resource of a worker group's pods (`trainer`, `rollout`, `colocated`):
    one unit per placement slot of the pod."""
    return f"rljob_{group}"


# The custom Ray resource of the driver pod's Ray node: nothing but the actors the driver
# deliberately keeps next to itself asks for it (its node offers no CPU or GPU).
DRIVER_RESOURCE = group_resource(DRIVER)
# Ray gives the head node one unit of this resource; actors pinned to the head ask for it.
HEAD_RESOURCE = "node:__internal_head__"


def engine_port(index: int) -> int:
    return ENGINE_PORT + index


def weight_sync_health_port(index: int) -> int:
    """Where the sidecar of engine `index` of a pod serves /health and /metrics."""
    return WEIGHT_SYNC_HEALTH_PORT + index


def engine_count(spec: RLJobSpec) -> int:
    return spec.rollout.engine_count


def pod_slots(gpus: int) -> int:
    """Placement slots a pod of `gpus` GPUs offers: one per GPU, or one when it runs on CPU,
    so the same spec places the same way with and without GPUs."""
    return max(gpus, 1)


def slots_per_pod(spec: RLJobSpec) -> int:
    """Placement slots one trainer or colocated pod offers."""
    return pod_slots(spec.trainer.gpus_per_replica)


def rollout_gpus_per_pod(spec: RLJobSpec) -> int:
    """GPUs each (disaggregated) rollout pod requests: its one engine's `gpusPerEngine` for
    SGLang, none for the `hf` engine, which then runs on CPU. The operator requests these and
    the runtime places the engines on GPU slots only when the pods have them, so the two
    cannot disagree about where an engine runs."""
    return spec.rollout.gpus_per_engine if spec.rollout.backend == RolloutBackend.sglang else 0


def engine_pods_have_gpus(spec: RLJobSpec) -> bool:
    """On a cluster, whether the pods that run engines have GPUs (colocated pods do: they are
    the trainer's; rollout pods request `rollout_gpus_per_pod`, none for the `hf` engine).
    Engines run on GPUs exactly there."""
    return spec.placement == Placement.colocated or rollout_gpus_per_pod(spec) > 0


def group_slots(spec: RLJobSpec, group: str) -> int:
    """Placement slots one pod of worker group `group` offers, so its units of
    `group_resource(group)`: a trainer or colocated pod `slots_per_pod`, a rollout pod one per
    slot of its one engine (`gpusPerEngine`, a slot per tensor-parallel rank), on GPUs or, for
    the hf engine, on CPU: the runtime places every engine on that many slots."""
    return spec.rollout.gpus_per_engine if group == ROLLOUT else slots_per_pod(spec)


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
