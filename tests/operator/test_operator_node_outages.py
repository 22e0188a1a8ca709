"""Slow pods and nodes that are not Ready, on a real control plane: a running job outlasts a
worker that is NotReady for longer than its start-up timeout, a node that is NotReady for
less than the operator's bound (`--node-lost-after`) costs nothing, and one NotReady past it
has its pods force-deleted and the job restarted elsewhere, at the moment the bound expires.

The node that goes NotReady is one whose kubelet the test plays (`hand_kubelet`): it falls
silent and its Ready condition reads Unknown for as long as the test wants (kwok, told to let
go of a node, may report it Ready again meanwhile). The node lifecycle controller then taints
it `unreachable`, NoSchedule and NoExecute, which the pods tolerate for 300 s. It marks a
silent node's pods NotReady only when it changes the node's condition itself, after its
grace period; here the test changed it, so the test marks them, and it plays the kubelet
that comes back (node and pod status).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from rljob_api.status import parse_timestamp
from rljob_api.status import timestamp as now
from tests.controlplane import ControlPlane
from tests.operator.hand_kubelet import Kubelet, hand_node, report_containers
from tests.operator.harness import job_manifest
from tests.operator.jobs import pods, status, wait_phase
from tests.operator_process import Operator
from tests.polling import wait_for

pytestmark = pytest.mark.controlplane
Pool = Callable[[int, int], list[str]]
Obj = dict[str, Any]
STARTUP_TIMEOUT = 3  # seconds: far shorter than any outage below
# The job starts with the default deadline (a loaded machine may take longer than
# STARTUP_TIMEOUT to run its pods); `tighten_startup_timeout` sets STARTUP_TIMEOUT once it
# runs, an edit the operator applies itself.
RECOVERY = {"maxRestarts": 3, "backoffSeconds": 1, "maxBackoffSeconds": 2}


def tighten_startup_timeout(cp: ControlPlane, ns: str, name: str) -> None:
    cp.kubectl("patch", "rljob", name, "-n", ns, "--type", "merge", "-p", json.dumps(
        {"spec": {"recovery": {"startupTimeoutSeconds": STARTUP_TIMEOUT}}}))
    wait_for(lambda: status(cp, ns, name).get("observedGeneration") == cp.get_json(
        "rljob", name, "-n", ns)["metadata"]["generation"], timeout=30,
        what=f"{name}: the operator saw startupTimeoutSeconds {STARTUP_TIMEOUT}")
    assert status(cp, ns, name)["phase"] == "Running"


def conditions(cp: ControlPlane, ns: str, name: str) -> dict[str, Obj]:
    return {c["type"]: c for c in status(cp, ns, name).get("conditions") or []}


def events(cp: ControlPlane, ns: str, name: str, reason: str) -> list[str]:
    items = cp.get_json("events", "-n", ns, "--field-selector",
                        f"involvedObject.name={name}")["items"]
    return [str(e["message"]) for e in items if e["reason"] == reason]


def uids(cp: ControlPlane, ns: str, name: str) -> dict[str, str]:
    """Every live pod of the job, by name, with its UID (a pod made again has another)."""
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cp, ns, name)}


def set_pod_ready(cp: ControlPlane, ns: str, pod: str, ready: bool) -> None:
    """What a kubelet reports when a running pod's readiness changes (a failing readiness
    probe; the kubelet back after its node was NotReady): its containers keep running."""
    flag = "True" if ready else "False"
    patch = {"status": {"conditions": [{"type": t, "status": flag, "lastTransitionTime": now()}
                                       for t in ("Ready", "ContainersReady")]}}
    cp.kubectl("patch", "pod", pod, "-n", ns, "--subresource=status", "--type=strategic",
               "-p", json.dumps(patch))


def kubelet_silent(cp: ControlPlane, ns: str, job: str, kubelet: Kubelet) -> datetime:
    """The node's kubelet stops reporting and its pods of `job` are marked NotReady, as the
    node lifecycle controller marks them; returns when the node's Ready condition changed."""
    kubelet.silence()
    for pod in pods(cp, ns, job):
        if pod["spec"].get("nodeName") == kubelet.node:
            set_pod_ready(cp, ns, pod["metadata"]["name"], False)
    conds = cp.get_json("node", kubelet.node)["status"]["conditions"]
    since = parse_timestamp(next(c for c in conds if c["type"] == "Ready")["lastTransitionTime"])
    assert since is not None
    return since


def run_pods_until_running(cp: ControlPlane, ns: str, job: str, node: str) -> None:
    """Play the kubelet of `node` for the job's pods (their containers run, as they are
    bound there: the driver comes after the compute pods) until the job is Running."""
    def probe() -> bool:
        for pod in pods(cp, ns, job):
            if pod["spec"].get("nodeName") == node and not pod_ready(pod):
                report_containers(cp, ns, pod["metadata"]["name"])
        return status(cp, ns, job).get("phase") == "Running"

    wait_for(probe, timeout=90, what=f"{job} Running on {node}",
             describe=lambda: json.dumps(status(cp, ns, job))[-2000:])


def pod_ready(pod: Obj) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


def not_ready_reported(cp: ControlPlane, ns: str, name: str, *words: str) -> Obj:
    """Wait until the job's Ready condition is False/PodsNotReady and says `words`."""
    def probe() -> Obj | None:
        ready = conditions(cp, ns, name).get("Ready") or {}
        ok = ready.get("reason") == "PodsNotReady" and all(w in ready.get("message", "")
                                                           for w in words)
        return ready if ok else None

    return wait_for(probe, timeout=60, what=f"{name}: Ready=False/PodsNotReady saying {words}",
                    describe=lambda: json.dumps(conditions(cp, ns, name).get("Ready")))


def phases_until(cp: ControlPlane, ns: str, name: str, until: float) -> list[str]:
    """Every phase the job shows while polling it until the wall-clock time `until`."""
    seen: list[str] = []

    def probe() -> bool:
        seen.append(str(status(cp, ns, name).get("phase")))
        return time.time() >= until

    wait_for(probe, timeout=until - time.time() + 30, what=f"{name} polled until {until}")
    return seen


def past_the_startup_timeout(since: str) -> float:
    """A wall-clock time well past the start-up deadline of a start-up begun at `since`,
    had the outage counted as one: the deadline and six resync intervals more."""
    began = parse_timestamp(since)
    assert began is not None
    return began.timestamp() + STARTUP_TIMEOUT + 3


def test_a_running_job_outlasts_a_not_ready_worker_past_its_startup_timeout(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 8)
    cluster.apply(job_manifest("slow", namespace, recovery=RECOVERY), "-n", namespace)
    wait_phase(cluster, namespace, "slow", "Running")
    tighten_startup_timeout(cluster, namespace, "slow")
    before = uids(cluster, namespace, "slow")
    trainer = pods(cluster, namespace, "slow", "trainer")[0]["metadata"]["name"]

    set_pod_ready(cluster, namespace, trainer, False)
    ready = not_ready_reported(cluster, namespace, "slow", f"{trainer} (Running, not Ready)")
    seen = phases_until(cluster, namespace, "slow",
                        past_the_startup_timeout(ready["lastTransitionTime"]))
    assert set(seen) == {"Running"}, seen
    st = status(cluster, namespace, "slow")
    assert st["recovery"]["restarts"] == 0 and "startingSince" not in st
    assert conditions(cluster, namespace, "slow")["Started"]["status"] == "True"
    assert uids(cluster, namespace, "slow") == before  # the driver and every pod kept
    wait_for(lambda: any(trainer in m for m in events(cluster, namespace, "slow",
                                                      "PodsNotReady")),
             timeout=30, what="a PodsNotReady event naming the trainer pod")

    set_pod_ready(cluster, namespace, trainer, True)
    wait_for(lambda: conditions(cluster, namespace, "slow")["Ready"]["status"] == "True",
             timeout=30, what="slow: Ready=True once the trainer pod is Ready again")
    wait_for(lambda: events(cluster, namespace, "slow", "PodsReady"), timeout=30,
             what="a PodsReady event")
    assert uids(cluster, namespace, "slow") == before
    assert status(cluster, namespace, "slow")["recovery"]["restarts"] == 0


def test_a_node_not_ready_for_less_than_the_bound_loses_no_pod(
        cluster: ControlPlane, namespace: str, tmp_path: Path) -> None:
    """Every pod of the job, the driver's too, is on the node that stops reporting, for
    longer than the job's start-up timeout but less than the bound."""
    node = f"{namespace}-hand"
    kubelet = Kubelet(cluster, node, 8)
    operator = Operator(cluster, namespace, tmp_path / "operator.log", node_lost_after=60)
    operator.start()
    try:
        with hand_node(cluster, node, namespace, 8, kubelet):
            cluster.apply(job_manifest("blip", namespace, recovery=RECOVERY), "-n", namespace)
            run_pods_until_running(cluster, namespace, "blip", node)
            tighten_startup_timeout(cluster, namespace, "blip")
            before = uids(cluster, namespace, "blip")
            assert {p["spec"]["nodeName"] for p in pods(cluster, namespace, "blip")} == {node}

            since = kubelet_silent(cluster, namespace, "blip", kubelet)
            ready = not_ready_reported(
                cluster, namespace, "blip", f"{node} is not Ready (Unknown) since {now(since)}",
                f"count as lost at {now(since + timedelta(seconds=60))}",
                "(Running, not Ready)")
            seen = phases_until(cluster, namespace, "blip",
                                past_the_startup_timeout(ready["lastTransitionTime"]))
            assert set(seen) == {"Running"}, seen
            assert uids(cluster, namespace, "blip") == before
            assert time.time() < since.timestamp() + 60, "the outage outlasted the bound"

            # The kubelet is back: the node and its pods report Ready again.
            kubelet.resume()
            for pod in before:
                set_pod_ready(cluster, namespace, pod, True)
            wait_for(lambda: conditions(cluster, namespace, "blip")["Ready"]["status"] == "True",
                     timeout=30, what="blip: Ready=True once the node is back",
                     describe=lambda: json.dumps(conditions(cluster, namespace, "blip")))
            st = status(cluster, namespace, "blip")
            assert st["phase"] == "Running" and st["recovery"]["restarts"] == 0
            assert uids(cluster, namespace, "blip") == before  # none deleted, none made again
            assert not events(cluster, namespace, "blip", "Recovering")
            assert operator.metric("rljob_operator_restarts_total") == 0
    finally:
        operator.stop()


def test_a_node_not_ready_past_the_bound_has_its_pods_force_deleted_when_it_expires(
        cluster: ControlPlane, namespace: str, gpu_pool: Pool, tmp_path: Path) -> None:
    """A long resync interval leaves the moment the node counts as lost to the operator's
    own requeue: the restart follows the bound, not the next resync."""
    bound, interval = 6.0, 30.0
    node = f"{namespace}-hand"
    kubelet = Kubelet(cluster, node, 8)
    operator = Operator(cluster, namespace, tmp_path / "operator.log", interval=interval,
                        node_lost_after=bound)
    operator.start()
    try:
        with hand_node(cluster, node, namespace, 8, kubelet):
            cluster.apply(job_manifest("gone", namespace), "-n", namespace)
            run_pods_until_running(cluster, namespace, "gone", node)
            on_node = set(uids(cluster, namespace, "gone"))
            gpu_pool(1, 8)  # where the job goes next

            since = kubelet_silent(cluster, namespace, "gone", kubelet)

            def recovered() -> Obj | None:
                st = status(cluster, namespace, "gone")
                ok = st.get("phase") == "Running" and st.get("recovery", {}).get(
                    "restarts") == 1
                return st if ok else None

            st = wait_for(recovered, timeout=90, what="gone: Running after restart 1",
                          describe=lambda: json.dumps(status(cluster, namespace, "gone"))[-2000:])
            last = st["recovery"]["lastFailure"]
            assert last["reason"] == "NodeLost" and node in last["message"], last
            failed_at = parse_timestamp(last["time"])
            assert failed_at is not None
            # Not before the bound (times are whole seconds), and not a resync later.
            assert bound - 1 <= (failed_at - since).total_seconds() <= bound + 3, (since, last)
            # Its pods were force-deleted (none is left terminating there), made elsewhere.
            left = {p["metadata"]["name"] for p in cluster.get_json(
                "pods", "-n", namespace, "-l", "rljob.io/job=gone")["items"]
                if p["spec"].get("nodeName") == node}
            assert not left & on_node, left
            assert all(p["spec"]["nodeName"] != node for p in pods(cluster, namespace, "gone"))
    finally:
        operator.stop()
