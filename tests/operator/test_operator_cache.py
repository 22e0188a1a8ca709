"""The operator reads its watch cache: while a job runs and nothing changes, it asks the API
server nothing (counted from the audit log, where the operator runs as the one audited
user), a change it can only learn from a watch (a pod deleted behind its back) still
brings the right reconcile: Recovering, a new driver, Running again, and once the job is
deleted the operator holds nothing of it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.controlplane import ControlPlane
from tests.controlplane_audit import WRITES, audit_requests, describe_request
from tests.operator.harness import job_manifest
from tests.operator.jobs import Obj, pods, status, wait_phase
from tests.operator_process import Operator
from tests.polling import wait_for

pytestmark = pytest.mark.controlplane
Pool = Callable[[int, int], list[str]]
INTERVAL = 0.5  # many cached reconciles in a short window


def test_idle_reconciles_read_the_cache_and_a_watched_change_still_recovers(
        cluster: ControlPlane, namespace: str, gpu_pool: Pool, tmp_path: Path) -> None:
    gpu_pool(1, 8)
    # The safety resync is put far off: its per-job offset could otherwise bring it into
    # the idle window, where it would read (rightly) what this test says is never read.
    operator = Operator(cluster, namespace, tmp_path / "operator.log", interval=INTERVAL,
                        kubeconfig=cluster.audited_kubeconfig,
                        extra_args=("--resync", "1000000"))
    operator.start()
    try:
        cluster.apply(job_manifest("cached", namespace), "-n", namespace)
        wait_phase(cluster, namespace, "cached", "Running")
        # The phase shows before the operator is done: the reconcile that wrote it posts the
        # transition's Event after the status write (the last request of that reconcile; an
        # earlier one's Event was posted before the next reconcile began). The idle window
        # opens once that Event exists, else its create may fall inside it.
        wait_for(lambda: transition_events(cluster, namespace, "cached", "Running"),
                 timeout=30, what="the Event of the transition to Running",
                 describe=lambda: operator.tail(20))

        # Idle: at least 20 reconciles (10 s), and not one read of the job or its children,
        # not one write. Nodes are listed for all jobs together, at most every 3 intervals.
        reconciles = operator.metric("rljob_operator_reconciles_total")
        start = datetime.now(UTC)
        wait_for(lambda: operator.metric("rljob_operator_reconciles_total") >= reconciles + 20,
                 timeout=60, what="20 more reconciles")
        end = datetime.now(UTC)
        seen = [e for e in audit_requests(cluster.audit_log, start, end)
                if e["verb"] != "watch"]
        kinds = Counter(describe_request(e) for e in seen)
        assert set(kinds) <= {"list nodes"}, kinds
        window = (end - start).total_seconds()
        assert kinds["list nodes"] <= window / (3 * INTERVAL) + 1, kinds
        assert status(cluster, namespace, "cached")["phase"] == "Running"

        # A trainer pod is deleted: only the pod watch can tell. The operator recovers with a
        # new driver, reading no pod list, RayCluster or RLJob from the API server to do it.
        trainer = pods(cluster, namespace, "cached", "trainer")[0]["metadata"]["name"]
        driver_uid = pods(cluster, namespace, "cached", "driver")[0]["metadata"]["uid"]
        start = datetime.now(UTC)
        cluster.kubectl("delete", "pod", trainer, "-n", namespace, "--wait=false")

        def recovered() -> bool:
            st = status(cluster, namespace, "cached")
            return st.get("phase") == "Running" and st["recovery"]["restarts"] == 1

        wait_for(recovered, timeout=90, what="Running again after restart 1",
                 describe=operator.tail)
        end = datetime.now(UTC)
        st = status(cluster, namespace, "cached")
        assert (st["recovery"]["lastFailure"]["reason"],
                st["recovery"]["lastFailure"]["pod"]) == ("PodDeleted", trainer)
        new_driver = pods(cluster, namespace, "cached", "driver")
        assert [p["metadata"]["uid"] for p in new_driver] != [driver_uid]
        assert new_driver[0]["metadata"]["annotations"]["rljob.io/restarts"] == "1"
        kinds = Counter(describe_request(e) for e in audit_requests(
            cluster.audit_log, start, end) if e["verb"] != "watch")
        assert not {k for k in kinds if k.split()[0] in ("get", "list")
                    and k.split()[1] in ("pods", "rayclusters", "rljobs")}, kinds
        # What it did write: the status, the driver's delete and create.
        assert kinds["patch rljobs/status"] >= 1 and kinds["create pods"] >= 1, kinds
        # The objects the pods mount are checked when the wait begins (then 10, 30, 70 s
        # on), not once more just before the new driver.
        waited = (end - start).total_seconds()
        checks = 1 + sum(1 for t in (10, 30, 70, 150) if waited >= t)
        assert 1 <= kinds["create secrets"] <= checks, (kinds, waited)
        # Reads besides node lists: the owner of a support object the check's create met, the
        # first time it meets it (then remembered).
        assert {k for k in kinds if k.split()[0] == "get"} <= {
            f"get {kind}" for kind in ("configmaps", "serviceaccounts", "roles",
                                       "rolebindings", "persistentvolumeclaims",
                                       "networkpolicies")}, kinds
        assert {k.split()[0] for k in kinds} <= WRITES | {"list", "get"}, kinds

        # Deleted: its children go by garbage collection, and nothing of it stays in the
        # operator (cache, failure hints, per-job state, work queue).
        assert operator.metric("rljob_operator_remembered") > 0
        cluster.kubectl("delete", "rljob", "cached", "-n", namespace, "--wait=false")
        wait_for(lambda: operator.metric("rljob_operator_remembered") == 0, timeout=90,
                 what="the operator to hold nothing of the deleted job",
                 describe=lambda: operator.tail(20))
    finally:
        operator.stop()


def transition_events(cp: ControlPlane, ns: str, job: str, reason: str) -> list[Obj]:
    """The Events the operator posted about `job` with `reason` (read as the admin, who is
    not audited)."""
    items: list[Obj] = cp.get_json(
        "events", "-n", ns, "--field-selector",
        f"involvedObject.kind=RLJob,involvedObject.name={job},reason={reason}")["items"]
    return items
