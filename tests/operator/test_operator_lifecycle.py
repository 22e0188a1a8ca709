"""The operator on a real control plane: apply → RayCluster → pods on fake GPU nodes →
Running; the operator's columns; no idle status writes; RBAC, GC, suspend,
success, unschedulable jobs."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.controlplane import ControlPlane
from tests.operator.harness import job_manifest
from tests.operator.jobs import patch_pod_phase, pods, status, wait_phase
from tests.operator_process import Operator
from tests.polling import wait_for

pytestmark = pytest.mark.controlplane
Pool = Callable[[int, int], list[str]]


def token_secret(cp: ControlPlane, ns: str, job: str) -> str:
    """The name of the job's Ray token Secret: the job's name and UID."""
    uid: str = cp.get_json("rljob", job, "-n", ns)["metadata"]["uid"]
    return f"{job}-ray-token-{uid[:8]}"


def test_job_runs_and_is_quiet_when_idle(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    nodes = gpu_pool(1, 8)
    cluster.apply(job_manifest("rl", namespace), "-n", namespace)
    st = wait_phase(cluster, namespace, "rl", "Running")
    assert st["startedAt"] and st["observedGeneration"] == 1
    assert {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "True"

    # Children: RayCluster with head + trainer + rollout groups, labels and owners.
    rc = cluster.get_json("raycluster", "rl", "-n", namespace)
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"trainer", "rollout"}
    assert groups["rollout"]["replicas"] == 2
    rollout_containers = groups["rollout"]["template"]["spec"]["containers"]
    assert [c["name"] for c in rollout_containers] == ["ray-worker"]
    assert rc["metadata"]["ownerReferences"][0]["kind"] == "RLJob"
    by_component = {c: pods(cluster, namespace, "rl", c)
                    for c in ("head", "trainer", "rollout", "driver")}
    assert {c: len(p) for c, p in by_component.items()} == {
        "head": 1, "trainer": 1, "rollout": 2, "driver": 1}
    assert all(p["spec"]["nodeName"] == nodes[0] for ps in by_component.values() for p in ps)
    trainer = by_component["trainer"][0]["spec"]["containers"][0]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "2"
    driver = by_component["driver"][0]
    assert driver["spec"]["containers"][0]["command"][:2] == ["rljob", "run"]
    assert f"rl-head-svc.{namespace}.svc:6379" in driver["spec"]["containers"][0]["command"]

    # `kubectl get rljobs` shows what the operator decided; STEP, REWARD and CHECKPOINT are
    # the runtime's (no runtime runs here: they stay empty, never filled in by the operator).
    def columns() -> list[str] | None:
        line = cluster.kubectl("get", "rljobs", "-n", namespace, "--no-headers").stdout.split()
        return line if line[:2] == ["rl", "Running"] else None

    row = wait_for(columns, timeout=30, what="kubectl get rljobs to show the job Running")
    # Empty STEP, REWARD and CHECKPOINT print as blanks: NAME PHASE RESTARTS AGE remain.
    assert len(row) == 4 and row[2] == "0", row

    # Steady state: reconciles keep running but write nothing.
    rv = cluster.get_json("rljob", "rl", "-n", namespace)["metadata"]["resourceVersion"]
    writes = operator.metric("rljob_operator_status_writes_total")
    reconciles = operator.metric("rljob_operator_reconciles_total")
    wait_for(lambda: operator.metric("rljob_operator_reconciles_total") >= reconciles + 6,
             timeout=30, what="six more reconciles")
    assert operator.metric("rljob_operator_status_writes_total") == writes
    assert cluster.get_json("rljob", "rl", "-n", namespace)["metadata"]["resourceVersion"] == rv
    assert operator.metric("rljob_jobs") >= 1

    st = status(cluster, namespace, "rl")
    assert st["phase"] == "Running" and st["recovery"]["restarts"] == 0

    # The job's pods may patch their own RLJob's status and nothing else.
    sa = f"system:serviceaccount:{namespace}:rl-runtime"
    # ... and only the driver pod's status writer holds a token: as the API server admitted
    # the pods, no container but `status-writer` mounts a ServiceAccount token (neither the
    # API server's automounted `kube-api-access-*` nor any projected token).
    def token_mounts(pod: dict[str, Any]) -> dict[str, list[str]]:
        tokens = {v["name"] for v in pod["spec"]["volumes"]
                  if "serviceAccountToken" in json.dumps(v)}
        containers = [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]
        return {c["name"]: [m["name"] for m in c.get("volumeMounts", [])
                            if m["name"] in tokens] for c in containers}

    for component, ps in by_component.items():
        for p in ps:
            mounts = token_mounts(p)
            if component == "driver":
                assert mounts["driver"] == [] and len(mounts["status-writer"]) == 1, mounts
            else:
                assert not any(mounts.values()), (p["metadata"]["name"], mounts)
                assert p["spec"]["serviceAccountName"] == "default"
    assert by_component["driver"][0]["spec"]["serviceAccountName"] == "rl-runtime"
    # kopf stored nothing on the RLJob: no finalizer, no progress or diff-base annotations.
    meta = cluster.get_json("rljob", "rl", "-n", namespace)["metadata"]
    assert not meta.get("finalizers")
    assert not [k for k in meta.get("annotations") or {} if "kopf" in k or "rljob.io" in k]
    assert "kopf" not in status(cluster, namespace, "rl")

    def can(verb: str, target: str) -> str:
        out: str = cluster.kubectl("auth", "can-i", verb, target, "--subresource=status",
                                   f"--as={sa}", "-n", namespace, check=False).stdout
        return out.strip()

    assert can("patch", "rljobs.rljob.io/rl") == "yes"
    assert can("patch", "rljobs.rljob.io/other") == "no"
    def events() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = cluster.get_json(
            "events", "-n", namespace, "--field-selector", "involvedObject.name=rl")["items"]
        return items

    # The operator posts a transition's Event right after the status write that shows it.
    wait_for(lambda: {"Initializing", "Running"} <= {e["reason"] for e in events()},
             timeout=30, what="the Initializing and Running Events")

    # The Ray token: one immutable Secret owned by the job, referenced by every Ray
    # container, its value in no status, event or pod spec.
    secret = cluster.get_json("secret", token_secret(cluster, namespace, "rl"), "-n", namespace)
    assert secret["immutable"] is True and secret["metadata"]["ownerReferences"][0]["uid"]
    token = base64.b64decode(secret["data"]["auth_token"]).decode()
    assert len(token) == 64
    visible = json.dumps([status(cluster, namespace, "rl"), events(),
                          cluster.get_json("pods,rayclusters", "-n", namespace)])
    assert token not in visible and secret["metadata"]["name"] in visible
    # The NetworkPolicy: owned by the job, made before its pods, and its selector, as the API
    # server evaluates it, picks exactly the job's pods (KubeRay's, with the labels KubeRay
    # gave them, and the driver); it lets in only pods of that same selector, same namespace.
    policy = cluster.get_json("networkpolicy", "rl-peers-only", "-n", namespace)
    owner = policy["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("RLJob", "rl", True)
    assert owner["uid"] == cluster.get_json("rljob", "rl", "-n", namespace)["metadata"]["uid"]
    created = policy["metadata"]["creationTimestamp"]
    assert all(created <= p["metadata"]["creationTimestamp"]
               for ps in by_component.values() for p in ps)
    selector = policy["spec"]["podSelector"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": selector}]}]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert set(selector) == {"matchLabels"}
    chosen = ",".join(f"{k}={v}" for k, v in selector["matchLabels"].items())
    picked = {p["metadata"]["name"] for p in cluster.get_json(
        "pods", "-n", namespace, "-l", chosen)["items"]}
    every = {p["metadata"]["name"] for ps in by_component.values() for p in ps}
    assert picked == every, (picked, every)
    # The shared checkpoint claim, bound, mounted by every pod.
    claim = cluster.get_json("pvc", "rl-checkpoints", "-n", namespace)
    assert claim["status"]["phase"] == "Bound"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for pod in [p for ps in by_component.values() for p in ps]:
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
                  if "persistentVolumeClaim" in v]
        assert claims == ["rl-checkpoints"], pod["metadata"]["name"]


def test_driver_success_tears_down_compute_and_delete_collects_children(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 8)
    cluster.apply(job_manifest("ok", namespace), "-n", namespace)
    wait_phase(cluster, namespace, "ok", "Running")
    patch_pod_phase(cluster, namespace, "ok-driver", "Succeeded", 0)
    st = wait_phase(cluster, namespace, "ok", "Succeeded")
    assert st["finishedAt"]
    wait_for(lambda: cluster.kubectl("get", "raycluster", "ok", "-n", namespace,
                                     check=False).returncode != 0,
             timeout=30, what="RayCluster removed after success")

    def children() -> list[str]:
        out: str = cluster.kubectl(
            "get", "pods,configmaps,serviceaccounts,roles,rolebindings,secrets,pvc,"
            "networkpolicies",
            "-n", namespace, "-l", "rljob.io/job=ok", "-o", "name").stdout
        return out.split()

    assert {f"secret/{token_secret(cluster, namespace, 'ok')}",
            "persistentvolumeclaim/ok-checkpoints",
            "networkpolicy.networking.k8s.io/ok-peers-only"} <= set(children())
    cluster.kubectl("delete", "rljob", "ok", "-n", namespace, "--wait=false")

    wait_for(lambda: children() == [], timeout=60, what="children garbage-collected",
             describe=lambda: " ".join(children()))


def test_too_few_gpus_is_pending_with_the_scheduler_reason(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 3)  # the job needs 4 GPUs
    cluster.apply(job_manifest("big", namespace), "-n", namespace)

    def unschedulable() -> dict[str, Any] | None:
        # The pods come with the job's claim, so the scheduler may first turn them away for
        # the claim not bound yet; once it is, they are refused for the GPUs alone.
        st = status(cluster, namespace, "big")
        conds = {c["type"]: c for c in st.get("conditions", [])}
        cond = conds.get("Scheduled")
        return cond if st.get("phase") == "Pending" and cond and \
            cond["reason"] == "Unschedulable" and \
            "Insufficient nvidia.com/gpu" in cond["message"] else None

    cond = wait_for(unschedulable, timeout=60, what="Pending with Scheduled=False for GPUs",
                    describe=lambda: json.dumps(status(cluster, namespace, "big")))
    assert cond["status"] == "False"
    stuck = [p["metadata"]["name"] for p in pods(cluster, namespace, "big")
             if not p["spec"].get("nodeName")]
    assert stuck and all(name in cond["message"] for name in stuck)

    gpu_pool(1, 8)  # capacity arrives: the job starts by itself
    wait_phase(cluster, namespace, "big", "Running")


def test_checkpoint_claim_that_cannot_bind_keeps_pods_pending_and_says_why(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 8)
    checkpoint = {"path": "/checkpoints", "storageClassName": "no-such-class", "size": "5Gi"}
    cluster.apply(job_manifest("nfs", namespace, checkpoint=checkpoint), "-n", namespace)

    claim = wait_for(lambda: cluster.get_json("pvc", "nfs-checkpoints", "-n", namespace),
                     timeout=30, what="the operator's checkpoint claim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"] == "no-such-class"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert claim["metadata"]["ownerReferences"][0]["name"] == "nfs"
    assert claim["status"]["phase"] == "Pending"

    def unschedulable() -> dict[str, Any] | None:
        cond = {c["type"]: c for c in status(cluster, namespace, "nfs").get("conditions", [])}
        found = cond.get("Scheduled")
        return found if found and found["reason"] == "Unschedulable" else None

    cond = wait_for(unschedulable, timeout=60, what="Scheduled=False/Unschedulable",
                    describe=lambda: json.dumps(status(cluster, namespace, "nfs"))[-2000:])
    print(f"\nScheduled condition of a job whose claim cannot bind:\n{cond['message']}")
    assert status(cluster, namespace, "nfs")["phase"] == "Pending"
    assert "unbound immediate PersistentVolumeClaims" in cond["message"]
    assert "nfs-checkpoints holds the shared checkpoints and needs a ReadWriteMany volume" \
        in cond["message"]
    # Every pod of the job mounts that claim; none is placed while it is unbound.
    assert all(not p["spec"].get("nodeName") for p in pods(cluster, namespace, "nfs"))


def test_suspend_releases_compute_and_resume_runs_again(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 8)
    cluster.apply(job_manifest("sus", namespace), "-n", namespace)
    wait_phase(cluster, namespace, "sus", "Running")

    def suspend(flag: bool) -> None:
        cluster.kubectl("patch", "rljob", "sus", "-n", namespace, "--type=merge", "-p",
                        json.dumps({"spec": {"scheduling": {"suspend": flag}}}))

    secret = cluster.get_json("secret", token_secret(cluster, namespace, "sus"), "-n", namespace)
    claim = cluster.get_json("pvc", "sus-checkpoints", "-n", namespace)
    suspend(True)
    wait_phase(cluster, namespace, "sus", "Suspended")
    wait_for(lambda: pods(cluster, namespace, "sus") == [], timeout=60,
             what="every pod of the suspended job gone")
    assert cluster.kubectl("get", "raycluster", "sus", "-n", namespace,
                           check=False).returncode != 0

    suspend(False)
    st = wait_phase(cluster, namespace, "sus", "Running")
    assert st["recovery"]["restarts"] == 0
    assert st["observedGeneration"] == 3
    assert len(pods(cluster, namespace, "sus", "driver")) == 1
    # The token and the checkpoints outlive the suspension, untouched.
    for kind, before in (("secret", secret), ("pvc", claim)):
        after = cluster.get_json(kind, before["metadata"]["name"], "-n", namespace)
        assert after["metadata"]["uid"] == before["metadata"]["uid"]
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"] \
            or kind == "pvc"  # the binder may still annotate the claim
    assert cluster.get_json("secret", secret["metadata"]["name"], "-n", namespace)["data"] == \
        secret["data"]

