"""Placement: slime's slot layout, and the operator's per-group Ray resources on a cluster."""

from __future__ import annotations

import json
import re

import pytest

from rljob.cluster.placement import (
    SIDECAR_SHARE,
    DeviceError,
    Devices,
    choose_devices,
    engine_port,
    plan,
    port_clashes,
)
from rljob.cluster.weight_sync import SyncSettings, sidecar_device
from rljob.engine.slots import SlotDeviceError, engine_gpus
from rljob_api.layout import slots_per_pod, weight_sync_health_port
from rljob_api.spec import COLOCATED_IMAGE as COLOCATED_REPO
from rljob_api.spec import RLJobSpec, RolloutBackend, WeightSyncMode
from rljob_api.validate import spec_problems
from rljob_operator.builders import JobRef, build_driver, build_raycluster

pytestmark = pytest.mark.unit


def _spec(placement: str, trainer_gpus: int, rollout_gpus: int, per_engine: int) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "placement": placement,
        "trainer": {"backend": "torch", "replicas": 1, "gpusPerReplica": trainer_gpus},
        "rollout": {"engines": rollout_gpus // per_engine, "gpusPerEngine": per_engine},
    })


def test_disaggregated_slots_and_cluster_bundles() -> None:
    layout = plan(_spec("disaggregated", 4, 4, 2))
    assert layout.trainer_slots == (0, 1, 2, 3) and layout.engine_slots == (4, 6)
    bundles = layout.bundles(Devices(True, True), on_cluster=True)
    assert [b.get("rljob_trainer", 0) for b in bundles] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert [b.get("rljob_rollout", 0) for b in bundles] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(b["GPU"] == 1 for b in bundles)
    assert all(set(b) == {"CPU"} for b in layout.bundles(Devices(False, False)))

COLOCATED_IMAGE = f"{COLOCATED_REPO}:0.1.0"


@pytest.mark.parametrize(("placement", "groups"), [
    ("disaggregated", ((4, 5), (6, 7))),
    ("colocated", ((0, 1), (2, 3))),
])
def test_each_engine_holds_gpus_per_engine_slots(
    placement: str, groups: tuple[tuple[int, ...], ...]
) -> None:
    layout = plan(_spec(placement, 4, 4, 2))
    assert layout.engine_slot_groups() == groups
    assert tuple(g[0] for g in groups) == layout.engine_slots


def test_an_engines_gpus_come_from_all_its_slots_on_one_node() -> None:
    assert engine_gpus(("n1", ["3"]), [("n1", ["5"]), ("n1", ["4"])]) == ["3", "5", "4"]
    assert engine_gpus(("n1", []), []) == []
    with pytest.raises(SlotDeviceError, match=r"Ray nodes n1 and n2.*gpusPerEngine"):
        engine_gpus(("n1", ["0"]), [("n2", ["0"])])


def test_colocated_shares_slots() -> None:
    layout = plan(_spec("colocated", 4, 4, 1))
    # trainer rank, engine and the engine's weight-sync sidecar all fit on the one GPU
    assert 2 * layout.share + SIDECAR_SHARE <= 1.0
    assert layout.trainer_slots == layout.engine_slots
    bundles = layout.bundles(Devices(True, True), True)
    assert {k for b in bundles for k in b} == {"GPU", "CPU", "rljob_colocated"}


@pytest.mark.parametrize(("placement", "trainer_gpus", "rollout_gpus", "backend"), [
    ("disaggregated", 8, 4, RolloutBackend.sglang),
    ("colocated", 8, 8, RolloutBackend.sglang),
    ("colocated", 8, 8, RolloutBackend.hf),
    # The hf engine runs on CPU: its pods have no GPU, yet a slot per tensor-parallel rank.
    ("disaggregated", 0, 4, RolloutBackend.hf),
    ("disaggregated", 8, 4, RolloutBackend.hf),
    ("disaggregated", 0, 4, RolloutBackend.sglang),
])
def test_operator_offers_the_units_and_gpus_the_runtime_asks_for(
    placement: str, trainer_gpus: int, rollout_gpus: int, backend: RolloutBackend
) -> None:
    """Every bundle the runtime requests on the cluster the operator builds fits what its
    pods offer: the custom resource units, and per worker group exactly the GPUs its pods
    request (a GPU slot on a pod without GPUs never places; a GPU pod whose slots ask for
    CPUs trains on CPU)."""
    spec = _spec(placement, trainer_gpus, rollout_gpus, 2)
    spec.rollout.backend = backend
    cluster = build_raycluster(JobRef("j", "ns", "uid"), spec)
    offered: dict[str, float] = {}
    pod_gpus: dict[str, float] = {}
    for group in cluster["spec"]["workerGroupSpecs"]:
        units = json.loads(group["rayStartParams"]["resources"].strip("'"))
        (name,) = units
        offered[name] = offered.get(name, 0) + units[name] * group["replicas"]
        main = group["template"]["spec"]["containers"][0]
        gpus = int(main["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        pod_gpus[name] = pod_gpus.get(name, 0) + gpus * group["replicas"]
    devices = choose_devices(spec, sum(pod_gpus.values()), on_cluster=True)
    wanted: dict[str, float] = {}
    wanted_gpus: dict[str, float] = {}
    for bundle in plan(spec).bundles(devices, on_cluster=True):
        (name,) = [k for k in bundle if k.startswith("rljob_")]
        wanted[name] = wanted.get(name, 0) + bundle[name]
        wanted_gpus[name] = wanted_gpus.get(name, 0) + bundle.get("GPU", 0)
    assert wanted == offered
    assert wanted_gpus == pod_gpus


def _devices(placement: str, trainer_gpus: int, rollout_gpus: int, backend: str,
             ray_gpus: float, on_cluster: bool, per_engine: int = 1,
             trainer_backend: str = "torch") -> Devices:
    spec = RLJobSpec.model_validate({
        "placement": placement,
        "trainer": {"backend": trainer_backend, "replicas": 1, "gpusPerReplica": trainer_gpus},
        "rollout": {"backend": backend, "engines": rollout_gpus // per_engine,
                    "gpusPerEngine": per_engine},
    })
    return choose_devices(spec, ray_gpus, on_cluster)


@pytest.mark.parametrize(
    ("placement", "trainer_gpus", "rollout_gpus", "backend", "ray_gpus", "on_cluster",
     "trainer_gpu", "engine_gpu"), [
        # The hf engine's pods request no GPU: a GPU trainer keeps its own all the same.
        ("disaggregated", 1, 1, "hf", 1, True, True, False),
        ("disaggregated", 2, 2, "hf", 2, True, True, False),
        ("disaggregated", 0, 2, "hf", 0, True, False, False),
        ("disaggregated", 1, 2, "sglang", 3, True, True, True),
        ("disaggregated", 0, 2, "sglang", 2, True, False, True),
        ("colocated", 2, 2, "hf", 2, True, True, True),
        ("colocated", 2, 2, "sglang", 2, True, True, True),
        # One machine with one GPU: the trainer takes it, the hf engine runs on CPU.
        ("disaggregated", 1, 1, "hf", 1, False, True, False),
        # ... and with GPUs left after the trainer's, the hf engines take them.
        ("disaggregated", 1, 2, "hf", 3, False, True, True),
        ("disaggregated", 1, 2, "hf", 2, False, True, False),
        # A CPU trainer keeps a CPU job on the CPU, GPUs or not.
        ("disaggregated", 0, 1, "hf", 4, False, False, False),
        ("disaggregated", 0, 1, "sglang", 1, False, False, True),
        ("colocated", 1, 1, "hf", 1, False, True, True),
        # No GPU on the machine: every slot a CPU (gpusPerReplica counts CPU slots locally).
        ("disaggregated", 2, 2, "hf", 0, False, False, False),
        ("colocated", 1, 1, "hf", 0, False, False, False),
    ])
def test_each_role_runs_on_its_own_device(
    placement: str, trainer_gpus: int, rollout_gpus: int, backend: str, ray_gpus: float,
    on_cluster: bool, trainer_gpu: bool, engine_gpu: bool,
) -> None:
    devices = _devices(placement, trainer_gpus, rollout_gpus, backend, ray_gpus, on_cluster)
    assert devices == Devices(trainer_gpu, engine_gpu)


def test_a_gpu_trainer_beside_cpu_engines_holds_gpu_slots_and_the_engines_cpu_slots() -> None:
    spec = _spec("disaggregated", 2, 4, 2)
    spec.rollout.backend = RolloutBackend.hf
    devices = choose_devices(spec, 2, on_cluster=True)
    assert (devices.trainer, devices.engine, devices.sync_on_gpu) == ("cuda", "cpu", False)
    layout = plan(spec)
    assert layout.bundles(devices, on_cluster=True) == [
        {"GPU": 1.0, "CPU": 1.0, "rljob_trainer": 1.0},
        {"GPU": 1.0, "CPU": 1.0, "rljob_trainer": 1.0},
        *([{"CPU": 1.0, "rljob_rollout": 1.0}] * 4),
    ]
    assert layout.gpus(devices) == 2
    # Each actor asks for a share of its own slot's device: engines and their slot
    # holders no GPU, trainer ranks their slot's GPU.
    assert [layout.actor_resources(s, devices) for s in range(layout.slots)] == [
        *([{"num_gpus": layout.share, "num_cpus": 0}] * 2),
        *([{"num_cpus": layout.share}] * 4),
    ]


def test_colocated_gpu_slots_are_shared_and_stay_gpus() -> None:
    layout = plan(_spec("colocated", 2, 2, 1))
    devices = choose_devices(_spec("colocated", 2, 2, 1), 2, on_cluster=False)
    assert devices.sync_on_gpu and layout.gpus(devices) == 2
    assert all(layout.actor_resources(s, devices) == {"num_gpus": layout.share, "num_cpus": 0}
               for s in range(layout.slots))


@pytest.mark.parametrize(("placement", "trainer_backend", "on_cluster", "fix"), [
    ("disaggregated", "torch", False, r"set spec\.trainer\.gpusPerReplica: 0 to train on CPU"),
    ("disaggregated", "torch", True, r"set spec\.trainer\.gpusPerReplica: 0 to train on CPU"),
    ("disaggregated", "megatron", True,
     r"gpusPerReplica: 0 with spec\.trainer\.backend torch \(megatron needs GPUs\) to train"),
    ("colocated", "torch", False, r"gpusPerReplica: 0 with placement disaggregated"),
])
def test_a_trainer_short_of_gpus_is_an_error_naming_the_field_and_the_fix(
    placement: str, trainer_backend: str, on_cluster: bool, fix: str
) -> None:
    """Never a silent run on CPU: the message names the field, what Ray reports, the fix."""
    where = "in this cluster" if on_cluster else "on this machine"
    with pytest.raises(DeviceError) as err:
        _devices(placement, 2, 2, "hf", 1, on_cluster, trainer_backend=trainer_backend)
    message = str(err.value)
    assert message.startswith("spec.trainer.gpusPerReplica: the trainer asks for 2 GPUs")
    assert f"Ray reports 1 GPU {where}" in message
    assert re.search(fix, message), message


def test_a_cluster_whose_ray_sees_no_gpu_fails_a_gpu_trainer() -> None:
    """On a cluster the trainer's pods requested GPUs: Ray seeing none is an error (on one
    machine it means a CPU machine, where gpusPerReplica counts CPU slots)."""
    with pytest.raises(DeviceError, match=r"asks for 1 GPU \(replicas 1 × gpusPerReplica 1\) "
                       r"and Ray reports 0 GPUs in this cluster"):
        _devices("disaggregated", 1, 1, "hf", 0, on_cluster=True)


@pytest.mark.parametrize(("trainer_gpus", "ray_gpus", "on_cluster", "besides"), [
    (1, 2, True, " besides the trainer's 1"),
    (0, 0, False, ""),
])
def test_sglang_short_of_gpus_is_an_error_naming_rollout_engines(
    trainer_gpus: int, ray_gpus: float, on_cluster: bool, besides: str
) -> None:
    with pytest.raises(DeviceError) as err:
        _devices("disaggregated", trainer_gpus, 2, "sglang", ray_gpus, on_cluster)
    message = str(err.value)
    assert message.startswith(f"spec.rollout.engines: rollout.backend sglang runs its engines "
                              f"on GPUs, 2 GPUs (engines 2 × gpusPerEngine 1){besides}, and Ray "
                              f"reports {ray_gpus} GPU")
    assert message.endswith("or use spec.rollout.backend hf to generate on CPU")


@pytest.mark.parametrize(("engine_on_gpu", "sync_on_gpu", "device"), [
    (True, True, "cuda:0"),  # Ray shows the sidecar its engine's GPU alone
    (False, True, "cpu"),  # an engine on CPU
    (True, False, "cpu"),  # a gloo group (a CPU trainer) takes CPU buffers only
    (False, False, "cpu"),
])
def test_a_sidecar_stages_on_its_engines_gpu_only_when_weights_travel_on_gpus(
    engine_on_gpu: bool, sync_on_gpu: bool, device: str
) -> None:
    assert sidecar_device(engine_on_gpu, sync_on_gpu) == device


@pytest.mark.parametrize(("placement", "replicas", "trainer_gpus", "rollout_gpus", "per_engine"), [
    ("disaggregated", 1, 4, 6, 2),
    ("colocated", 1, 8, 8, 1),
    ("colocated", 2, 8, 16, 2),
    ("colocated", 2, 2, 4, 2),
])
def test_engines_listen_on_the_ports_their_pods_declare(
    placement: str, replicas: int, trainer_gpus: int, rollout_gpus: int, per_engine: int,
) -> None:
    """Every engine the runtime starts binds a port its pod declares, and no two engines of
    one pod share one."""
    raw = {"placement": placement,
           "trainer": {"replicas": replicas, "gpusPerReplica": trainer_gpus,
                       "image": COLOCATED_IMAGE},
           "rollout": {"engines": rollout_gpus // per_engine, "gpusPerEngine": per_engine}}
    assert spec_problems(raw) == []
    spec = RLJobSpec.model_validate(raw)
    job = JobRef("j", "ns", "uid")
    (driver,) = build_driver(job, spec, 0, [])["spec"]["containers"]
    settings = SyncSettings.from_env({e["name"]: e["value"] for e in driver["env"] if "value" in e})
    layout = plan(spec)
    # Which pod holds a slot: the operator gives each pod one Ray resource unit per slot.
    per_pod = slots_per_pod(spec) if layout.colocated else per_engine
    first = 0 if layout.colocated else len(layout.trainer_slots)
    group = "colocated" if layout.colocated else "rollout"
    runtime = [(f"{group}-{(s - first) // per_pod}", engine_port(spec, settings.engine_port, s))
               for s in layout.engine_slots]
    assert len(set(runtime)) == len(runtime)

    (workers,) = [g for g in build_raycluster(job, spec)["spec"]["workerGroupSpecs"]
                  if g["groupName"] == group]
    (main,) = workers["template"]["spec"]["containers"]
    declared = {p["name"]: p["containerPort"] for p in main["ports"]}
    engines = {port for name, port in declared.items() if name.startswith("engine")}
    pods = {f"{group}-{replica}" for replica in range(workers["replicas"])}
    assert {pod for pod, _ in runtime} == pods
    assert {port for _, port in runtime} == engines
    assert len(engines) == len(runtime) // len(pods)
    # each engine's sidecar serves /health and /metrics on the port declared beside it
    sidecars = {port for name, port in declared.items() if name.startswith("weight-sync")}
    assert sidecars == {weight_sync_health_port(p - settings.engine_port) for p in engines}


def test_port_clashes_name_the_engines_ray_put_together() -> None:
    assert port_clashes(["a", "a", "b"], [30000, 30001, 30000]) == []
    assert port_clashes(["a", "b", "a"], [30000, 30000, 30000]) == [
        "engines 0 and 2 on node a both need port 30000"]


@pytest.mark.parametrize(("devices", "mode", "said"), [
    (Devices(True, True), WeightSyncMode.nccl_broadcast, "weight sync over NCCL between GPUs"),
    (Devices(True, False), WeightSyncMode.nccl_broadcast,
     "weight sync over gloo, staged on the CPU"),
    (Devices(True, True), WeightSyncMode.disk, "weight sync by disk versions"),
])
def test_the_devices_line_names_the_transport_the_job_uses(
        devices: Devices, mode: WeightSyncMode, said: str) -> None:
    # A disk job on GPUs was logged as syncing over NCCL (seen on the H200 with
    # examples/tiny-megatron-gpu.yaml).
    line = devices.describe(mode)
    assert line.startswith("devices: trainer ranks on CUDA")
    assert line.endswith(said)


@pytest.mark.parametrize(("placement", "trainer_gpus", "rollout_gpus", "per_engine", "backend",
                          "staging"), [
    ("disaggregated", 0, 2, 1, "sglang", "cpu"),  # CPU trainer, SGLang on GPUs: gloo
    ("disaggregated", 1, 2, 1, "hf", "cpu"),      # GPU trainer, hf engines on CPU: gloo
    ("disaggregated", 0, 2, 1, "hf", "cpu"),      # all CPU: gloo
    ("disaggregated", 1, 2, 2, "sglang", "cuda:0"),  # GPUs on both sides: NCCL
    ("colocated", 1, 1, 1, "hf", "cuda:0"),       # one engine on the trainer's GPU: CUDA IPC
    ("colocated", 2, 2, 1, "sglang", "cuda:0"),   # two engines a pod, each sidecar on its GPU
])
def test_sidecars_stage_where_the_runtimes_group_needs_them_in_every_pod_shape(
    placement: str, trainer_gpus: int, rollout_gpus: int, per_engine: int, backend: str,
    staging: str,
) -> None:
    # A sidecar that stages on a GPU while the trainer's group is gloo refuses every version
    # (a gloo group takes CPU buffers only), and one on the CPU cannot join an NCCL group.
    # The sidecar runs in its engine's container holding a share of the engine's first GPU
    # (Ray shows it that GPU alone), also with several engines in a pod.
    raw = {
        "placement": placement,
        "trainer": {"backend": "torch", "replicas": 1, "gpusPerReplica": trainer_gpus,
                    "image": COLOCATED_IMAGE},
        "rollout": {"backend": backend, "engines": rollout_gpus // per_engine,
                    "gpusPerEngine": per_engine},
    }
    assert spec_problems(raw) == []
    spec = RLJobSpec.model_validate(raw)
    devices = choose_devices(spec, 16, on_cluster=True)
    assert sidecar_device(devices.engine_gpu, devices.sync_on_gpu) == staging
    assert devices.sync_on_gpu == (staging != "cpu")
