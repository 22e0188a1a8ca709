"""Jobs that cannot succeed fail fast on a real control plane: a driver exiting with the
runtime's "invalid job" code is not restarted; pods that cannot be placed or started, and a
driver that never starts, are named in the `Started` condition at once and fail the job at
its start-up deadline."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.controlplane import ControlPlane
from tests.operator.hand_kubelet import hand_node, report_containers
from tests.operator.harness import job_manifest
from tests.operator.jobs import patch_pod_phase, pods, status, wait_phase
from tests.operator_process import Operator
from tests.polling import wait_for

pytestmark = pytest.mark.controlplane
Pool = Callable[[int, int], list[str]]
Obj = dict[str, Any]


def test_driver_exit_2_fails_the_job_at_once_and_keeps_the_driver(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 8)
    cluster.apply(job_manifest("doom", namespace), "-n", namespace)
    wait_phase(cluster, namespace, "doom", "Running")
    patch_pod_phase(cluster, namespace, "doom-driver", "Failed", 2)  # as the kubelet reports

    st = wait_phase(cluster, namespace, "doom", "Failed", timeout=30)
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert failed["reason"] == "InvalidSpec"
    assert "the driver exited with code 2" in failed["message"]
    assert st["recovery"]["restarts"] == 0 and st["recovery"]["lastFailure"]["pod"] == \
        "doom-driver"
    wait_for(lambda: cluster.kubectl("get", "raycluster", "doom", "-n", namespace,
                                     check=False).returncode != 0,
             timeout=30, what="RayCluster removed after the failure")
    # The failed driver is the evidence: kept, never replaced by a new attempt.
    (driver,) = pods(cluster, namespace, "doom", "driver")
    assert driver["metadata"]["annotations"]["rljob.io/restarts"] == "0"
    assert driver["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 2
    reasons = [e["reason"] for e in cluster.get_json(
        "events", "-n", namespace, "--field-selector", "involvedObject.name=doom")["items"]]
    assert "Recovering" not in reasons and "Failed" in reasons


def _started(cp: ControlPlane, ns: str, name: str, reason: str,
             saying: str = "") -> Callable[[], Obj | None]:
    """A probe for the job's Started condition with `reason` and a message with `saying`."""
    def probe() -> Obj | None:
        conds = {c["type"]: c for c in status(cp, ns, name).get("conditions", [])}
        found = conds.get("Started")
        ok = found and found["reason"] == reason and saying in found["message"]
        return found if ok else None
    return probe


def _bound(cp: ControlPlane, ns: str, name: str, count: int = 4) -> list[str] | None:
    """The names of the job's pods once all `count` are bound to a node."""
    placed = sorted(p["metadata"]["name"] for p in pods(cp, ns, name) if p["spec"].get("nodeName"))
    return placed if len(placed) == count else None


def _gone(cp: ControlPlane, kind: str, name: str, ns: str) -> bool:
    return bool(cp.kubectl("get", kind, name, "-n", ns, check=False).returncode != 0)


def test_unschedulable_pods_are_named_at_once_then_fail_the_job_at_its_deadline(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 3)  # the job needs 4 GPUs
    recovery = {"maxRestarts": 3, "backoffSeconds": 1, "maxBackoffSeconds": 2,
                "startupTimeoutSeconds": 20}
    cluster.apply(job_manifest("big", namespace, recovery=recovery), "-n", namespace)
    cond = wait_for(_started(cluster, namespace, "big", "Unschedulable"), timeout=20,
                    what="Started=False/Unschedulable",
                    describe=lambda: json.dumps(status(cluster, namespace, "big"))[-2000:])
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    stuck = [p["metadata"]["name"] for p in pods(cluster, namespace, "big")
             if not p["spec"].get("nodeName")]
    assert stuck and any(name in cond["message"] for name in stuck)
    assert "spec.recovery.startupTimeoutSeconds: 20" in cond["message"]

    st = wait_phase(cluster, namespace, "big", "Failed", timeout=60)
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert failed["reason"] == "Unschedulable"
    assert "did not start within 20s" in failed["message"]
    assert "Insufficient nvidia.com/gpu" in failed["message"]
    assert st["recovery"]["restarts"] == 0 and "startingSince" not in st
    wait_for(lambda: _gone(cluster, "raycluster", "big", namespace), timeout=30,
             what="RayCluster removed after the start-up failure")


def test_image_pull_errors_and_a_driver_that_never_starts_fail_at_the_deadline(
        cluster: ControlPlane, namespace: str, operator: Operator) -> None:
    recovery = {"maxRestarts": 3, "backoffSeconds": 1, "maxBackoffSeconds": 2,
                "startupTimeoutSeconds": 30}
    with hand_node(cluster, f"{namespace}-hand", namespace, 8):
        for name in ("pull", "nodriver"):  # 4 GPUs each
            cluster.apply(job_manifest(name, namespace, recovery=recovery), "-n", namespace)

        pull = wait_for(lambda: _bound(cluster, namespace, "pull"), timeout=30,
                       what="pull's 4 pods bound")
        nodriver = wait_for(lambda: _bound(cluster, namespace, "nodriver"), timeout=30,
                            what="nodriver's 4 pods bound")
        # As the kubelet would: one rollout pod's image cannot be pulled, the rest run.
        blocked = next(p for p in pull if "rollout" in p)
        for pod in pull:
            report_containers(cluster, namespace, pod, None if pod != blocked else {
                "reason": "ErrImagePull",
                "message": "rpc error: code = NotFound desc = ghcr.io/rljob/rollout:0.1.0 "
                           "not found"})
        for pod in nodriver:
            report_containers(cluster, namespace, pod)

        cond = wait_for(_started(cluster, namespace, "pull", "ImagePullBackOff"), timeout=20,
                        what="Started=False/ImagePullBackOff",
                        describe=lambda: json.dumps(status(cluster, namespace, "pull"))[-2000:])
        assert blocked in cond["message"] and "not found" in cond["message"]
        assert "ray-worker" in cond["message"]
        # Every compute pod of nodriver runs, so its driver pod is made; nothing starts it.
        wait_for(_started(cluster, namespace, "nodriver", "Starting",
                          "4 of 4 compute pods run; the driver pod nodriver-driver is Pending"),
                 timeout=20, what="nodriver waiting for its driver",
                 describe=lambda: json.dumps(status(cluster, namespace, "nodriver"))[-2000:])

        st = wait_phase(cluster, namespace, "pull", "Failed", timeout=60)
        failed = {c["type"]: c for c in st["conditions"]}["Failed"]
        assert failed["reason"] == "ImagePullBackOff" and blocked in failed["message"]
        assert "did not start within 30s" in failed["message"]
        st = wait_phase(cluster, namespace, "nodriver", "Failed", timeout=60)
        failed = {c["type"]: c for c in st["conditions"]}["Failed"]
        assert failed["reason"] == "DriverNotStarted"
        assert "nodriver-driver" in failed["message"]
        # No kubelet finishes a deletion on this node: the API server marks the pod deleted.
        wait_for(lambda: pods(cluster, namespace, "nodriver", "driver") == [], timeout=30,
                 what="the driver that never started deleted")


def test_a_crash_loop_and_a_driver_image_pull_error_are_named_then_fail_at_the_deadline(
        cluster: ControlPlane, namespace: str, operator: Operator) -> None:
    """Compute pods that fail while starting (the job's pods never restart in place, so a
    crash reads as a failed pod that KubeRay replaces: the operator remembers the failures it
    saw on its watch) and a driver whose image cannot be pulled: each is named in `Started`
    at once and fails the job at its start-up deadline, never as a restart."""
    recovery = {"maxRestarts": 3, "backoffSeconds": 1, "maxBackoffSeconds": 2,
                "startupTimeoutSeconds": 30}
    with hand_node(cluster, f"{namespace}-hand", namespace, 8):
        for name in ("fails", "drvpull"):  # 4 GPUs each
            cluster.apply(job_manifest(name, namespace, recovery=recovery), "-n", namespace)

        fails = wait_for(lambda: _bound(cluster, namespace, "fails"), timeout=30,
                       what="fails' 4 pods bound")
        drvpull = wait_for(lambda: _bound(cluster, namespace, "drvpull"), timeout=30,
                       what="drvpull's 4 pods bound")
        # Its trainer fails before it ever runs, so no driver (no attempt) starts.
        failing = next(p for p in fails if "trainer" in p)
        for pod in fails:
            if pod != failing:
                report_containers(cluster, namespace, pod)
        patch_pod_phase(cluster, namespace, failing, "Failed", 1)
        for pod in drvpull:
            report_containers(cluster, namespace, pod)
        wait_for(lambda: pods(cluster, namespace, "drvpull", "driver"), timeout=30,
                 what="drvpull's driver pod made once its compute runs")
        report_containers(cluster, namespace, "drvpull-driver", {
            "reason": "ErrImagePull", "message": "ghcr.io/rljob/trainer:0.1.0: not found"})

        cond = wait_for(_started(cluster, namespace, "fails", "CrashLoop"), timeout=30,
                        what="Started=False/CrashLoop",
                        describe=lambda: json.dumps(status(cluster, namespace, "fails"))[-2000:])
        assert failing in cond["message"] and "failed while starting" in cond["message"]
        cond = wait_for(_started(cluster, namespace, "drvpull", "ImagePullBackOff"),
                        timeout=20, what="Started=False/ImagePullBackOff of the driver",
                        describe=lambda: json.dumps(status(cluster, namespace, "drvpull"))[-2000:])
        assert "drvpull-driver" in cond["message"] and "not found" in cond["message"]

        for name, reason in (("fails", "CrashLoop"), ("drvpull", "ImagePullBackOff")):
            st = wait_phase(cluster, namespace, name, "Failed", timeout=60)
            failed = {c["type"]: c for c in st["conditions"]}["Failed"]
            assert failed["reason"] == reason, (name, failed)
            assert "did not start within 30s" in failed["message"], (name, failed)
            assert st["recovery"]["restarts"] == 0, (name, st["recovery"])


def test_a_checkpoint_claim_that_is_not_read_write_many_fails_naming_the_field(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 8)
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "rwo-checkpoints"},
             "spec": {"accessModes": ["ReadWriteOnce"],
                      "resources": {"requests": {"storage": "1Gi"}}}}
    cluster.apply(claim, "-n", namespace)
    job = job_manifest("rwo", namespace, checkpoint={"path": "/checkpoints", "interval": 1,
                                                     "pvc": "rwo-checkpoints"})
    cluster.apply(job, "-n", namespace)
    st = wait_phase(cluster, namespace, "rwo", "Failed", timeout=60)
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert failed["reason"] == "CheckpointVolumeNotShared"
    assert failed["message"].startswith(
        "spec.checkpoint.pvc: the claim rwo-checkpoints has access modes ReadWriteOnce")
    assert "ReadWriteMany" in failed["message"] and st["recovery"]["restarts"] == 0
    # Nothing of the job runs on it; the user's claim is the user's and stays.
    wait_for(lambda: not pods(cluster, namespace, "rwo"), timeout=60, what="no pod of the job")
    assert cluster.get_json("pvc", "rwo-checkpoints", "-n", namespace)["metadata"]["name"]
