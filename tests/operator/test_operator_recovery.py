"""Recovery on a real control plane: lost pods, failed pods, a failed driver and lost nodes
move the job to Recovering and back to Running with a new driver; past maxRestarts or on a
non-retryable runtime failure it fails; a killed operator duplicates nothing.

What a restart resumed from is a runtime fact: these tests assert it only where a real
`rljob run` process reported it (the kwok pods run no containers); elsewhere they assert
the operator's own behaviour, and the derivation itself is unit-tested in test_decide.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.checkpoint.store import MANIFEST
from rljob.reporting.reporter import StatusReporter
from rljob.reporting.status_sink import ApiSink
from rljob_api.status import RuntimeFailure
from rljob_api.status import timestamp as now
from tests.controlplane import REPO, ControlPlane
from tests.faults import PAUSE_MARKER, PAUSE_SAVE_ENV
from tests.operator.harness import job_manifest
from tests.operator.jobs import patch_pod_phase, pods, status, wait_phase
from tests.operator_process import POOL_LABEL, Operator, stop_kubelet
from tests.polling import wait_for
from tests.processes import reap
from tests.runtime.hooks_for_tests import GATE_ENV
from tests.runtime.jobs import job_file

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


def test_pod_and_driver_failures_restart_with_a_new_driver_until_max_restarts(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 8)
    # Engines not replaced by the runtime: a lost rollout pod restarts the job like any pod
    # (with engines replaced, the driver does not record rollout pods: test_decide.py).
    cluster.apply(job_manifest("rec", namespace, recovery=RESTART_ON_ANY_POD), "-n", namespace)
    wait_phase(cluster, namespace, "rec", "Running")

    # 1. A trainer pod is deleted.
    trainer = pods(cluster, namespace, "rec", "trainer")[0]["metadata"]["name"]
    cluster.kubectl("delete", "pod", trainer, "-n", namespace, "--wait=false")
    st = recovered(cluster, namespace, "rec", 1)
    rec = st["recovery"]
    assert (rec["lastFailure"]["reason"], rec["lastFailure"]["pod"]) == ("PodDeleted", trainer)
    assert rec["maxRestarts"] == 3
    assert "action" not in rec and "nextAttemptAt" not in rec
    # No runtime ran, so nothing says where the attempt resumed: nothing is claimed.
    assert "resumedFromStep" not in rec and "lostSteps" not in rec
    assert trainer not in {p["metadata"]["name"] for p in pods(cluster, namespace, "rec")}
    driver = pods(cluster, namespace, "rec", "driver")[0]
    assert driver["metadata"]["annotations"]["rljob.io/restarts"] == "1"

    # 2. A rollout pod fails.
    rollout = pods(cluster, namespace, "rec", "rollout")[0]["metadata"]["name"]
    patch_pod_phase(cluster, namespace, rollout, "Failed", 137)
    rec = recovered(cluster, namespace, "rec", 2)["recovery"]
    assert (rec["lastFailure"]["reason"], rec["lastFailure"]["pod"]) == ("PodFailed", rollout)
    assert "137" in rec["lastFailure"]["message"]
    assert pods(cluster, namespace, "rec", "driver")[0]["metadata"]["annotations"][
        "rljob.io/restarts"] == "2"

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

    def reasons() -> list[str]:
        return [e["reason"] for e in cluster.get_json(
            "events", "-n", namespace, "--field-selector", "involvedObject.name=rec")["items"]]

    # The operator posts a transition's Event right after the status write that shows it.
    wait_for(lambda: reasons().count("Recovering") == 3 and "Failed" in reasons(),
             timeout=30, what="three Recovering Events and a Failed one",
             describe=lambda: f"Events: {reasons()}")
    assert operator.metric("rljob_operator_restarts_total") == 3


RESTART_ON_ANY_POD = {"maxRestarts": 3, "backoffSeconds": 1, "maxBackoffSeconds": 2,
                      "maxEngineRestarts": 0}


def _node_of(cp: ControlPlane, ns: str, name: str, component: str) -> str:
    return str(pods(cp, ns, name, component)[0]["spec"]["nodeName"])


def test_lost_nodes_move_the_job_elsewhere(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(3, 4)
    cluster.apply(job_manifest("nl", namespace, recovery=RESTART_ON_ANY_POD), "-n", namespace)
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
    StatusReporter(ApiSink("nan", namespace, api_client)).failure(RuntimeFailure(
        reason="NonFiniteWeights", message="layer 3 has NaN; evidence in /checkpoints/nan/bad",
        retryable=False, step=9, time=now()))
    st = wait_phase(cluster, namespace, "nan", "Failed", timeout=30)
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert failed["reason"] == "NonFiniteWeights" and "evidence" in failed["message"]
    assert st["recovery"]["restarts"] == 0


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


def _driver_env(cp: ControlPlane, ns: str, name: str) -> dict[str, str]:
    """The literal env the operator gave the driver pod of the current attempt."""
    (driver,) = pods(cp, ns, name, "driver")
    return {e["name"]: e["value"] for e in driver["spec"]["containers"][0]["env"]
            if "value" in e}


def _runtime(cp: ControlPlane, ns: str, name: str, job: Path, workdir: Path, log: Path,
             *args: str, **extra: str) -> subprocess.Popen[bytes]:
    """A real `rljob run` playing the driver pod's process: the attempt number and job
    identity come from the driver pod the operator made; it reports through the API server."""
    pod_env = _driver_env(cp, ns, name)
    identity = {k: pod_env[k] for k in ("RLJOB_NAME", "RLJOB_NAMESPACE", "RLJOB_RESTARTS")}
    with log.open("ab") as out:
        return subprocess.Popen(
            # `rljob run` with the faults `extra` asks for (tests.faults), none by default.
            [sys.executable, "-m", "tests.faults", "run", str(job), "--workdir", str(workdir),
             *args],
            env={**os.environ, **identity, **extra, "KUBECONFIG": str(cp.kubeconfig),
                 "PYTHONPATH": str(REPO)},
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.runtime
def test_resume_figures_come_from_the_runtime_that_resumed(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool,
        tmp_path: Path) -> None:
    """A real runtime trains, saves step 2, reports step 4 and dies mid-save; the operator
    restarts the job; the next real runtime loads step 2 and says so; only then does the
    status show resumedFromStep 2 and lostSteps 2. The STEP column shows step 2, not the
    lost step 4, from the restart on and while the resumed attempt's first step is still
    held in its rewards."""
    gpu_pool(1, 8)
    job = job_file(tmp_path, {
        "algorithm": {"totalSteps": 6}, "checkpoint": {"interval": 2},
        "recovery": {"maxRestarts": 3, "backoffSeconds": 1, "maxBackoffSeconds": 1},
        "scheduling": {"nodeSelector": {POOL_LABEL: namespace}},
        "reward": {"function": "tests.runtime.hooks_for_tests:gated_reward"},
    })
    gate = tmp_path / "gate"  # absent: rewards flow; present: every step waits in them
    doc = yaml.safe_load(job.read_text())
    doc["metadata"]["name"] = "real"
    job.write_text(yaml.safe_dump(doc))
    cluster.kubectl("apply", "-n", namespace, "-f", str(job))
    wait_phase(cluster, namespace, "real", "Running")
    workdir, log = tmp_path / "w", tmp_path / "runtime.log"

    first = _runtime(cluster, namespace, "real", job, workdir, log,
                     **{PAUSE_SAVE_ENV: "4", GATE_ENV: str(gate)})
    try:
        wait_for(lambda: (workdir / "checkpoints" / PAUSE_MARKER).exists(), timeout=300,
                 what="the runtime to report step 4 and stop inside the save of step 4",
                 describe=lambda: log.read_text(errors="replace")[-3000:])
    finally:
        reap(first)
    st = status(cluster, namespace, "real")
    fresh = st["resumed"]
    assert (fresh["attempt"], fresh["found"], fresh["step"]) == (0, False, 0)
    assert (st["progress"]["rolloutStep"], st["checkpoint"]["step"]) == (4, 2)
    step_2 = workdir / "checkpoints" / "step_00000002"
    digest = hashlib.sha256((step_2 / MANIFEST).read_bytes()).hexdigest()
    patch_pod_phase(cluster, namespace, "real-driver", "Failed", 137)  # its container died

    st = recovered(cluster, namespace, "real", 1)
    assert st["recovery"]["lastFailure"]["step"] == 4  # what that runtime had reported
    assert "resumedFromStep" not in st["recovery"]  # attempt 1 has not said anything yet
    # Restarted, before any runtime of attempt 1 ran: STEP shows the step of the verified
    # checkpoint that runtime reported, not the lost step 4 (the operator's correction of
    # attempt 0's progress).
    assert (st["progress"]["attempt"], st["progress"]["rolloutStep"]) == (0, 2), st["progress"]

    gate.touch()
    second = _runtime(cluster, namespace, "real", job, workdir, log, "--max-steps", "1",
                      **{GATE_ENV: str(gate)})
    try:
        def figures() -> dict[str, Any] | None:
            rec = status(cluster, namespace, "real")["recovery"]
            return rec if "lostSteps" in rec else None

        rec = wait_for(figures, timeout=300, what="the resumed runtime's report",
                       describe=lambda: log.read_text(errors="replace")[-3000:])
        wait_for(lambda: (tmp_path / "gate.BLOCKED").exists(), timeout=300,
                 what="the resumed attempt's first step to wait in its rewards")
        # attempt 1's runtime reported its own progress: the step it resumed from.
        def reported() -> dict[str, Any] | None:
            found = status(cluster, namespace, "real").get("progress") or {}
            return found if found.get("attempt") == 1 else None

        progress = wait_for(reported, timeout=60, what="the resumed runtime's progress",
                            describe=lambda: str(status(cluster, namespace, "real")))
        assert (progress["attempt"], progress["rolloutStep"]) == (1, 2), progress
        assert not (workdir / "checkpoints" / "step_00000003").exists()
    finally:
        gate.unlink(missing_ok=True)
        reap(second)
    assert (rec["resumedFromStep"], rec["lostSteps"]) == (2, 2)
    resumed = status(cluster, namespace, "real")["resumed"]
    assert resumed["attempt"] == 1 and resumed["found"] is True
    assert (resumed["path"], resumed["checksum"]) == (str(step_2), digest)
    events = cluster.get_json("events", "-n", namespace, "--field-selector",
                              "involvedObject.name=real")["items"]
    said = [e["message"] for e in events if e["reason"] == "ResumedFromCheckpoint"]
    assert len(said) == 1 and "step 2" in said[0], said


def test_a_deleted_ray_token_is_made_anew_with_a_new_raycluster(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    """Ray pods read the token at start, so a driver started with a new token could never
    join the old head: when the Secret is gone at the next start, the RayCluster goes too."""
    gpu_pool(1, 8)
    cluster.apply(job_manifest("tok", namespace), "-n", namespace)
    wait_phase(cluster, namespace, "tok", "Running")
    uid = cluster.get_json("rljob", "tok", "-n", namespace)["metadata"]["uid"]
    secret_name = f"tok-ray-token-{uid[:8]}"
    old_token = cluster.get_json("secret", secret_name, "-n", namespace)["data"]["auth_token"]
    old_rc = cluster.get_json("raycluster", "tok", "-n", namespace)["metadata"]["uid"]
    cluster.kubectl("delete", "secret", secret_name, "-n", namespace)
    # The running attempt goes on (its processes hold the token); the next start needs one.
    trainer = pods(cluster, namespace, "tok", "trainer")[0]["metadata"]["name"]
    cluster.kubectl("delete", "pod", trainer, "-n", namespace, "--wait=false")

    def new_cluster() -> str | None:
        rc_uid: str = cluster.get_json("raycluster", "tok", "-n", namespace)["metadata"]["uid"]
        return rc_uid if rc_uid != old_rc else None  # absent for a while: a probe error

    wait_for(new_cluster, timeout=90, what="a new RayCluster after the token was replaced")
    st = recovered(cluster, namespace, "tok", 1)
    assert st["recovery"]["restarts"] == 1  # the token's replacement is no further restart
    new_token = cluster.get_json("secret", secret_name, "-n", namespace)["data"]["auth_token"]
    assert new_token != old_token
    events = cluster.get_json("events", "-n", namespace,
                              "--field-selector", "involvedObject.name=tok")["items"]
    (replaced,) = [e for e in events if e["reason"] == "RayTokenReplaced"]
    assert secret_name in replaced["message"] and new_token not in json.dumps(events)


@pytest.mark.runtime
def test_a_real_runtime_that_finds_the_job_invalid_fails_it_at_once_with_its_reason(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool,
        tmp_path: Path) -> None:
    """A reward hook that cannot be imported: the real runtime exits 2 and reports why, and
    the job fails at once (no restart) with the field in the message, not a bare exit code."""
    gpu_pool(1, 8)
    job = job_file(tmp_path, {
        "reward": {"function": "rljob_no_such_module:reward"},
        "scheduling": {"nodeSelector": {POOL_LABEL: namespace}},
    })
    doc = yaml.safe_load(job.read_text())
    doc["metadata"]["name"] = "badhook"
    job.write_text(yaml.safe_dump(doc))
    cluster.kubectl("apply", "-n", namespace, "-f", str(job))
    wait_phase(cluster, namespace, "badhook", "Running")
    log = tmp_path / "runtime.log"
    proc = _runtime(cluster, namespace, "badhook", job, tmp_path / "w", log)
    try:
        assert proc.wait(timeout=300) == 2, log.read_text(errors="replace")[-3000:]
    finally:
        reap(proc)
    st = wait_phase(cluster, namespace, "badhook", "Failed", timeout=60)
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert failed["reason"] == "InvalidSpec", failed
    assert "spec.reward.function" in failed["message"], failed
    assert st["recovery"]["restarts"] == 0
