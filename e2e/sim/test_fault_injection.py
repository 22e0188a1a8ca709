"""Several RLJobs on 20 kwok GPU nodes while pods are killed, a kubelet dies and a node is
deleted: every job a fault touched restarts exactly once per fault and runs again with a
new driver, the others are left alone (a lost rollout pod touches no attempt: the runtime
replaces the engine, KubeRay the pod), nothing is duplicated, and a job past maxRestarts
fails with `RestartLimitExceeded`. (What a restart resumed from is reported by a real
runtime; kwok runs none, so it is not asserted here.)

Choices (which jobs, which pods, which nodes) come from a seeded generator; which jobs a
node fault touches depends on where the scheduler put their pods, so the expected restart
counts are derived from the placement observed just before each fault.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from e2e.sim.faults import compute_pods, jobs_by_node, live_pods
from tests.controlplane import ControlPlane
from tests.operator.harness import job_manifest
from tests.operator_process import NodePool, Operator, stop_kubelet
from tests.polling import wait_for

pytestmark = pytest.mark.e2e

SEED = 7
STEADY_JOBS = 6
NODES, GPUS_PER_NODE = 20, 4
FRAGILE = "fragile"  # maxRestarts 1
Obj = dict[str, Any]


@dataclass
class Ledger:
    """The restarts each job should have had so far; past its maxRestarts a job is Failed."""

    max_restarts: dict[str, int]
    restarts: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, set[str]] = field(default_factory=dict)  # last failure reasons allowed

    def failed(self, job: str) -> bool:
        return self.restarts.get(job, 0) > self.max_restarts[job]

    def alive(self) -> list[str]:
        return sorted(j for j in self.max_restarts if not self.failed(j))

    def hit(self, jobs: set[str], reasons: set[str]) -> None:
        for job in jobs:
            self.restarts[job] = self.restarts.get(job, 0) + 1
            self.reasons[job] = reasons

    def mismatch(self, job: str, st: Obj) -> str | None:
        """Why `st` is not (yet) what the ledger expects for `job`, or None."""
        rec = st.get("recovery") or {}
        got: tuple[Any, ...]
        want: tuple[Any, ...]
        if self.failed(job):
            failed = {c["type"]: c for c in st.get("conditions") or []}.get("Failed") or {}
            got = (st.get("phase"), rec.get("restarts"), failed.get("reason"))
            want = ("Failed", self.max_restarts[job], "RestartLimitExceeded")
        else:
            got = (st.get("phase"), rec.get("restarts"), None)
            want = ("Running", self.restarts.get(job, 0), None)
        if got != want:
            return f"{job}: (phase, restarts, reason) {got} != {want}"
        reason = (rec.get("lastFailure") or {}).get("reason")
        if job in self.reasons and reason not in self.reasons[job]:
            return f"{job}: last failure {reason!r} not in {sorted(self.reasons[job])}"
        return None


def statuses(cp: ControlPlane, ns: str) -> dict[str, Obj]:
    return {j["metadata"]["name"]: j.get("status") or {}
            for j in cp.get_json("rljobs", "-n", ns)["items"]}


def settle(cp: ControlPlane, ns: str, ledger: Ledger, op: Operator, label: str) -> None:
    """Wait until every job is as the ledger says; print `kubectl get rljobs` (with -s)."""
    seen: list[list[str]] = [[]]

    def probe() -> bool:
        st = statuses(cp, ns)
        seen[0] = [m for job in ledger.max_restarts
                   if (m := ledger.mismatch(job, st.get(job, {}))) is not None]
        return not seen[0]

    wait_for(probe, timeout=120, what=f"jobs settled after {label}",
             describe=lambda: "\n".join(seen[0]) + "\noperator log:\n" + op.tail(40))
    table = cp.kubectl("get", "rljobs", "-n", ns).stdout.rstrip()
    print(f"--- after {label}\n$ kubectl get rljobs -n {ns}\n{table}\n", flush=True)


def assert_no_duplicates(cp: ControlPlane, ns: str, ledger: Ledger, lost: set[str]) -> None:
    pods = live_pods(cp, ns)
    clusters = sorted(rc["metadata"]["name"]
                      for rc in cp.get_json("rayclusters", "-n", ns)["items"])
    assert clusters == ledger.alive()
    for job in ledger.max_restarts:
        mine = [p for p in pods if p["metadata"]["labels"]["rljob.io/job"] == job]
        counts: dict[str, int] = {}
        for pod in mine:
            component = pod["metadata"]["labels"]["rljob.io/component"]
            counts[component] = counts.get(component, 0) + 1
        if ledger.failed(job):  # compute released; the driver pod kept unless its node went
            assert set(counts) <= {"driver"} and counts.get("driver", 0) <= 1, counts
        else:
            want = {"head": 1, "trainer": 1, "rollout": 2, "driver": 1}
            assert counts == want, f"{job}: pods {counts} != {want}"
            assert all(p["status"].get("phase") == "Running" for p in mine), job
            assert not {p["spec"]["nodeName"] for p in mine} & lost, f"{job} on a lost node"
    for kind in ("configmaps", "serviceaccounts", "roles", "rolebindings", "networkpolicies"):
        owners = [o["metadata"]["labels"]["rljob.io/job"]
                  for o in cp.get_json(kind, "-n", ns, "-l", "rljob.io/job")["items"]]
        assert sorted(owners) == sorted(ledger.max_restarts), f"{kind}: {owners}"


def test_faults_restart_exactly_the_touched_jobs(
        cluster: ControlPlane, namespace: str, operator: Operator,
        node_pool: NodePool) -> None:
    rng = random.Random(SEED)
    nodes = node_pool.add(NODES, GPUS_PER_NODE)
    jobs = [job_manifest(f"job-{i}", namespace) for i in range(STEADY_JOBS)]
    jobs.append(job_manifest(FRAGILE, namespace, recovery={
        "maxRestarts": 1, "backoffSeconds": 1, "maxBackoffSeconds": 1}))
    ledger = Ledger({j["metadata"]["name"]: j["spec"]["recovery"]["maxRestarts"] for j in jobs})
    cluster.apply(jobs, "-n", namespace)
    settle(cluster, namespace, ledger, operator, "creation")

    # 1. Random head or trainer pods of three jobs are killed; one job loses two pods at
    #    once, which is still one failure of its attempt. A rollout pod of a fourth job
    #    goes too: the runtime replaces engines itself, so that job does not restart.
    pods = live_pods(cluster, namespace)
    victims = rng.sample(ledger.alive(), 4)
    spared = victims.pop()
    for i, job in enumerate(victims):
        doomed = rng.sample(compute_pods(pods, job, ("head", "trainer")), 2 if i == 0 else 1)
        cluster.kubectl("delete", "pod", *doomed, "-n", namespace, "--wait=false")
    engine_pod = rng.choice(compute_pods(pods, spared, ("rollout",)))
    cluster.kubectl("delete", "pod", engine_pod, "-n", namespace, "--wait=false")
    ledger.hit(set(victims), {"PodDeleted", "PodFailed"})
    settle(cluster, namespace, ledger, operator, f"killing pods of {victims} and {engine_pod}")

    # 2. A kubelet stops reporting, then a node is deleted: every job with a head or
    #    trainer pod on the busiest node restarts elsewhere (rollout pods move without).
    lost: set[str] = set()
    for fault, reasons in (("kubelet stopped", {"NodeLost"}),
                           ("node deleted", {"NodeLost", "PodDeleted"})):
        alive = set(ledger.alive())
        by_node = jobs_by_node(live_pods(cluster, namespace), frozenset({"rollout"}))
        placed = {n: js & alive for n, js in by_node.items() if js & alive and n not in lost}
        busiest = max(len(js) for js in placed.values())
        node = rng.choice(sorted(n for n, js in placed.items() if len(js) == busiest))
        if fault == "kubelet stopped":
            stop_kubelet(cluster, node)
        else:
            cluster.kubectl("delete", "node", node, "--wait=false")
        lost.add(node)
        ledger.hit(placed[node], reasons)
        settle(cluster, namespace, ledger, operator, f"{fault} on {node} "
               f"(jobs {sorted(placed[node])})")

    # 3. The fragile job is failed until it runs out of restarts.
    while not ledger.failed(FRAGILE):
        pods = live_pods(cluster, namespace)
        pod = rng.choice(compute_pods(pods, FRAGILE, ("head", "trainer")))
        cluster.kubectl("delete", "pod", pod, "-n", namespace, "--wait=false")
        ledger.hit({FRAGILE}, {"PodDeleted"})
        settle(cluster, namespace, ledger, operator, f"killing {pod}")

    st = statuses(cluster, namespace)[FRAGILE]
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    # The message names the failure that used up the restarts.
    assert any(r in failed["message"] for r in ledger.reasons[FRAGILE]), json.dumps(failed)
    assert st["finishedAt"]
    failed_jobs = [j for j in ledger.max_restarts if ledger.failed(j)]
    wait_for(lambda: not any(compute_pods(live_pods(cluster, namespace), j) for j in failed_jobs),
             timeout=60, what=f"the compute pods of {failed_jobs} released")
    assert_no_duplicates(cluster, namespace, ledger, lost)
    assert lost <= set(nodes)
    assert operator.metric("rljob_operator_restarts_total") == sum(
        min(n, ledger.max_restarts[j]) for j, n in ledger.restarts.items())
