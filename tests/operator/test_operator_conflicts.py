"""Names that are taken: an object with a child's name that the RLJob does not own (by the
owner reference's UID) is never adopted, patched or deleted; the job says which object is in
the way and proceeds once it is gone."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.controlplane import ControlPlane
from tests.operator.harness import job_manifest
from tests.operator.jobs import pods, status, wait_phase
from tests.operator_process import Operator
from tests.polling import wait_for

pytestmark = pytest.mark.controlplane
Pool = Callable[[int, int], list[str]]
Obj = dict[str, Any]


def _blocked_by(cp: ControlPlane, ns: str, job: str, what: str) -> Obj:
    def probe() -> Obj | None:
        st = status(cp, ns, job)
        conds = {c["type"]: c for c in st.get("conditions", [])}
        ready = conds.get("Ready")
        ok = ready and ready["reason"] == "ObjectInTheWay" and what in ready["message"]
        return st if ok else None
    return wait_for(probe, timeout=30, what=f"{job}: Ready=False/ObjectInTheWay naming {what}",
                    describe=lambda: json.dumps(status(cp, ns, job))[-2000:])


def _foreign_raycluster(name: str, ns: str) -> Obj:
    """A RayCluster someone else made (suspended, so KubeRay starts no pods for it)."""
    template = {"spec": {"containers": [{"name": "ray-head", "image": "rayproject/ray:2.52.0"}]}}
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": name, "namespace": ns, "labels": {"team": "someone-else"}},
            "spec": {"suspend": True,
                     "headGroupSpec": {"rayStartParams": {}, "template": template}}}


def test_children_names_taken_by_foreign_objects_block_the_job_until_they_go(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 8)
    cluster.kubectl("create", "configmap", "cm-spec", "-n", namespace, "--from-literal=a=b")
    cluster.apply(_foreign_raycluster("rc", namespace))
    before = cluster.get_json("raycluster", "rc", "-n", namespace)
    for name in ("cm", "rc"):
        cluster.apply(job_manifest(name, namespace), "-n", namespace)

    st = _blocked_by(cluster, namespace, "cm", f"ConfigMap {namespace}/cm-spec")
    started = {c["type"]: c for c in st["conditions"]}["Started"]
    assert started["reason"] == "ObjectInTheWay" and "it has no owner" in started["message"]
    assert st["phase"] == "Pending"
    st = _blocked_by(cluster, namespace, "rc", f"RayCluster {namespace}/rc")
    assert "it has no owner" in {c["type"]: c for c in st["conditions"]}["Ready"]["message"]
    events = cluster.get_json("events", "-n", namespace, "--field-selector",
                              "involvedObject.name=rc")["items"]
    assert "ObjectInTheWay" in {e["reason"] for e in events}

    # Not adopted, not touched: no owner added, nothing rewritten, nothing started next to it.
    cm = cluster.get_json("configmap", "cm-spec", "-n", namespace)
    assert cm["data"] == {"a": "b"} and not cm["metadata"].get("ownerReferences")
    assert cluster.kubectl("get", "raycluster", "cm", "-n", namespace,
                           check=False).returncode != 0
    rc = cluster.get_json("raycluster", "rc", "-n", namespace)
    assert not rc["metadata"].get("ownerReferences")
    assert rc["spec"] == before["spec"] and rc["metadata"]["labels"] == {"team": "someone-else"}
    assert pods(cluster, namespace, "rc") == [] and pods(cluster, namespace, "cm") == []

    # Once they are gone, each job makes its own and runs.
    cluster.kubectl("delete", "configmap", "cm-spec", "-n", namespace)
    cluster.kubectl("delete", "raycluster", "rc", "-n", namespace)
    for name in ("cm", "rc"):
        st = wait_phase(cluster, namespace, name, "Running")
        assert "ObjectInTheWay" not in json.dumps(st["conditions"])
        uid = cluster.get_json("rljob", name, "-n", namespace)["metadata"]["uid"]
        for kind, child in (("configmap", f"{name}-spec"), ("raycluster", name)):
            owners = cluster.get_json(kind, child, "-n", namespace)["metadata"][
                "ownerReferences"]
            assert [o["uid"] for o in owners] == [uid], f"{kind}/{child}"
