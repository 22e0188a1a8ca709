"""Recovery on a real control plane: lost pods, failed pods, a failed driver and lost nodes
move the job to Recovering and back to Running from the last verified checkpoint; past
maxRestarts or on a non-retryable runtime failure it fails; a killed operator duplicates
nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from rljob.report import StatusReporter, now
from rljob_api.status import RuntimeFailure
from tests.controlplane import ControlPlane
from tests.operator.harness import job_manifest
from tests.operator.jobs import patch_pod_phase, pods, report, status, wait_phase
from tests.operator_process import Operator, stop_kubelet
from tests.polling import wait_for

pytestmark = pytest.mark.controlplane
Pool = Callable[[int, int], list[str]]
Obj = dict[str, Any]


def recovered(cp: ControlPlane, ns: str, name: str, restarts: int) -> Obj:
    """Wait until the job went through Recovering and runs again after `restarts` restarts."""
    def probe() -> Obj | None:
        st = status(cp, ns, name)
        ok = st.get("phase") == "Running" and st.get("recovery", {}).get("restarts") == restarts
        return st if ok else None

    seen: list[Obj] = []
    return wait_for(probe, timeout=90, what=f"{name} Running after restart {restarts}",
                    describe=lambda: json.dumps(seen or status(cp, ns, name))[-3000:])


def test_pod_and_driver_failures_restart_from_the_checkpoint_until_max_restarts(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool,
        api_client: Any) -> None:
    gpu_pool(1, 8)
    cluster.apply(job_manifest("rec", namespace), "-n", namespace)
    wait_phase(cluster, namespace, "rec", "Running")

    # 1. A trainer pod is deleted.
    report(api_client, namespace, "rec", step=7, checkpoint=5)
    trainer = pods(cluster, namespace, "rec", "trainer")[0]["metadata"]["name"]
    cluster.kubectl("delete", "pod", trainer, "-n", namespace, "--wait=false")
    st = recovered(cluster, namespace, "rec", 1)
    rec = st["recovery"]
    assert (rec["lastFailure"]["reason"], rec["lastFailure"]["pod"]) == ("PodDeleted", trainer)
    assert (rec["resumedFromStep"], rec["lostSteps"], rec["maxRestarts"]) == (5, 2, 3)
    assert "action" not in rec and "nextAttemptAt" not in rec
    assert trainer not in {p["metadata"]["name"] for p in pods(cluster, namespace, "rec")}
    driver = pods(cluster, namespace, "rec", "driver")[0]
    assert driver["metadata"]["annotations"]["rljob.io/restarts"] == "1"

    # 2. A rollout pod fails.
    report(api_client, namespace, "rec", step=12, checkpoint=10)
    rollout = pods(cluster, namespace, "rec", "rollout")[0]["metadata"]["name"]
    patch_pod_phase(cluster, namespace, rollout, "Failed", 137)
    rec = recovered(cluster, namespace, "rec", 2)["recovery"]
    assert (rec["lastFailure"]["reason"], rec["lastFailure"]["pod"]) == ("PodFailed", rollout)
    assert "137" in rec["lastFailure"]["message"]
    assert (rec["resumedFromStep"], rec["lostSteps"]) == (10, 2)

    # 3. The driver fails.
    patch_pod_phase(cluster, namespace, "rec-driver", "Failed", 1)
    rec = recovered(cluster, namespace, "rec", 3)["recovery"]
    assert (rec["lastFailure"]["reason"], rec["lastFailure"]["pod"]) == \
        ("DriverFailed", "rec-driver")

    # 4. One failure more than maxRestarts allows: Failed, compute released.
    cluster.kubectl("delete", "pod", "rec-driver", "-n", namespace, "--wait=false")
    st = wait_phase(cluster, namespace, "rec", "Failed", timeout=30)
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert failed["reason"] == "RestartLimitExceeded" and "PodDeleted" in failed["message"]
    assert st["recovery"]["restarts"] == 3 and st["finishedAt"]
    wait_for(lambda: cluster.kubectl("get", "raycluster", "rec", "-n", namespace,
                                     check=False).returncode != 0,
             timeout=30, what="RayCluster removed after failure")
    reasons = [e["reason"] for e in cluster.get_json(
        "events", "-n", namespace, "--field-selector", "involvedObject.name=rec")["items"]]
    assert reasons.count("Recovering") == 3 and "Failed" in reasons
    assert operator.metric("rljob_operator_restarts_total") == 3


def _node_of(cp: ControlPlane, ns: str, name: str, component: str) -> str:
    return str(pods(cp, ns, name, component)[0]["spec"]["nodeName"])


def test_lost_nodes_move_the_job_elsewhere(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(3, 4)
    cluster.apply(job_manifest("nl", namespace), "-n", namespace)
    wait_phase(cluster, namespace, "nl", "Running")

    # A node stops reporting Ready (kwok no longer manages it, as a dead kubelet).
    node = _node_of(cluster, namespace, "nl", "trainer")
    stop_kubelet(cluster, node)
    rec = recovered(cluster, namespace, "nl", 1)["recovery"]
    assert rec["lastFailure"]["reason"] == "NodeLost"
    assert node in rec["lastFailure"]["message"]
    assert all(p["spec"]["nodeName"] != node for p in pods(cluster, namespace, "nl"))

    # A node is deleted outright.
    gone = _node_of(cluster, namespace, "nl", "rollout")
    cluster.kubectl("delete", "node", gone, "--wait=false")
    rec = recovered(cluster, namespace, "nl", 2)["recovery"]
    assert rec["lastFailure"]["reason"] in {"NodeLost", "PodDeleted"}
    assert all(p["spec"]["nodeName"] not in {node, gone} for p in pods(cluster, namespace, "nl"))


def test_non_retryable_runtime_failure_fails_at_once(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool,
        api_client: Any) -> None:
    gpu_pool(1, 8)
    cluster.apply(job_manifest("nan", namespace), "-n", namespace)
    wait_phase(cluster, namespace, "nan", "Running")
    StatusReporter("nan", namespace, api_client=api_client).failure(RuntimeFailure(
        reason="NonFiniteWeights", message="layer 3 has NaN; evidence in /checkpoints/nan/bad",
        retryable=False, step=9, time=now()))
    st = wait_phase(cluster, namespace, "nan", "Failed", timeout=30)
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert failed["reason"] == "NonFiniteWeights" and "evidence" in failed["message"]
    assert st["recovery"]["restarts"] == 0
    assert st["runtimeFailure"]["reason"] == "NonFiniteWeights"  # the runtime's field is kept


def test_killed_operator_resumes_without_duplicates(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 8)
    # A 4 s backoff keeps the job in Recovering long enough to kill the operator there.
    recovery = {"maxRestarts": 3, "backoffSeconds": 4, "maxBackoffSeconds": 4}
    cluster.apply(job_manifest("kill", namespace, recovery=recovery), "-n", namespace)
    wait_for(lambda: cluster.kubectl("get", "raycluster", "kill", "-n", namespace,
                                     check=False).returncode == 0,
             timeout=30, what="the RayCluster to be created")
    operator.kill()  # mid-way through bringing the job up
    operator.start()
    wait_phase(cluster, namespace, "kill", "Running")

    trainer = pods(cluster, namespace, "kill", "trainer")[0]["metadata"]["name"]
    cluster.kubectl("delete", "pod", trainer, "-n", namespace, "--wait=false")
    wait_phase(cluster, namespace, "kill", "Recovering", timeout=30)
    operator.kill()  # mid-recovery
    operator.start()
    st = recovered(cluster, namespace, "kill", 1)
    assert st["recovery"]["lastFailure"]["pod"] == trainer

    assert len(cluster.get_json("rayclusters", "-n", namespace)["items"]) == 1
    counts = {c: len(pods(cluster, namespace, "kill", c))
              for c in ("head", "trainer", "rollout", "driver")}
    assert counts == {"head": 1, "trainer": 1, "rollout": 2, "driver": 1}
    assert len(cluster.get_json("configmaps", "-n", namespace, "-l",
                                "rljob.io/job=kill")["items"]) == 1
