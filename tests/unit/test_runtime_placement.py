"""Placement: slime's slot layout, and the operator's per-group Ray resources on a cluster."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rljob.engine.slots import SlotDeviceError, engine_gpus
from rljob.placement import SIDECAR_SHARE, engine_port, plan, port_clashes
from rljob.weightsync.sidecar import SidecarConfig, parse_args
from rljob.weightsync.wiring import SyncSettings
from rljob_api.env import ENGINE_INDEX as ENGINE_INDEX_ENV
from rljob_api.layout import slots_per_pod
from rljob_api.spec import RLJobSpec, RolloutBackend
from rljob_api.validate import spec_problems
from rljob_operator.builders import JobRef, build_driver, build_raycluster

pytestmark = pytest.mark.unit


def _spec(placement: str, trainer_gpus: int, rollout_gpus: int, per_engine: int) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "placement": placement,
        "trainer": {"backend": "torch", "replicas": 1, "gpusPerReplica": trainer_gpus},
        "rollout": {"gpus": rollout_gpus, "gpusPerEngine": per_engine},
    })


def test_disaggregated_slots_and_cluster_bundles() -> None:
    layout = plan(_spec("disaggregated", 4, 4, 2))
    assert layout.trainer_slots == (0, 1, 2, 3) and layout.engine_slots == (4, 6)
    bundles = layout.bundles(use_gpu=True, on_cluster=True)
    assert [b.get("rljob_trainer", 0) for b in bundles] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert [b.get("rljob_rollout", 0) for b in bundles] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(b["GPU"] == 1 for b in bundles)
    assert all(set(b) == {"CPU"} for b in layout.bundles(use_gpu=False))


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
    assert {k for b in layout.bundles(True, True) for k in b} == {"GPU", "CPU", "rljob_colocated"}


@pytest.mark.parametrize(("placement", "trainer_gpus", "rollout_gpus", "backend"), [
    ("disaggregated", 8, 4, RolloutBackend.sglang),
    ("colocated", 8, 8, RolloutBackend.sglang),
    # The hf engine runs on CPU: its pods have no GPU, yet a slot per tensor-parallel rank.
    ("disaggregated", 0, 4, RolloutBackend.hf),
    ("disaggregated", 8, 4, RolloutBackend.hf),
])
def test_operator_offers_the_units_the_runtime_asks_for(
    placement: str, trainer_gpus: int, rollout_gpus: int, backend: RolloutBackend
) -> None:
    """Every bundle the runtime requests fits the custom resources the operator's pods offer."""
    spec = _spec(placement, trainer_gpus, rollout_gpus, 2)
    spec.rollout.backend = backend
    cluster = build_raycluster(JobRef("j", "ns", "uid"), spec)
    offered: dict[str, float] = {}
    for group in cluster["spec"]["workerGroupSpecs"]:
        units = json.loads(json.loads(group["rayStartParams"]["resources"]))
        for name, count in units.items():
            offered[name] = offered.get(name, 0) + count * group["replicas"]
    wanted: dict[str, float] = {}
    for bundle in plan(spec).bundles(use_gpu=True, on_cluster=True):
        for name, count in bundle.items():
            if name.startswith("rljob_"):
                wanted[name] = wanted.get(name, 0) + count
    assert wanted == offered


def _sidecar_view(container: dict[str, Any], pod: str,
                  monkeypatch: pytest.MonkeyPatch) -> SidecarConfig:
    """What `rljob-weight-sync` makes of the operator's container in pod `pod`."""
    for name in ("POD_NAME", "POD_IP", ENGINE_INDEX_ENV, "RLJOB_ENGINE_URL"):
        monkeypatch.delenv(name, raising=False)
    for var in container["env"]:
        monkeypatch.setenv(var["name"], var.get("value", ""))
    monkeypatch.setenv("POD_NAME", pod)
    return parse_args(container["command"][1:])


@pytest.mark.parametrize(("placement", "replicas", "trainer_gpus", "rollout_gpus", "per_engine"), [
    ("disaggregated", 1, 4, 6, 2),
    ("colocated", 1, 8, 8, 1),
    ("colocated", 2, 8, 16, 2),
    ("colocated", 2, 2, 4, 2),
])
def test_engines_listen_where_the_operators_sidecars_look(
    placement: str, replicas: int, trainer_gpus: int, rollout_gpus: int, per_engine: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every engine the runtime starts has exactly one sidecar in its pod pointing at its port,
    declared by the pod, and every sidecar has an engine and a name of its own in the job."""
    raw = {"placement": placement,
           "trainer": {"replicas": replicas, "gpusPerReplica": trainer_gpus},
           "rollout": {"gpus": rollout_gpus, "gpusPerEngine": per_engine}}
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
    runtime = sorted((f"{group}-{(s - first) // per_pod}",
                      engine_port(spec, settings.engine_port, s)) for s in layout.engine_slots)

    (workers,) = [g for g in build_raycluster(job, spec)["spec"]["workerGroupSpecs"]
                  if g["groupName"] == group]
    operator: list[tuple[str, int]] = []
    sync_names: list[str] = []
    for replica in range(workers["replicas"]):
        pod = f"{group}-{replica}"
        main, *sidecars = workers["template"]["spec"]["containers"]
        declared = {p["containerPort"] for p in main["ports"]}
        for container in sidecars:
            config = _sidecar_view(container, pod, monkeypatch)
            port = int(config.engine_url.rsplit(":", 1)[1])
            assert port in declared
            assert [p["containerPort"] for p in container["ports"]] == [config.listen_port]
            operator.append((pod, port))
            sync_names.append(config.engine_name)
        assert len({p["containerPort"] for c in sidecars for p in c["ports"]}) == len(sidecars)
    assert runtime == sorted(operator)
    assert len(set(sync_names)) == len(sync_names) == len(layout.engine_slots)


def test_port_clashes_name_the_engines_ray_put_together() -> None:
    assert port_clashes(["a", "a", "b"], [30000, 30001, 30000]) == []
    assert port_clashes(["a", "b", "a"], [30000, 30000, 30000]) == [
        "engines 0 and 2 on node a both need port 30000"]
