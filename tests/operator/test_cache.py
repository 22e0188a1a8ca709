"""The watch cache's bookkeeping: newest version wins, deletions of older versions do not
remove a newer object of the same name, a fresh list replaces what a job held, and the
shared node list is refreshed by age (sooner when a reconcile hurries it)."""

from __future__ import annotations

from typing import Any

import pytest

from rljob_api.layout import HEAD
from rljob_operator import names
from rljob_operator.cache import POD, RAYCLUSTER, RLJOB, NodeCache, Store, pod_unready

pytestmark = pytest.mark.unit
Obj = dict[str, Any]


def pod(name: str, rv: str, job: str = "j", phase: str = "Running") -> Obj:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": rv,
                         "labels": {names.LABEL_JOB: job}},
            "spec": {"nodeName": "n1"}, "status": {"phase": phase}}


def test_an_older_event_does_not_roll_back_what_a_write_returned() -> None:
    store = Store()
    job = {"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "10"},
           "status": {"phase": "Running"}}
    store.put(RLJOB, job)
    store.put(RLJOB, {**job, "metadata": {**job["metadata"], "resourceVersion": "9"},
                      "status": {"phase": "Pending"}})
    assert store.rljob("ns", "j") is job
    store.remove(RLJOB, {**job, "metadata": {**job["metadata"], "resourceVersion": "8"}})
    assert store.rljob("ns", "j") is job
    store.remove(RLJOB, {**job, "metadata": {**job["metadata"], "resourceVersion": "11"}})
    assert store.rljob("ns", "j") is None


def test_children_are_grouped_by_the_job_label_and_replaced_by_a_fresh_list() -> None:
    store = Store()
    store.put(POD, pod("a", "5"))
    store.put(POD, pod("b", "6"))
    store.put(POD, pod("c", "7", job="other"))
    store.put(POD, {"metadata": {"name": "unlabelled", "namespace": "ns"}})
    assert sorted(p["metadata"]["name"] for p in store.pods("ns", "j")) == ["a", "b"]
    # A pod made again under the same name: the old one's deletion leaves it.
    store.put(POD, pod("a", "20"))
    store.remove(POD, pod("a", "6"))
    assert [p["metadata"]["resourceVersion"] for p in store.pods("ns", "j")
            if p["metadata"]["name"] == "a"] == ["20"]
    store.replace_children(POD, ("ns", "j"), [pod("b", "30")])
    assert [p["metadata"]["name"] for p in store.pods("ns", "j")] == ["b"]
    store.replace_children(POD, ("ns", "j"), [])
    assert store.pods("ns", "j") == [] and store.sizes() == (0, 0, 1)
    cluster = {"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "3",
                            "labels": {names.LABEL_JOB: "j"}}}
    store.put(RAYCLUSTER, cluster)
    assert store.raycluster("ns", "j") is cluster and store.raycluster("ns", "x") is None


def test_node_list_is_shared_and_refreshed_by_age() -> None:
    calls: list[float] = []
    now = [0.0]

    def lister() -> list[Obj]:
        calls.append(now[0])
        return [{"metadata": {"name": f"n{len(calls)}"}}]

    nodes = NodeCache(lister, ttl=30.0, min_age=2.0, clock=lambda: now[0])
    assert [n["metadata"]["name"] for n in nodes.get(["n1", "gone"])] == ["n1"]
    now[0] = 1.0
    nodes.get(["n1"], hurry=True)
    now[0] = 10.0
    nodes.get(["n1"])
    assert calls == [0.0]  # younger than min_age when hurried, than ttl otherwise
    nodes.get(["n1"], hurry=True)
    now[0] = 45.0
    nodes.get(["n1"])
    assert calls == [0.0, 10.0, 45.0]


def test_a_bound_running_pod_without_ready_true_is_unready() -> None:
    p = pod("a", "1")
    assert pod_unready(p)
    p["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert not pod_unready(p)
    assert not pod_unready(pod("b", "1", phase="Pending"))


def test_a_write_response_after_the_deletion_event_does_not_bring_the_object_back() -> None:
    """A pod deleted at once: the watch's DELETED can come before the delete call returns."""
    store = Store()
    store.put(POD, pod("d", "5"))
    store.remove(POD, pod("d", "7"))
    store.put(POD, pod("d", "6"))  # the delete's response, late
    assert store.pods("ns", "j") == []
    store.put(POD, pod("d", "9"))  # made again under the same name
    assert [p["metadata"]["resourceVersion"] for p in store.pods("ns", "j")] == ["9"]


def test_pods_of_a_raycluster_that_is_gone_are_not_the_jobs_compute_pods() -> None:
    """The job's RayCluster was deleted (say, to replace the Ray token) and its pods are not
    collected yet: a driver started now must not be given them as its compute pods."""
    from rljob_operator.observe import observe

    head = pod("j-head-x", "3")
    head["metadata"]["labels"][names.LABEL_COMPONENT] = HEAD
    head["metadata"]["ownerReferences"] = [{"kind": "RayCluster", "name": "j",
                                            "uid": "old-cluster", "controller": True}]
    assert observe("j", None, [head], [], uid="job-uid").compute == ()
    cluster = {"metadata": {"name": "j", "uid": "old-cluster", "ownerReferences": [
        {"kind": "RLJob", "name": "j", "uid": "job-uid", "controller": True}]}}
    assert [p.name for p in observe("j", cluster, [head], [], uid="job-uid").compute] == \
        ["j-head-x"]
