"""Where the trainer ranks and rollout engines go: one Ray placement group, slime's layout.

Colocated: trainer and engines share the same slots (each takes a little under half a
slot); disaggregated: trainer slots first, engine slots after them. Every slot leaves
`SIDECAR_SHARE` unclaimed for the weight-sync sidecar of the engine that starts there,
which asks Ray for that engine's GPU (`rljob.cluster.weight_sync`). An engine of `gpusPerEngine`
GPUs holds that many consecutive slots (`engine_slot_groups`): SGLang runs one
tensor-parallel rank on each.

Each role's slots are GPUs or CPUs on their own (`choose_devices`): the trainer's are GPUs
when it asks for them (`gpusPerReplica` > 0), the engines' when they run on GPUs (SGLang
always; the `hf` engine on a cluster never, as its pods request none, and on one machine when
GPUs are left after the trainer's). Colocated roles share slots, so they share the device.
On one machine with no GPU at all every slot is a CPU (a laptop, the tests), so the same spec
places the same way everywhere. A trainer that asks for GPUs Ray does not have is an error,
never a silent run on CPU. On a Kubernetes cluster every bundle also asks for one unit
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
    engine_pods_have_gpus,
    group_resource,
    slots_per_pod,
)
from rljob_api.spec import Placement, RLJobSpec, RolloutBackend, TrainerBackend, WeightSyncMode

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

    def is_trainer_slot(self, slot: int) -> bool:
        """Whether a trainer rank holds `slot` (colocated: every slot; engines share them)."""
        return self.colocated or slot < len(self.trainer_slots)

    def slot_resource(self, slot: int) -> str:
        """The operator's custom Ray resource of the worker group that holds `slot`."""
        if self.colocated:
            return group_resource(COLOCATED)
        return group_resource(TRAINER if self.is_trainer_slot(slot) else ROLLOUT)

    def on_gpu(self, slot: int, devices: Devices) -> bool:
        """Whether `slot` is a GPU: the device of the role that holds it."""
        return devices.trainer_gpu if self.is_trainer_slot(slot) else devices.engine_gpu

    def gpus(self, devices: Devices) -> int:
        """GPUs the placement group asks Ray for."""
        return sum(self.on_gpu(slot, devices) for slot in range(self.slots))

    def bundles(self, devices: Devices, on_cluster: bool = False) -> list[dict[str, float]]:
        """One Ray bundle per slot, a GPU or a CPU as its role's device says."""
        out = []
        for slot in range(self.slots):
            bundle = {"GPU": 1.0, "CPU": 1.0} if self.on_gpu(slot, devices) else {"CPU": 1.0}
            if on_cluster:
                bundle[self.slot_resource(slot)] = 1.0
            out.append(bundle)
        return out

    def actor_resources(self, slot: int, devices: Devices) -> dict[str, float]:
        """What a trainer rank, an engine or a slot holder at `slot` asks Ray for: its share
        of the slot's GPU (Ray then shows it that GPU alone), or of its CPU."""
        if self.on_gpu(slot, devices):
            return {"num_gpus": self.share, "num_cpus": 0}
        return {"num_cpus": self.share}


@dataclass(frozen=True)
class Devices:
    """Whether the trainer's slots and the engines' slots are GPUs (colocated: both the
    same, since the roles share slots)."""

    trainer_gpu: bool
    engine_gpu: bool

    @property
    def trainer(self) -> str:
        """The device trainer ranks are started with."""
        return "cuda" if self.trainer_gpu else "cpu"

    @property
    def engine(self) -> str:
        """The device engines are started with."""
        return "cuda" if self.engine_gpu else "cpu"

    @property
    def sync_on_gpu(self) -> bool:
        """Weights travel GPU to GPU (NCCL, or CUDA IPC on a shared GPU; trainer rank 0 and
        each sidecar stage on their own GPU) only when trainer and engines both run on GPUs.
        Otherwise both sides stage on the CPU and the group is gloo: an NCCL group refuses a
        member on the CPU, a gloo group one on a GPU."""
        return self.trainer_gpu and self.engine_gpu

    def describe(self, sync_mode: WeightSyncMode) -> str:
        """One line for the log: where each role runs and how weights travel (a `disk` job
        sends versions as files, whatever the devices)."""
        if sync_mode == WeightSyncMode.disk:
            sync = "by disk versions"
        else:
            sync = "over NCCL between GPUs" if self.sync_on_gpu else "over gloo, staged on the CPU"
        return (f"devices: trainer ranks on {self.trainer.upper()}, engines on "
                f"{self.engine.upper()}; weight sync {sync}")


class DeviceError(ValueError):
    """The job asks for GPUs that Ray does not have; the message names the field and the fix."""


def _count(gpus: float) -> str:
    n = int(gpus) if float(gpus).is_integer() else gpus
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def choose_devices(spec: RLJobSpec, gpus: float, on_cluster: bool) -> Devices:
    """Each role's device, given the GPUs Ray reports (`gpus`); DeviceError when the job asks
    for GPUs that are not there.

    The trainer runs on GPUs when `gpusPerReplica` > 0; the engines when they run on GPUs:
    SGLang always, the `hf` engine on a cluster as its pods do (`engine_pods_have_gpus`: none)
    and on one machine when the trainer is on GPUs and enough are left after its own (a CPU
    trainer keeps a CPU job on the CPU). Colocated engines take the trainer's device. On one
    machine without any GPU every slot is a CPU: there `gpusPerReplica` and
    `rollout.gpusPerEngine` count CPU slots (the documented local meaning). On a cluster the
    operator gave the trainer's pods GPUs, so Ray seeing fewer is an error, not a reason to
    train on CPU.
    """
    layout = plan(spec)
    world = len(layout.trainer_slots)
    sglang = spec.rollout.backend == RolloutBackend.sglang
    trainer_wants = spec.trainer.gpus_per_replica > 0
    if not on_cluster and gpus < 1:
        if sglang:
            raise DeviceError(_engine_short(spec, 0, gpus, on_cluster))
        return Devices(False, False)
    if layout.colocated:
        if not trainer_wants:  # spec rules require gpusPerReplica ≥ 1 here
            return Devices(False, False)
        if gpus < layout.slots:
            raise DeviceError(_trainer_short(spec, layout.slots, gpus, on_cluster))
        return Devices(True, True)
    trainer_need = world if trainer_wants else 0
    if gpus < trainer_need:
        raise DeviceError(_trainer_short(spec, trainer_need, gpus, on_cluster))
    left = gpus - trainer_need
    if sglang:
        if left < spec.rollout.engine_slots:
            raise DeviceError(_engine_short(spec, trainer_need, gpus, on_cluster))
        return Devices(trainer_wants, True)
    if on_cluster:
        return Devices(trainer_wants, engine_pods_have_gpus(spec))
    return Devices(trainer_wants, trainer_wants and left >= spec.rollout.engine_slots)


def _where(gpus: float, on_cluster: bool) -> str:
    if on_cluster:
        return (f"Ray reports {_count(gpus)} in this cluster (its pods requested them from "
                "Kubernetes: a GPU the pod's Ray cannot see, or a node still joining, is not "
                "counted)")
    return f"Ray reports {_count(gpus)} on this machine"


def _trainer_short(spec: RLJobSpec, need: int, gpus: float, on_cluster: bool) -> str:
    t = spec.trainer
    colocated = spec.placement == Placement.colocated
    shared = " shared with the engines" if colocated else ""
    fix = "or set spec.trainer.gpusPerReplica: 0"
    if t.backend == TrainerBackend.megatron:
        fix += " with spec.trainer.backend torch (megatron needs GPUs)"
    if colocated:
        fix += " with placement disaggregated (colocated engines share the trainer's GPUs)"
    fix += " to train on CPU"
    return (f"spec.trainer.gpusPerReplica: the trainer asks for {_count(need)}{shared} "
            f"(replicas {t.replicas} × gpusPerReplica {t.gpus_per_replica}) and "
            f"{_where(gpus, on_cluster)}; give the job more GPUs, lower "
            f"spec.trainer.replicas or gpusPerReplica, {fix}")


def _engine_short(spec: RLJobSpec, trainer_need: int, gpus: float, on_cluster: bool) -> str:
    besides = f" besides the trainer's {trainer_need}" if trainer_need else ""
    r = spec.rollout
    return (f"spec.rollout.engines: rollout.backend sglang runs its engines on GPUs, "
            f"{_count(r.engine_slots)} (engines {r.engine_count} × gpusPerEngine "
            f"{r.gpus_per_engine}){besides}, and {_where(gpus, on_cluster)}; give the "
            "job more GPUs, lower spec.rollout.engines or gpusPerEngine, or use "
            "spec.rollout.backend hf to generate on CPU")


def trainer_world(spec: RLJobSpec) -> int:
    """Trainer ranks: one per GPU, or one per replica when replicas train on CPU."""
    return spec.trainer.replicas * slots_per_pod(spec)


def plan(spec: RLJobSpec) -> Layout:
    world = trainer_world(spec)
    per_engine = spec.rollout.gpus_per_engine
    engines = engine_count(spec)
    if spec.placement == Placement.colocated:
        return Layout(max(world, spec.rollout.engine_slots), tuple(range(world)),
                      tuple(i * per_engine for i in range(engines)), (1.0 - SIDECAR_SHARE) / 2,
                      colocated=True,
                      per_engine=per_engine)
    return Layout(world + spec.rollout.engine_slots, tuple(range(world)),
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
