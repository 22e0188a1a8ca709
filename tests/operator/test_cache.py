"""The watch cache's bookkeeping: newest version wins, deletions of older versions do not
remove a newer object of the same name, a fresh list replaces what a job held, and the
shared node list is refreshed by age (sooner when a reconcile hurries it)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
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


def with_jobs(store: Store, *jobs: str) -> Store:
    """A store holding the RLJobs `jobs` (children are kept only for a job held)."""
    for name in jobs or ("j", "other"):
        store.put(RLJOB, {"metadata": {"name": name, "namespace": "ns", "resourceVersion": "1"}})
    return store


def node(name: str, ready: bool = True) -> Obj:
    return {"metadata": {"name": name}, "status": {"conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


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
    store = with_jobs(Store())
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
    store.replace_children(POD, ("ns", "j"), [pod("b", "30")], "30")
    assert [p["metadata"]["name"] for p in store.pods("ns", "j")] == ["b"]
    store.replace_children(POD, ("ns", "j"), [], "31")
    assert store.pods("ns", "j") == [] and store.sizes() == (2, 0, 1)
    cluster = {"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "3",
                            "labels": {names.LABEL_JOB: "j"}}}
    store.put(RAYCLUSTER, cluster)
    assert store.raycluster("ns", "j") is cluster and store.raycluster("ns", "x") is None


def test_node_list_is_shared_and_refreshed_by_age() -> None:
    calls: list[float] = []
    now = [0.0]

    def lister(consistent: bool) -> list[Obj]:
        calls.append(now[0])
        return [node("n1")]

    nodes = NodeCache(lister, ttl=30.0, min_age=2.0, clock=lambda: now[0])
    assert [n["metadata"]["name"] for n in nodes.get(["n1"])] == ["n1"]
    now[0] = 1.0
    nodes.get(["n1"], hurry=True)
    now[0] = 10.0
    nodes.get(["n1"])
    assert calls == [0.0]  # younger than min_age when hurried, than ttl otherwise
    nodes.get(["n1"], hurry=True)
    now[0] = 45.0
    nodes.get(["n1"])
    assert calls == [0.0, 10.0, 45.0]


def test_a_node_that_joined_after_the_list_is_not_taken_for_a_lost_one() -> None:
    """A pod bound to a node the (young) list lacks: the node list is read again at once,
    from etcd, before the node counts as gone; a node that really is gone costs one such
    read, not one per reconcile."""
    now = [0.0]
    cluster = {"n1"}
    calls: list[tuple[float, bool]] = []

    def lister(consistent: bool) -> list[Obj]:
        calls.append((now[0], consistent))
        return [node(n) for n in sorted(cluster)]

    nodes = NodeCache(lister, ttl=30.0, min_age=2.0, clock=lambda: now[0])
    nodes.get(["n1"])
    now[0] = 5.0
    cluster.add("n2")  # joins; a pod is bound to it
    assert sorted(n["metadata"]["name"] for n in nodes.get(["n1", "n2"])) == ["n1", "n2"]
    assert calls == [(0.0, False), (5.0, True)]
    cluster.discard("n2")  # really gone; the cached list still has it until the ttl
    now[0] = 40.0
    assert nodes.get(["n2"]) == []  # aged list (no n2), then one read from etcd: gone
    now[0] = 41.0
    assert nodes.get(["n2"]) == [] and nodes.get(["n2"], hurry=True) == []
    assert calls == [(0.0, False), (5.0, True), (40.0, False), (40.0, True)]


def test_a_node_that_turned_ready_after_the_list_is_not_taken_for_a_lost_one() -> None:
    """Listed NotReady (just registered), Ready by the time a pod binds to it: the node is
    listed again before anything counts it lost; one that stays NotReady is believed after
    that one list (and costs no more)."""
    now = [0.0]
    ready = {"n1": False}
    calls: list[bool] = []

    def lister(consistent: bool) -> list[Obj]:
        calls.append(consistent)
        return [node(n, r) for n, r in ready.items()]

    nodes = NodeCache(lister, ttl=30.0, min_age=2.0, clock=lambda: now[0])
    nodes.get([])  # some other job's reconcile lists while n1 is NotReady
    ready["n1"] = True
    now[0] = 20.0
    (n1,) = nodes.get(["n1"])
    assert n1["status"]["conditions"][0]["status"] == "True" and calls == [False, True]
    ready["n1"] = False  # it really fails
    now[0] = 55.0
    (n1,) = nodes.get(["n1"])
    assert n1["status"]["conditions"][0]["status"] == "False"
    now[0] = 56.0
    nodes.get(["n1"])
    assert calls == [False, True, False, True]


def test_a_bound_running_pod_without_ready_true_is_unready() -> None:
    p = pod("a", "1")
    assert pod_unready(p)
    p["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert not pod_unready(p)
    assert not pod_unready(pod("b", "1", phase="Pending"))


def test_a_write_response_after_the_deletion_event_does_not_bring_the_object_back() -> None:
    """A pod deleted at once: the watch's DELETED can come before the delete call returns."""
    store = with_jobs(Store())
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


def test_a_stale_fresh_list_neither_brings_back_a_deleted_pod_nor_drops_a_newer_one() -> None:
    """The safety resync's list was taken at version 10. Meanwhile the watch told of a pod's
    deletion (at 11) and of a pod made after the list (at 12): the list still shows the
    first and lacks the second, and neither may win."""
    store = with_jobs(Store())
    store.put(POD, pod("deleted", "8"))
    store.put(POD, pod("kept", "9"))
    store.remove(POD, pod("deleted", "11"))
    store.put(POD, pod("made-after", "12"))
    store.put(POD, pod("gone-before", "7"))  # deleted before the list: the list lacks it
    store.replace_children(POD, ("ns", "j"), [pod("deleted", "8"), pod("kept", "9")], "10")
    assert sorted(p["metadata"]["name"] for p in store.pods("ns", "j")) == \
        ["kept", "made-after"]
    # A listed object older than what the watch stored already: the newer copy stays.
    store.put(POD, pod("kept", "13"))
    store.replace_children(POD, ("ns", "j"), [pod("kept", "9"), pod("made-after", "12")],
                           "10")
    assert {p["metadata"]["name"]: p["metadata"]["resourceVersion"]
            for p in store.pods("ns", "j")} == {"kept": "13", "made-after": "12"}


def _uid(obj: Obj, uid: str) -> Obj:
    obj["metadata"]["uid"] = uid
    return obj


def test_a_relist_is_noticed_and_the_start_up_listing_is_not() -> None:
    """kopf delivers listed objects with no event type: every object's first event at
    start-up, and, after 410 Gone, objects the store has heard of already (a relist)."""
    store = with_jobs(Store())
    store.watched(POD, None, _uid(pod("a", "5"), "u-a"))
    store.watched(POD, None, _uid(pod("c", "6"), "u-c"))
    store.watched(RAYCLUSTER, None, _uid(pod("j", "6"), "u-rc"))
    assert store.relisted_at is None  # the start-up listing
    store.watched(POD, "ADDED", _uid(pod("b", "7"), "u-b"))
    store.watched(POD, "DELETED", _uid(pod("b", "8"), "u-b"))
    store.watched(RAYCLUSTER, None, _uid(pod("k", "9", job="other"), "u-rc2"))
    assert store.relisted_at is None  # another kind's watch may still be listing
    store.watched(POD, None, _uid(pod("a", "9"), "u-a"))
    assert store.relisted_at is not None
    assert sorted(p["metadata"]["name"] for p in store.pods("ns", "j")) == ["a", "c"]


def test_a_relist_of_objects_none_of_which_was_heard_of_is_noticed() -> None:
    """A watch gap took every pod the store had heard of (a job's node went away with all
    its pods) and the relist after 410 Gone shows only KubeRay's new ones: still a relist,
    once that watch has delivered events; the job is read fresh and the pods whose deletion
    fell in the gap go (else the store would show the old driver running until the safety
    resync, and the lost pods would bring no recovery until then)."""
    _, store, now, api, rec = _job_and_driver_read_once()
    store.watched(POD, "MODIFIED", _uid(pod("driver", "7"), "u-d"))
    now[0] = 101.0
    rec._read("ns", "j")
    assert len(api.reads) == 3 and store.relisted_at is None
    replacement = _uid(pod("worker-new", "30"), "u-new")
    api.pod_list, api.list_rv = [replacement], "31"  # the driver went in the gap
    now[0] = 102.0
    store.watched(POD, None, replacement)  # the relist shows only a pod never heard of
    assert store.relisted_at == 102.0
    assert [p["metadata"]["name"] for p in rec._read("ns", "j")[2]] == ["worker-new"]
    assert len(api.reads) == 6


def test_uids_of_objects_the_store_does_not_keep_are_not_remembered() -> None:
    """Pods of a job not held (a deleted job's, collected) are not kept, and neither are
    their UIDs: one whose deletion event a watch gap took would be remembered for good."""
    store = with_jobs(Store(), "j")
    store.watched(POD, "ADDED", _uid(pod("a", "5", job="gone"), "u-a"))
    store.watched(POD, "ADDED", _uid(pod("b", "5"), "u-b"))
    assert store._heard == {"u-b"}


def test_managed_fields_are_not_kept() -> None:
    store = with_jobs(Store())
    p = pod("a", "5")
    p["metadata"]["managedFields"] = [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}]
    store.put(POD, p)
    (held,) = store.pods("ns", "j")
    assert "managedFields" not in held["metadata"] and "managedFields" in p["metadata"]


class _FakeApi:
    """What `Reconciler._read` asks of the API server, answered from plain values."""

    def __init__(self, job: Obj | None, pods: list[Obj], list_rv: str) -> None:
        self.job, self.pod_list, self.list_rv = job, pods, list_rv
        self.reads: list[str] = []
        self.gets: list[str] = []  # children read by name (held, missing from a list)

    def get_rljob(self, namespace: str, name: str) -> Obj | None:
        self.reads.append("get rljob")
        return self.job

    def list_rayclusters(self, namespace: str, job: str) -> tuple[list[Obj], str]:
        self.reads.append("list rayclusters")
        return [], self.list_rv

    def list_pods(self, namespace: str, job: str) -> tuple[list[Obj], str]:
        self.reads.append("list pods")
        return self.pod_list, self.list_rv

    def get_child(self, kind: str, namespace: str, name: str) -> Obj | None:
        """A child the store held that the list lacks: gone, in these tests."""
        self.gets.append(f"{kind} {name}")
        return None

    def list_nodes(self, consistent: bool = False) -> list[Obj]:
        return []


def _reconciler(api: _FakeApi, store: Store, now: list[float]) -> Any:
    from rljob_operator.memory import Memory
    from rljob_operator.metrics import Metrics
    from rljob_operator.reconciler import Reconciler

    return Reconciler(api, Metrics(), Memory(), store=store,  # type: ignore[arg-type]
                      resync=600.0, monotonic=lambda: now[0],
                      clock=lambda: datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
                      + timedelta(seconds=now[0]))



def _job_and_driver_read_once() -> tuple[Obj, Store, list[float], _FakeApi, Any]:
    """A job and its driver pod as the watches delivered them, and a reconciler that has read
    the job once: the first sight of a job reads fresh."""
    job = _uid({"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "4"}}, "u-j")
    now = [100.0]
    store = Store(clock=lambda: now[0])
    store.watched(RLJOB, None, job)
    driver = _uid(pod("driver", "5"), "u-d")
    store.watched(POD, None, driver)
    api = _FakeApi(job, [driver], "6")
    rec = _reconciler(api, store, now)
    rec._read("ns", "j")
    return job, store, now, api, rec

def test_after_a_relist_each_job_is_read_fresh_once_and_what_vanished_in_the_gap_goes() -> None:
    job, store, now, api, rec = _job_and_driver_read_once()
    assert len(api.reads) == 3
    now[0] = 100.5
    assert rec._read("ns", "j")[2] != [] and len(api.reads) == 3  # then the cache
    api.pod_list, api.list_rv = [], "20"  # the driver pod was deleted while away
    now[0] = 101.0
    store.watched(RLJOB, None, job)  # the watch lists again after 410 Gone
    assert [p for p in rec._read("ns", "j")[2]] == []
    assert len(api.reads) == 6 and store.pods("ns", "j") == []
    # The held pod the list lacks was looked for by name once (gone, not just unlabelled).
    assert api.gets == ["Pod driver"]
    now[0] = 102.0
    rec._read("ns", "j")
    assert len(api.reads) == 6  # once per relist, then the cache again


def test_a_job_the_api_server_no_longer_has_leaves_the_cache_and_the_queue() -> None:
    """Its deletion fell in a watch gap: the safety resync finds it gone, drops it and its
    children from the store, and the reconcile says GONE (the controller forgets it)."""
    from rljob_operator.controller import GONE

    job = _uid({"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "4"}}, "u-j")
    store = Store()
    store.put(RLJOB, job)
    store.put(POD, pod("driver", "5"))
    api = _FakeApi(None, [], "20")
    now = [0.0]
    rec = _reconciler(api, store, now)
    rec._read("ns", "j")  # the first sight schedules its resync within one period
    now[0] = 700.0
    assert rec.reconcile("ns", "j") is GONE
    assert store.rljob("ns", "j") is None and store.pods("ns", "j") == []
    assert store.sizes() == (0, 0, 0)


def test_an_object_a_delete_removed_without_showing_it_leaves_the_cache() -> None:
    """A delete answered with a bare Status: the object is dropped at once (its own watch
    may lag the pods' watch), and a late event of its older version does not bring it back;
    a newer one (it had finalizers and is terminating) does."""
    store = with_jobs(Store())
    cluster = {"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "3",
                            "labels": {names.LABEL_JOB: "j"}}}
    store.put(RAYCLUSTER, cluster)
    store.vanished(RAYCLUSTER, "ns", "j")
    assert store.raycluster("ns", "j") is None and store.sizes() == (2, 0, 0)
    store.put(RAYCLUSTER, cluster)
    assert store.raycluster("ns", "j") is None
    terminating = {"metadata": {**cluster["metadata"], "resourceVersion": "5",
                                "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    store.put(RAYCLUSTER, terminating)
    assert store.raycluster("ns", "j") == terminating


def test_a_child_cached_past_its_deletion_time_makes_the_job_read_fresh() -> None:
    """A terminating driver pod still cached 10 s after its deletion time: its DELETED event
    may have been missed, and the job would wait on it until the safety resync; it is read
    from the API server instead (at most every 10 s while that lasts)."""
    job = _uid({"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "4"}}, "u-j")
    now = [0.0]
    store = Store(clock=lambda: now[0])
    store.put(RLJOB, job)
    driver = pod("driver", "5")
    driver["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"  # at now = 0
    store.put(POD, driver)
    api = _FakeApi(job, [driver], "6")
    rec = _reconciler(api, store, now)
    rec._read("ns", "j")  # the first sight reads fresh
    now[0] = 5.0
    rec._read("ns", "j")
    assert len(api.reads) == 3  # within its grace: the cache is believed
    api.pod_list, api.list_rv = [], "20"  # gone, and its deletion event missed
    now[0] = 11.0
    assert rec._read("ns", "j")[2] == [] and len(api.reads) == 6
    store.put(POD, {**driver, "metadata": {**driver["metadata"], "resourceVersion": "21"}})
    now[0] = 15.0
    rec._read("ns", "j")
    assert len(api.reads) == 6  # not again within 10 s
    now[0] = 200.0
    rec._read("ns", "j")
    assert len(api.reads) == 6  # held up for long: left to the safety resync


def test_a_late_event_does_not_revive_an_object_a_delete_removed_without_showing_it() -> None:
    """A RayCluster delete answered with a bare Status: a KubeRay status update still in
    its watch stream (newer than what the store held) must not bring it back as live; one
    showing it terminating may; its deletion event ends the watch on its UID."""
    from kubernetes import client

    from rljob_operator.kube import Kube

    store = with_jobs(Store())
    cluster = _uid({"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "3",
                                 "labels": {names.LABEL_JOB: "j"}}}, "u-rc")
    store.put(RAYCLUSTER, cluster)
    kube = Kube(client.ApiClient(client.Configuration()), store)

    class Answer:
        data = b'{"kind": "Status", "apiVersion": "v1", "status": "Success"}'
        released = False

        def release_conn(self) -> None:
            self.released = True

    answer = Answer()
    kube._deleted(RAYCLUSTER, "ns", "j", answer)
    assert answer.released and store.raycluster("ns", "j") is None
    late = {**cluster, "metadata": {**cluster["metadata"], "resourceVersion": "4"}}
    store.put(RAYCLUSTER, late)
    assert store.raycluster("ns", "j") is None
    ending = {**cluster, "metadata": {**cluster["metadata"], "resourceVersion": "5",
                                      "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    store.put(RAYCLUSTER, ending)
    assert store.raycluster("ns", "j") == ending
    store.watched(RAYCLUSTER, "DELETED", ending)
    assert store.raycluster("ns", "j") is None


class _FakeCreates:
    """Creates answered from plain values: which exist already, which are in the way."""

    def __init__(self, existing: set[str], in_the_way: str | None = None) -> None:
        self.existing, self.in_the_way = existing, in_the_way
        self.made: list[str] = []
        self.lock = threading.Lock()

    def create(self, obj: Obj, uid: str) -> bool:
        from rljob_operator.kube import ObjectInTheWay
        from rljob_operator.observe import InTheWay

        kind = obj["kind"]
        if kind == self.in_the_way:
            raise ObjectInTheWay(InTheWay(kind, obj["metadata"]["name"], "it has no owner"))
        with self.lock:
            self.made.append(kind)
        return kind not in self.existing

    def sync_configmap(self, obj: Obj, uid: str) -> bool:
        return self.create(obj, uid)


def _support(kube: _FakeCreates, pool: Any) -> Any:
    from rljob_api.spec import RLJobSpec
    from rljob_operator.builders import JobRef
    from rljob_operator.support import Support
    from tests.operator.harness import job_manifest

    body = job_manifest("j", "ns")
    spec = RLJobSpec.model_validate(body["spec"])
    return Support(kube, JobRef("j", "ns", "uid-1234567890"), body,  # type: ignore[arg-type]
                   spec, pool)


def test_support_objects_are_made_together_once_and_an_object_in_the_way_stops_them() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from rljob_operator.kube import ObjectInTheWay

    with ThreadPoolExecutor(4) as pool:
        kube = _FakeCreates(existing=set())
        support = _support(kube, pool)
        assert support.ensure() is True  # the token was made now
        assert support.all_made
        assert support.ensure() is False
        assert sorted(kube.made) == ["ConfigMap", "NetworkPolicy", "PersistentVolumeClaim",
                                     "Role", "RoleBinding", "Secret", "ServiceAccount"]
        kept = _FakeCreates(existing={"Secret"})
        kept_support = _support(kept, pool)
        assert kept_support.ensure() is False  # the job keeps its token
        assert not kept_support.all_made
        claim_there = _support(_FakeCreates(existing={"PersistentVolumeClaim"}), pool)
        assert claim_there.ensure() is True
        assert not claim_there.all_made
        blocked = _FakeCreates(existing=set(), in_the_way="ConfigMap")
        with pytest.raises(ObjectInTheWay):
            _support(blocked, pool).ensure()


def test_a_create_in_a_namespace_being_deleted_is_told_from_other_refusals() -> None:
    from kubernetes.client.exceptions import ApiException

    from rljob_operator.kube import terminating_namespace

    def refusal(status: int, body: str) -> ApiException:
        err = ApiException(status=status, reason="Forbidden")
        err.body = body
        return err

    dying = ('{"kind":"Status","status":"Failure","message":"configmaps \\"j-spec\\" is '
             'forbidden: unable to create new content in namespace t because it is being '
             'terminated","reason":"Forbidden","details":{"name":"j-spec","kind":"configmaps",'
             '"causes":[{"reason":"NamespaceTerminating","message":"namespace t is being '
             'terminated","field":"metadata.namespace"}]},"code":403}')
    assert terminating_namespace(refusal(403, dying))
    rbac = ('{"kind":"Status","status":"Failure","message":"rayclusters.ray.io is forbidden: '
            'User \\"x\\" cannot create resource","reason":"Forbidden","code":403}')
    assert not terminating_namespace(refusal(403, rbac))
    assert not terminating_namespace(refusal(409, dying))


def test_a_checkpoint_claims_modes_are_read_until_found_then_remembered() -> None:
    class Claims(_FakeApi):
        modes: tuple[str, ...] | None = None

        def claim_access_modes(self, namespace: str, name: str) -> tuple[str, ...] | None:
            self.reads.append(f"get claim {name}")
            return self.modes

    api = Claims(None, [], "1")
    rec = _reconciler(api, Store(), [0.0])
    assert rec._claim_modes("ns", "j", "ckpt") is None
    assert rec._claim_modes("ns", "j", "ckpt") is None  # missing: asked again
    api.modes = ("ReadWriteMany",)
    assert rec._claim_modes("ns", "j", "ckpt") == ("ReadWriteMany",)
    assert rec._claim_modes("ns", "j", "ckpt") == ("ReadWriteMany",)
    assert len(api.reads) == 3
    rec._claim_modes("ns", "j", "other")  # the spec names another claim
    rec.forget("ns", "j")
    rec._claim_modes("ns", "j", "other")
    assert len(api.reads) == 5


def test_a_checkpoint_claims_modes_are_read_again_when_the_job_waits_for_pods() -> None:
    """A claim deleted and made again under the same name may have other access modes; pods
    that start mount the new one, so its modes are read again whenever the job's support
    objects are checked (the job starts waiting, then ever less often), never while it
    runs: a claim made again without ReadWriteMany fails the job with the reason instead
    of leaving its pods waiting on a volume they cannot share."""
    from rljob_operator.builders import JobRef

    class Claims(_FakeApi):
        modes: tuple[str, ...] | None = ("ReadWriteMany",)

        def claim_access_modes(self, namespace: str, name: str) -> tuple[str, ...] | None:
            self.reads.append(f"get claim {name}")
            return self.modes

    api = Claims(None, [], "1")
    now = [0.0]
    rec = _reconciler(api, Store(), now)
    ref = JobRef("j", "ns", "u-1")
    assert rec._support_due(ref, 1, waiting=True)  # the job starts
    assert rec._claim_modes("ns", "j", "ckpt") == ("ReadWriteMany",)
    assert not rec._support_due(ref, 1, waiting=False)  # it runs
    api.modes = ("ReadWriteOnce",)  # deleted and made again behind its back
    for t in (20.0, 400.0):
        now[0] = t
        assert rec._claim_modes("ns", "j", "ckpt") == ("ReadWriteMany",)
        assert not rec._support_due(ref, 1, waiting=False)
    assert len(api.reads) == 1  # running: never read again
    assert rec._support_due(ref, 1, waiting=True)  # a restart: pods start again
    assert rec._claim_modes("ns", "j", "ckpt") == ("ReadWriteOnce",)
    assert rec._claim_modes("ns", "j", "ckpt") == ("ReadWriteOnce",)
    assert len(api.reads) == 2  # once per support check


def test_children_of_a_job_not_held_are_not_kept() -> None:
    """A deleted job's children are dropped with it, and their later events (garbage
    collection marking them terminating) do not bring them back: were their deletion events
    missed, they would stay for good."""
    store = with_jobs(Store(), "j")
    store.put(POD, pod("a", "5"))
    store.drop_job(("ns", "j"))
    store.put(POD, pod("a", "6"))
    store.replace_children(POD, ("ns", "j"), [pod("a", "6")], "7")
    assert store.sizes() == (0, 0, 0)
    store.put(POD, pod("b", "5", job="never-seen"))
    assert store.sizes() == (0, 0, 0)


def test_a_node_confirmed_not_ready_that_recovers_is_listed_again() -> None:
    """A NotReady confirmed from etcd is believed only while that list is younger than
    min_age: a node that recovers seconds later is not counted lost for the rest of the
    ttl; and a list that fails leaves nothing believed on its account."""
    now = [0.0]
    ready = {"x": False}
    fail = [False]

    def lister(consistent: bool) -> list[Obj]:
        if fail[0]:
            raise TimeoutError("the API server is busy")
        return [node(n, r) for n, r in ready.items()]

    nodes = NodeCache(lister, ttl=30.0, min_age=2.0, clock=lambda: now[0])
    assert nodes.get(["x"])[0]["status"]["conditions"][0]["status"] == "False"
    ready["x"] = True
    now[0] = 5.0
    assert nodes.get(["x"])[0]["status"]["conditions"][0]["status"] == "True"
    ready["x"] = False
    now[0] = 40.0
    fail[0] = True
    with pytest.raises(TimeoutError):
        nodes.get(["x"])  # the aged list fails: the reconcile fails, nothing is believed
    fail[0] = False
    now[0] = 41.0
    assert nodes.get(["x"])[0]["status"]["conditions"][0]["status"] == "False"


def test_a_failed_fresh_read_is_tried_again_and_a_job_being_deleted_reads_the_cache() -> None:
    job = _uid({"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "4"}}, "u-j")
    now = [0.0]
    store = Store(clock=lambda: now[0])
    store.watched(RLJOB, None, job)

    class Flaky(_FakeApi):
        down = True

        def get_rljob(self, namespace: str, name: str) -> Obj | None:
            self.reads.append("get rljob")
            if self.down:
                raise ConnectionError("the API server restarts")
            return self.job

    api = Flaky(job, [], "6")
    rec = _reconciler(api, store, now)
    with pytest.raises(ConnectionError):
        rec._read("ns", "j")
    api.down = False
    now[0] = 1.0
    rec._read("ns", "j")  # the first sight's read is still due
    assert api.reads == ["get rljob", "get rljob", "list rayclusters", "list pods"]
    # Being deleted (a finalizer holds it): reconciled from the cache, not read each time.
    deleting = {**job, "metadata": {**job["metadata"], "resourceVersion": "5",
                                    "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    store.put(RLJOB, deleting)
    for t in (2.0, 3.0, 4.0):
        now[0] = t
        rec.reconcile("ns", "j")
    assert len(api.reads) == 4


def test_support_objects_are_rechecked_ever_less_often_while_a_job_waits() -> None:
    from rljob_operator.builders import JobRef

    now = [0.0]
    rec = _reconciler(_FakeApi(None, [], "1"), Store(), now)
    ref = JobRef("j", "ns", "u-1")
    checked = []
    for t in range(0, 700):
        now[0] = float(t)
        if rec._support_due(ref, 1, waiting=True):
            checked.append(t)
    assert checked == [0, 10, 30, 70, 150, 310, 610]
    now[0] = 700.0
    assert rec._support_due(ref, 2, waiting=True)  # a spec edit: at once, and 10 s later
    now[0] = 710.0
    assert rec._support_due(ref, 2, waiting=True)
    assert not rec._support_due(ref, 2, waiting=False)  # running: nothing to check
    assert rec._support_due(ref, 2, waiting=True)  # waiting again (a restart): at once


def test_support_objects_all_made_by_the_job_are_rechecked_only_at_the_longest_interval() -> None:
    from rljob_operator.builders import JobRef
    from rljob_operator.support import SUPPORT_RECHECK_MAX_SECONDS

    now = [0.0]
    rec = _reconciler(_FakeApi(None, [], "1"), Store(), now)
    ref = JobRef("j", "ns", "u-1")
    assert rec._support_due(ref, 1, waiting=True)
    rec._support_made(ref, 1)  # every create made its object
    checked = []
    for t in range(1, 700):
        now[0] = float(t)
        if rec._support_due(ref, 1, waiting=True):
            checked.append(t)
    # One deleted behind its back is still made again, within the longest interval.
    assert checked == [int(SUPPORT_RECHECK_MAX_SECONDS), int(2 * SUPPORT_RECHECK_MAX_SECONDS)]
    assert rec._support_due(ref, 2, waiting=True)  # a spec edit checks them at once
    now[0] = 710.0
    assert rec._support_due(ref, 2, waiting=True)  # and, one having existed, 10 s later
    rec._support_made(ref, 2)
    assert not rec._support_due(ref, 2, waiting=False)  # it runs
    assert rec._support_due(ref, 2, waiting=True)  # waiting again after running: at once


class _MiniApi:
    """An API server in miniature for `Reconciler.reconcile`: the job, the objects the
    operator creates (by kind and name), and every create it sends, made or not."""

    def __init__(self, job: Obj, cache: Store) -> None:
        self.job = job
        self.cache = cache  # told of the writes, as Kube tells it
        self.objects: dict[tuple[str, str], Obj] = {}
        self.creates: list[str] = []
        self.events: list[str] = []

    def get_rljob(self, namespace: str, name: str) -> Obj | None:
        return self.job

    def list_rayclusters(self, namespace: str, job: str) -> tuple[list[Obj], str]:
        return [o for (kind, _n), o in self.objects.items() if kind == "RayCluster"], "1"

    def list_pods(self, namespace: str, job: str) -> tuple[list[Obj], str]:
        return [], "1"

    def get_child(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self.objects.get((kind, name))

    def list_nodes(self, consistent: bool = False) -> list[Obj]:
        return []

    def create(self, obj: Obj, uid: str) -> bool:
        key = (obj["kind"], obj["metadata"]["name"])
        self.creates.append(obj["kind"])
        if key in self.objects:
            return False
        made = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "2",
                                    "uid": f"uid-{key[1]}"}}
        self.objects[key] = made
        if obj["kind"] == "RayCluster":
            self.cache.put(RAYCLUSTER, made)
        return True

    def sync_configmap(self, obj: Obj, uid: str) -> bool:
        return self.create(obj, uid)

    def apply_status(self, namespace: str, name: str, status: Obj) -> None:
        meta = self.job["metadata"]
        self.job = {**self.job, "status": status,
                    "metadata": {**meta, "resourceVersion": str(int(meta["resourceVersion"]) + 1)}}
        self.cache.put(RLJOB, self.job)

    def post_event(self, job: Obj, event: Any) -> None:
        self.events.append(event.reason)

    def delete_pod(self, namespace: str, name: str, force: bool = False,
                   grace_s: int | None = None) -> None:
        self.creates.append(f"delete pod {name}")

    def delete_raycluster(self, namespace: str, name: str) -> None:
        self.creates.append(f"delete RayCluster {name}")
        if self.objects.pop(("RayCluster", name), None) is not None:
            self.cache.vanished(RAYCLUSTER, namespace, name)


def _mini_job(cache: Store) -> _MiniApi:
    """A new RLJob (job_manifest's small job) as the API server returns it."""
    from tests.operator.harness import job_manifest

    body = job_manifest("j", "pool")
    body["metadata"] = {"name": "j", "namespace": "ns", "uid": "u-j", "generation": 1,
                        "resourceVersion": "1", "creationTimestamp": "2026-01-01T00:00:00Z"}
    return _MiniApi(body, cache)


def _mini_job_reconciled() -> tuple[_MiniApi, list[float], Any]:
    """`_mini_job` after its first reconcile at time 0 (a support check, the RayCluster made),
    with the reconciler and the clock its tests move."""
    now = [0.0]
    store = Store(clock=lambda: now[0])
    api = _mini_job(store)
    rec = _reconciler(api, store, now)  # type: ignore[arg-type]
    rec.reconcile("ns", "j")
    return api, now, rec


def test_a_support_object_deleted_while_the_job_waits_is_made_again_by_a_later_reconcile() -> None:
    """Through `reconcile()`: the first reconcile makes the job's seven support objects and its
    RayCluster; while its pods wait, the next ones send no creates until the longest recheck
    interval, when the ConfigMap deleted behind the job's back is made again."""
    from rljob_operator.support import SUPPORT_RECHECK_MAX_SECONDS

    api, now, rec = _mini_job_reconciled()
    assert sorted(api.creates) == ["ConfigMap", "NetworkPolicy", "PersistentVolumeClaim",
                                   "RayCluster", "Role", "RoleBinding", "Secret",
                                   "ServiceAccount"]
    assert api.job["status"]["phase"] == "Pending"
    spec = next(key for key in api.objects if key[0] == "ConfigMap")
    del api.objects[spec]  # deleted behind the job's back
    api.creates.clear()
    for t in (10.0, 30.0, 70.0, 150.0, SUPPORT_RECHECK_MAX_SECONDS - 1):
        now[0] = t
        rec.reconcile("ns", "j")
    assert api.creates == []
    now[0] = SUPPORT_RECHECK_MAX_SECONDS
    rec.reconcile("ns", "j")
    assert spec in api.objects
    assert "RayCluster" not in api.creates  # it exists and is cached: not sent again


def test_while_one_reconcile_lists_the_nodes_the_others_take_the_list_held() -> None:
    """A list of thousands of nodes takes a while: a job whose nodes are all Ready in the list
    held does not wait for it; one using a node the held list lacks waits for the new one."""
    release = threading.Event()
    listing = threading.Event()
    cluster = {"n1"}

    def lister(consistent: bool) -> list[Obj]:
        if len(cluster) > 1:  # the second list: held until released
            listing.set()
            assert release.wait(10)
        return [node(n) for n in sorted(cluster)]

    nodes = NodeCache(lister, ttl=0.0, min_age=0.0)
    assert [n["metadata"]["name"] for n in nodes.get(["n1"])] == ["n1"]
    cluster.add("n2")
    slow: list[list[Obj]] = []
    reader = threading.Thread(target=lambda: slow.append(nodes.get(["n1"])))
    reader.start()
    assert listing.wait(10)
    assert [n["metadata"]["name"] for n in nodes.get(["n1"], hurry=True)] == ["n1"]  # at once
    waiter: list[list[Obj]] = []
    new_node = threading.Thread(target=lambda: waiter.append(nodes.get(["n2"])))
    new_node.start()
    new_node.join(0.5)
    assert new_node.is_alive()  # n2 is not in the list held: it waits for the read
    release.set()
    reader.join(10)
    new_node.join(10)
    assert [n["metadata"]["name"] for n in waiter[0]] == ["n2"] and slow


def test_a_node_not_ready_in_the_list_held_waits_for_the_list_being_read() -> None:
    """Whether that node is lost is decided on a new list only: a reconcile using it waits for
    the read in progress and gets the node as that list shows it."""
    release = threading.Event()
    listing = threading.Event()
    ready = {"n1": False}
    calls = [0]

    def lister(consistent: bool) -> list[Obj]:
        calls[0] += 1
        if calls[0] == 3:  # the reader's list: held until released
            listing.set()
            assert release.wait(10)
        return [node(n, r) for n, r in ready.items()]

    nodes = NodeCache(lister, ttl=0.0, min_age=0.0)
    nodes.get(["n1"])  # a list, then (n1 not Ready) one from etcd
    ready["n1"] = True
    reader = threading.Thread(target=lambda: nodes.get([]))
    reader.start()
    assert listing.wait(10)
    got: list[list[Obj]] = []
    user = threading.Thread(target=lambda: got.append(nodes.get(["n1"])))
    user.start()
    release.set()
    user.join(10)
    reader.join(10)
    assert got[0][0]["status"]["conditions"][0]["status"] == "True"  # from the new list


def test_a_raycluster_made_again_soon_after_a_check_sends_no_support_creates() -> None:
    """Within SUPPORT_RECHECK_SECONDS of a check, a RayCluster (or driver) is made without a
    round of creates of its own; later, the round goes out first."""
    from rljob_operator.support import SUPPORT_RECHECK_SECONDS

    api, now, rec = _mini_job_reconciled()
    cluster = next(key for key in api.objects if key[0] == "RayCluster")
    for t, creates in ((SUPPORT_RECHECK_SECONDS / 2, ["RayCluster"]),
                       (3 * SUPPORT_RECHECK_SECONDS, ["ConfigMap", "NetworkPolicy",
                                                      "PersistentVolumeClaim", "RayCluster",
                                                      "Role", "RoleBinding", "Secret",
                                                      "ServiceAccount"])):
        del api.objects[cluster]  # gone (say, deleted for a restart)
        api.cache.vanished(RAYCLUSTER, "ns", cluster[1])
        api.creates.clear()
        now[0] = t
        rec.reconcile("ns", "j")
        assert sorted(api.creates) == creates


def test_a_due_check_that_fails_does_not_hold_up_stopping_the_driver() -> None:
    """The support objects' check goes after the reconcile's deletions: an API server too busy
    for the check still gets the failed attempt's driver deletion first."""
    from rljob_operator.builders import JobRef
    from rljob_operator.decision import Actions
    from rljob_operator.situation import parse_job

    store = Store()
    api = _mini_job(store)
    body = api.job
    rec = _reconciler(api, store, [0.0])  # type: ignore[arg-type]

    class Busy:
        def ensure(self) -> bool:
            raise ConnectionError("the API server is busy")

    with pytest.raises(ConnectionError):
        rec._act(JobRef.of(body), body, parse_job(body), Actions(delete_driver=True), 1,
                 Busy(), check=True, cluster_present=True)
    assert api.creates == ["delete pod j-driver"]


def test_a_token_made_anew_before_a_driver_recreates_the_raycluster_instead() -> None:
    """A driver is about to be made while a support object is gone (deleted behind the job's
    back after the last check). Without a check in the last SUPPORT_RECHECK_SECONDS the round
    of creates goes out first and makes it again. If it was the Ray token Secret, the new
    token is one the running RayCluster's pods do not have, so no driver is made with it:
    the driver and the RayCluster go instead (RayTokenReplaced), for the next reconcile to
    make anew. Any other support object made again does not stop the driver; within the
    window after a check, the driver is made with no round of creates at all."""
    from rljob_operator.builders import JobRef
    from rljob_operator.decision import Actions
    from rljob_operator.situation import parse_job
    from rljob_operator.support import SUPPORT_RECHECK_SECONDS, Support

    def attempt(deleted: str, at: float) -> tuple[_MiniApi, bool, list[str]]:
        api, now, rec = _mini_job_reconciled()
        gone = next(key for key in api.objects if key[0] == deleted)
        del api.objects[gone]
        api.creates.clear()
        now[0] = at
        body, ref = api.job, JobRef.of(api.job)
        job = parse_job(body)
        assert job.spec is not None
        again = rec._act(ref, body, job, Actions(create_driver=()), 0,
                         Support(api, ref, body, job.spec, rec._pool),  # type: ignore[arg-type]
                         check=False, cluster_present=True)
        return api, again, [kind for kind, _ in api.objects]

    later = 3 * SUPPORT_RECHECK_SECONDS
    api, again, kinds = attempt("Secret", later)
    assert again and "Secret" in kinds  # the token made anew by the round of creates
    assert "Pod" not in api.creates and "RayTokenReplaced" in api.events
    assert sorted(c for c in api.creates if c.startswith("delete")) == [
        "delete RayCluster j", "delete pod j-driver"]

    api, again, kinds = attempt("ConfigMap", later)
    assert not again and "ConfigMap" in kinds and "Pod" in kinds
    assert "RayTokenReplaced" not in api.events and "RayCluster" in kinds

    api, again, kinds = attempt("Secret", SUPPORT_RECHECK_SECONDS / 2)
    assert not again and api.creates == ["Pod"]  # no round of creates: the next check makes it
    assert "Secret" not in kinds
