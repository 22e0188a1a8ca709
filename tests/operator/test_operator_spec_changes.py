"""Every mutable field of a running job, edited on a real control plane, takes the effect
rljob_api.mutability documents, and the job runs again after each edit: an `operator` edit
restarts nothing, a `restart` edit replaces only the driver (whose config carries the edit),
a `compute` edit patches the RayCluster and replaces the pods whose template changed. None
counts as a restart after a failure."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from rljob_api.mutability import Effect
from rljob_api.spec import RLJobSpec
from rljob_operator import builders
from tests.controlplane import ControlPlane
from tests.operator.edits import ZONE_LABEL, Edit, edits
from tests.operator.harness import job_manifest
from tests.operator.jobs import pods, status
from tests.operator_process import Operator
from tests.polling import wait_for

pytestmark = pytest.mark.controlplane
Pool = Callable[..., list[str]]
Obj = dict[str, Any]
JOB = "edit"
GROUP_FIELDS = ("image", "resources")


@pytest.fixture
def priority_class(cluster: ControlPlane, namespace: str) -> Iterator[str]:
    name = f"{namespace}-high"
    cluster.apply({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                   "metadata": {"name": name}, "value": 1000})
    try:
        yield name
    finally:
        cluster.kubectl("delete", "priorityclass", name, "--ignore-not-found", check=False)


def _uids(cp: ControlPlane, ns: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cp, ns, JOB)}


def _settled(cp: ControlPlane, ns: str, generation: int, driver_before: str,
             replaced: bool) -> Callable[[], Obj | None]:
    """The edit was observed, the job runs, and its driver is new exactly when expected."""
    def probe() -> Obj | None:
        st = status(cp, ns, JOB)
        if st.get("observedGeneration") != generation or st.get("phase") != "Running":
            return None
        drivers = pods(cp, ns, JOB, "driver")
        if len(drivers) != 1 or drivers[0]["status"].get("phase") != "Running":
            return None
        new = drivers[0]["metadata"]["uid"] != driver_before
        return st if new == replaced else None
    return probe


def _check_cluster(cp: ControlPlane, ns: str, spec: RLJobSpec) -> None:
    """The RayCluster holds what the current spec builds, and its pods are made from it."""
    uid = cp.get_json("rljob", JOB, "-n", ns)["metadata"]["uid"]
    want = builders.build_raycluster(builders.JobRef(JOB, ns, uid), spec)
    have = cp.get_json("raycluster", JOB, "-n", ns)
    assert have["metadata"]["annotations"]["rljob.io/revision"] == \
        want["metadata"]["annotations"]["rljob.io/revision"]
    groups = [("head", have["spec"]["headGroupSpec"], want["spec"]["headGroupSpec"], 1)]
    groups += [(w["groupName"], h, w, w["replicas"]) for h, w in
               zip(have["spec"]["workerGroupSpecs"], want["spec"]["workerGroupSpecs"],
                   strict=True)]
    for component, had, wanted, replicas in groups:
        assert had.get("replicas", 1) == replicas, component
        template = had["template"]
        for key in ("nodeSelector", "tolerations", "priorityClassName"):
            assert template["spec"].get(key) == wanted["template"]["spec"].get(key), key
        revision = template["metadata"]["annotations"]["rljob.io/revision"]
        made = pods(cp, ns, JOB, component)
        assert len(made) == replicas, f"{component}: {len(made)} pods, want {replicas}"
        for pod in made:
            assert pod["metadata"]["annotations"]["rljob.io/revision"] == revision
            for got, exp in zip(pod["spec"]["containers"], template["spec"]["containers"],
                                strict=True):
                assert {k: got.get(k) for k in GROUP_FIELDS} == \
                    {k: exp.get(k) for k in GROUP_FIELDS}, f"{pod['metadata']['name']}"
            assert pod["spec"].get("priorityClassName") == \
                template["spec"].get("priorityClassName")


def test_every_mutable_field_takes_effect_on_a_running_job(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool,
        priority_class: str) -> None:
    gpu_pool(2, 8, {ZONE_LABEL: "a"})
    cluster.apply(job_manifest(JOB, namespace), "-n", namespace)
    wait_for(lambda: status(cluster, namespace, JOB).get("phase") == "Running", timeout=90,
             what="the job Running")

    for edit in edits(namespace, priority_class):
        _apply(cluster, namespace, edit)
    events = cluster.get_json("events", "-n", namespace, "--field-selector",
                              f"involvedObject.name={JOB}")["items"]
    reasons = [e["reason"] for e in events]
    assert "SpecChanged" in reasons and "Recovering" not in reasons
    assert operator.metric("rljob_operator_restarts_total") == 0


def _apply(cp: ControlPlane, ns: str, edit: Edit) -> None:
    before = _uids(cp, ns)
    driver_before = before[f"{JOB}-driver"]
    rc_before = cp.get_json("raycluster", JOB, "-n", ns)["metadata"]["annotations"]
    cp.kubectl("patch", "rljob", JOB, "-n", ns, "--type=merge",
               "-p", json.dumps({"spec": edit.patch}))
    generation = cp.get_json("rljob", JOB, "-n", ns)["metadata"]["generation"]
    effect = edit.effect
    st = wait_for(_settled(cp, ns, generation, driver_before, effect != Effect.operator),
                  timeout=120, what=f"edit {edit.id} ({effect.value}) applied and Running",
                  describe=lambda: json.dumps(status(cp, ns, JOB))[-2500:])
    assert st["recovery"]["restarts"] == 0, f"{edit.id} counted as a restart"
    body = cp.get_json("rljob", JOB, "-n", ns)
    spec = RLJobSpec.model_validate(body["spec"])
    after = _uids(cp, ns)
    compute_before = {n: u for n, u in before.items() if not n.endswith("-driver")}
    compute_after = {n: u for n, u in after.items() if not n.endswith("-driver")}
    rc_after = cp.get_json("raycluster", JOB, "-n", ns)["metadata"]["annotations"]
    if effect == Effect.operator:
        assert after == before, f"{edit.id} restarted something"
        assert st["recovery"]["maxRestarts"] == spec.recovery.max_restarts
    elif effect == Effect.restart:
        assert compute_after == compute_before, f"{edit.id} replaced compute pods"
        assert rc_after == rc_before
        # The new driver runs the edited spec: the document it mounts is the RLJob's spec.
        doc = yaml.safe_load(cp.get_json("configmap", f"{JOB}-spec", "-n", ns)["data"][
            "rljob.yaml"])
        assert doc["spec"] == body["spec"], f"{edit.id}: the driver's spec is stale"
    else:
        assert rc_after != rc_before, f"{edit.id} did not patch the RayCluster"
        _check_cluster(cp, ns, spec)
