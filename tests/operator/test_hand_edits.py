"""Pure pieces of what the operator does with hand edits (the control-plane test is
test_operator_chaos.py): children found by owner when their label is gone, labels put back
only on what is provably the job's, resized worker groups, and a status written by hand
(terminal phase, restart count, times that are no times, fields an apply cannot remove)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from rljob_api.status import timestamp as iso
from rljob_operator import names
from rljob_operator.cache import Store
from rljob_operator.observe import Relabel, label_repairs, observe
from rljob_operator.phases import decide, finished
from rljob_operator.situation import parse_job
from rljob_operator.status import merge_patch_to, needs_write
from tests.operator.test_decide import (
    COMPUTE,
    OURS,
    READY_NODE,
    RUNNING,
    built,
    conditions,
    driver,
    job,
    of_cluster,
    pod,
)

pytestmark = pytest.mark.unit
Obj = dict[str, Any]
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
MINE: Obj = {"metadata": {"name": "rl", "uid": "rc-1", "ownerReferences": OURS},
             "spec": {"workerGroupSpecs": [
                 {"groupName": "trainer", "replicas": 1, "minReplicas": 1, "maxReplicas": 1},
                 {"groupName": "rollout", "replicas": 2, "minReplicas": 2, "maxReplicas": 2}]}}


def owned_driver(restarts: int = 0) -> Obj:
    d = driver(restarts=restarts)
    d["metadata"]["ownerReferences"] = OURS
    return d


def decide_on(status: Obj, rc: Obj = MINE, pods: list[Obj] | None = None) -> Any:
    body = job(status)
    pods = pods if pods is not None else [*of_cluster(compute_pods()), owned_driver()]
    pods, cluster = built(body, pods, rc)
    return decide(parse_job(body), observe("rl", cluster, pods, [READY_NODE], uid="u"), T0)


def compute_pods() -> list[Obj]:
    return [pod(n, c) for n, c in COMPUTE]


# -- the watch cache -------------------------------------------------------------------------

def test_a_child_whose_label_was_removed_is_filed_under_its_job_by_owner() -> None:
    store = Store()
    store.put("RLJob", {"metadata": {"name": "rl", "namespace": "ns", "resourceVersion": "1"}})
    drv = {"metadata": {"name": "rl-driver", "namespace": "ns", "resourceVersion": "2",
                        "labels": {names.LABEL_JOB: "rl"}, "ownerReferences": OURS}}
    store.put("Pod", drv)
    bare = copy.deepcopy(drv)
    bare["metadata"]["labels"] = {}
    bare["metadata"]["resourceVersion"] = "3"
    store.watched("Pod", "MODIFIED", bare)
    assert [p["metadata"]["resourceVersion"] for p in store.pods("ns", "rl")] == ["3"]
    worker = {"metadata": {"name": "rl-rollout-x", "namespace": "ns", "resourceVersion": "4",
                           "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayCluster",
                                                "name": "rl", "uid": "rc-1",
                                                "controller": True}]}}
    assert Store.job_of(worker) == ("ns", "rl")
    stranger = {"metadata": {"name": "x", "namespace": "ns", "ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rl", "controller": True}]}}
    assert Store.job_of(stranger) is None


# -- labels put back -------------------------------------------------------------------------

def test_labels_are_put_back_only_on_the_jobs_own_children() -> None:
    rc = copy.deepcopy(MINE)
    rc["metadata"]["labels"] = {}
    drv = owned_driver()
    drv["metadata"]["labels"] = {}
    head = of_cluster([pod("rl-head-a", "head")])[0]
    head["metadata"]["labels"] = {"ray.io/node-type": "head", "ray.io/group": "headgroup"}
    worker = of_cluster([pod("rl-rollout-worker-a", "rollout")])[0]
    del worker["metadata"]["labels"][names.LABEL_COMPONENT]
    worker["metadata"]["labels"]["ray.io/group"] = "rollout"
    lookalike = pod("rl-rollout-worker-z", "rollout")  # owned by nobody
    lookalike["metadata"]["labels"] = {}
    other = of_cluster([pod("rl-trainer-worker-o", "trainer")], uid="another-cluster")[0]
    other["metadata"]["labels"] = {}
    fixes = {f.name: f for f in label_repairs("rl", "u", rc,
                                              [drv, head, worker, lookalike, other])}
    assert set(fixes) == {"rl", "rl-driver", "rl-head-a", "rl-rollout-worker-a"}
    assert fixes["rl"] == Relabel("RayCluster", "rl", names.labels("rl", "head"))
    assert fixes["rl-driver"].labels == names.labels("rl", "driver")
    assert fixes["rl-head-a"].labels == names.labels("rl", "head")
    assert fixes["rl-rollout-worker-a"].labels == {names.LABEL_JOB: "rl",
                                                   names.LABEL_COMPONENT: "rollout",
                                                   names.LABEL_MANAGED_BY: "rljob-operator"}
    # A RayCluster the job does not own: neither it nor its pods are touched.
    foreign = copy.deepcopy(rc)
    foreign["metadata"]["ownerReferences"] = []
    assert [f.name for f in label_repairs("rl", "u", foreign, [head])] == []


# -- worker groups resized by hand -------------------------------------------------------------

def test_a_worker_group_resized_by_hand_is_patched_back_and_said_so() -> None:
    rc = copy.deepcopy(MINE)
    rc["spec"]["workerGroupSpecs"][1].update(replicas=3, minReplicas=3, maxReplicas=3)
    d = decide_on(RUNNING, rc)
    assert d.actions.patch_cluster and d.status["phase"] == "Running"
    assert d.event is not None and d.event.reason == "ChildRepaired"
    assert "rollout (3, 3, 3) (the spec builds 2)" in d.event.message
    assert not decide_on(RUNNING).actions.patch_cluster


# -- a status written by hand ----------------------------------------------------------------

def test_a_terminal_phase_the_operator_did_not_write_is_decided_again() -> None:
    """A bare phase: Succeeded on a job that runs would otherwise delete its RayCluster."""
    d = decide_on({**RUNNING, "phase": "Succeeded"})
    assert d.status["phase"] == "Running" and not d.actions.delete_cluster
    assert d.event is not None and d.event.reason == "StatusRepaired"
    assert "finishedAt" not in d.status
    done = {**RUNNING, "phase": "Succeeded", "finishedAt": iso(T0), "conditions": [
        {"type": "Succeeded", "status": "True", "reason": "DriverSucceeded",
         "lastTransitionTime": iso(T0)}]}
    assert finished(done)
    assert decide_on(done).actions.delete_cluster  # the operator's own: final


def test_a_restart_count_below_the_running_drivers_attempt_is_not_believed() -> None:
    d = decide_on({**RUNNING, "recovery": {"restarts": -7, "maxRestarts": 2}})
    assert d.status["recovery"]["restarts"] == 0
    assert not d.actions.delete_driver and d.status["phase"] == "Running"
    pods = [*of_cluster(compute_pods()), owned_driver(restarts=2)]
    d = decide_on({**RUNNING, "recovery": {"restarts": 1, "maxRestarts": 2}}, pods=pods)
    assert d.status["recovery"]["restarts"] == 2 and not d.actions.delete_driver


def test_times_that_are_no_times_are_not_carried_over() -> None:
    stored = {**RUNNING, "startedAt": "garbage", "conditions": [
        {"type": "Ready", "status": "True", "reason": "Running", "message": "",
         "lastTransitionTime": "not a time"}]}
    d = decide_on(stored)
    assert conditions(d)["Ready"]["lastTransitionTime"] == iso(T0)
    assert d.status["startedAt"] == iso(T0)


def test_the_merge_patch_makes_the_operators_fields_exactly_the_decisions() -> None:
    stored = {"phase": "Running", "conditions": [{"type": "Hacked"}],
              "recovery": {"restarts": 0, "action": "Nonsense", "lastFailure": {"reason": "x",
                                                                               "step": 3}},
              "startingSince": "garbage"}
    desired = {"phase": "Running", "conditions": [{"type": "Ready"}],
               "recovery": {"restarts": 0, "lastFailure": {"reason": "x"}}}
    patch = merge_patch_to(stored, desired)
    assert patch == {"startingSince": None, "conditions": [{"type": "Ready"}],
                     "recovery": {"action": None, "lastFailure": {"step": None}}}
    assert needs_write(stored, desired) and not needs_write(desired, desired)
