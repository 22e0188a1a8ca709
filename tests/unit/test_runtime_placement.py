"""Placement: slime's slot layout, and the operator's per-group Ray resources on a cluster."""

from __future__ import annotations

import json

import pytest

from rljob.placement import plan
from rljob_api.spec import RLJobSpec, RolloutBackend
from rljob_operator.builders import JobRef, build_raycluster

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


def test_colocated_shares_slots() -> None:
    layout = plan(_spec("colocated", 4, 4, 1))
    assert layout.share == 0.5 and layout.trainer_slots == layout.engine_slots
    assert {k for b in layout.bundles(True, True) for k in b} == {"GPU", "CPU", "rljob_colocated"}


@pytest.mark.parametrize(("placement", "rollout_gpus"), [("disaggregated", 4), ("colocated", 8)])
def test_operator_offers_the_units_the_runtime_asks_for(placement: str, rollout_gpus: int) -> None:
    """Every bundle the runtime requests fits the custom resources the operator's pods offer."""
    spec = _spec(placement, 8, rollout_gpus, 2)
    spec.rollout.backend = RolloutBackend.sglang
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
