"""The operator's copy of a job's Workload (`workloads.Workloads`): found by Kueue's job-uid
label after a restart, never replaced by a late event of an earlier Workload, read again
after a refused write, and one Workload kept when a job has two. Against an in-memory
Workloads API that answers as the API server does (404, 409 on a stale resourceVersion)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rljob_api.spec import RLJobSpec
from rljob_operator import kueue
from rljob_operator.admission import WorkloadStep
from rljob_operator.builders import JobRef
from rljob_operator.kueue import QueueState
from rljob_operator.workloads import Workloads
from tests.operator.test_decide import SPEC

pytestmark = pytest.mark.unit
Obj = dict[str, Any]
REF = JobRef("rl", "ns", "u")
JOB: Obj = {"metadata": {"name": "rl", "namespace": "ns", "uid": "u", "labels": {}}}


class _Resp:
    def __init__(self, body: Obj) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


class _Api:
    """Workloads by name, as the API server keeps them."""

    def __init__(self, *items: Obj) -> None:
        self.items = {w["metadata"]["name"]: w for w in items}
        self.calls: list[tuple[str, str]] = []
        self.version = 100

    def list_namespaced_custom_object(self, group: str, version: str, namespace: str,
                                      plural: str, label_selector: str, **_: Any) -> _Resp:
        self.calls.append(("list", label_selector))
        key, value = label_selector.split("=")
        return _Resp({"items": [w for w in self.items.values()
                                if w["metadata"]["labels"].get(key) == value]})

    def patch_namespaced_custom_object(self, group: str, version: str, namespace: str,
                                       plural: str, name: str, patch: Obj, **_: Any) -> _Resp:
        self.calls.append(("patch", name))
        stored = self.items.get(name)
        if stored is None:
            raise ApiException(status=404)
        meta = stored["metadata"]
        if patch["metadata"].get("resourceVersion") not in (None, meta["resourceVersion"]):
            raise ApiException(status=409)
        if "finalizers" in patch["metadata"]:
            meta["finalizers"] = patch["metadata"]["finalizers"]
        stored.setdefault("spec", {}).update(patch.get("spec") or {})
        self.version += 1
        meta["resourceVersion"] = str(self.version)
        return _Resp(stored)

    def delete_namespaced_custom_object(self, group: str, version: str, namespace: str,
                                        plural: str, name: str,
                                        body: client.V1DeleteOptions | None = None,
                                        **_: Any) -> None:
        self.calls.append(("delete", name))
        stored = self.items.get(name)
        if stored is None:
            raise ApiException(status=404)
        wanted = body.preconditions.resource_version if body and body.preconditions else None
        if wanted not in (None, stored["metadata"]["resourceVersion"]):
            raise ApiException(status=409)
        del self.items[name]

    def create_namespaced_custom_object(self, group: str, version: str, namespace: str,
                                        plural: str, body: Obj, **_: Any) -> _Resp:
        self.calls.append(("create", body["metadata"]["generateName"]))
        made = json.loads(json.dumps(body))
        made["metadata"].update(name=body["metadata"]["generateName"] + "made",
                                uid="uid-made", resourceVersion="1",
                                creationTimestamp="2026-01-01T11:00:00Z")
        self.items[made["metadata"]["name"]] = made
        return _Resp(made)

    def get_cluster_custom_object(self, group: str, version: str, plural: str, name: str,
                                  **_: Any) -> _Resp:
        return _Resp({"metadata": {"name": name}, "spec": {}})

    def lists(self) -> int:
        return sum(1 for call, _ in self.calls if call == "list")


def workload(name: str, made: str, uid: str | None = None, reserved: bool = False,
             deleting: bool = False, job_uid: str = "u") -> Obj:
    meta: Obj = {"name": name, "namespace": "ns", "uid": uid or f"uid-{name}",
                 "resourceVersion": "1", "creationTimestamp": made,
                 "labels": {kueue.LABEL_JOB_UID: job_uid},
                 "finalizers": [kueue.FINALIZER],
                 "ownerReferences": [{"kind": "RLJob", "name": "rl", "uid": job_uid,
                                      "controller": True}]}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    status: Obj = {"conditions": []}
    if reserved:
        status = {"conditions": [
            {"type": t, "status": "True", "reason": t} for t in ("QuotaReserved", "Admitted")],
            "admission": {"clusterQueue": "cq", "podSetAssignments": []}}
    return {"metadata": meta, "spec": {"queueName": "team", "podSets": []}, "status": status}


def _workloads(api: _Api, clock: list[float] | None = None) -> Workloads:
    now = clock if clock is not None else [0.0]
    w = Workloads(client.ApiClient(), monotonic=lambda: now[0])
    w.custom = api  # type: ignore[assignment]
    return w


def _name(w: Workloads) -> str | None:
    state = w.state(REF, JOB, "team", None)
    return state.workload.name if state and state.workload else None


def test_an_operator_that_starts_again_finds_the_jobs_workload_by_its_label() -> None:
    """With nothing watched yet, the job's Workload is listed (not made again), then held;
    one that wears the job's label but that the job does not control is not the job's."""
    foreign = workload("rljob-rl-abcde-f", "2026-01-01T09:00:00Z", reserved=True)
    foreign["metadata"]["ownerReferences"] = [{"kind": "RLJob", "name": "rl", "uid": "u"}]
    api = _Api(foreign, workload("rljob-rl-abcde-x1", "2026-01-01T10:00:00Z", reserved=True),
               workload("rljob-other", "2026-01-01T10:00:00Z", job_uid="another-job"))
    w = _workloads(api)
    assert _name(w) == "rljob-rl-abcde-x1"
    assert _name(w) == "rljob-rl-abcde-x1" and api.lists() == 1  # the copy held after
    assert "rljob-rl-abcde-f" in api.items  # not the job's to delete either


def test_of_two_live_workloads_the_one_holding_quota_stays_and_the_other_goes() -> None:
    pending = workload("rljob-rl-abcde-old", "2026-01-01T10:00:00Z")
    holding = workload("rljob-rl-abcde-new", "2026-01-01T10:05:00Z", reserved=True)
    api = _Api(pending, holding)
    assert _name(_workloads(api)) == "rljob-rl-abcde-new"
    assert list(api.items) == ["rljob-rl-abcde-new"]
    assert api.calls[-2:] == [("patch", "rljob-rl-abcde-old"), ("delete", "rljob-rl-abcde-old")]
    # Neither holds quota: the older stays.
    api = _Api(workload("rljob-rl-abcde-a", "2026-01-01T10:00:00Z"),
               workload("rljob-rl-abcde-b", "2026-01-01T10:05:00Z"))
    assert _name(_workloads(api)) == "rljob-rl-abcde-a" and list(api.items) == [
        "rljob-rl-abcde-a"]


def test_a_second_workload_that_changed_since_it_was_listed_is_not_deleted() -> None:
    """Another operator's Workload that gained quota between the list and the delete stays
    (the delete is made only for the version listed) and is judged on the next read."""
    api = _Api(workload("rljob-rl-abcde-a", "2026-01-01T10:00:00Z"),
               workload("rljob-rl-abcde-b", "2026-01-01T10:05:00Z"))
    b = api.items["rljob-rl-abcde-b"]
    real_patch = api.patch_namespaced_custom_object

    def patch_then_admitted(*args: Any, **kwargs: Any) -> _Resp:
        done = real_patch(*args, **kwargs)
        b["metadata"]["resourceVersion"] = "999"  # Kueue admitted it meanwhile
        return done

    api.patch_namespaced_custom_object = patch_then_admitted  # type: ignore[method-assign]
    assert _name(_workloads(api)) == "rljob-rl-abcde-a"
    assert set(api.items) == {"rljob-rl-abcde-a", "rljob-rl-abcde-b"}
    assert api.calls[-1] == ("delete", "rljob-rl-abcde-b")  # refused: 409


def test_a_workload_being_deleted_is_read_only_when_no_live_one_is_left() -> None:
    going = workload("rljob-rl-abcde-gone", "2026-01-01T10:00:00Z", deleting=True)
    api = _Api(going)
    assert _name(_workloads(api)) == "rljob-rl-abcde-gone"
    api = _Api(going, workload("rljob-rl-abcde-next", "2026-01-01T09:00:00Z"))
    assert _name(_workloads(api)) == "rljob-rl-abcde-next"
    assert "rljob-rl-abcde-gone" in api.items  # not the operator's to delete


def test_late_events_of_an_earlier_workload_never_hide_the_current_one() -> None:
    old = workload("rljob-rl-abcde-old", "2026-01-01T10:00:00Z", reserved=True)
    new = workload("rljob-rl-abcde-new", "2026-01-01T10:05:00Z")
    api = _Api(new)
    w = _workloads(api)
    key = ("ns", "rl")
    w.watched(key, new, deleted=False)
    # The old one's last events, delivered late: its deletion begun, then done.
    w.watched(key, {**old, "metadata": {**old["metadata"], "deletionTimestamp": "t"}}, False)
    w.watched(key, old, deleted=True)
    assert _name(w) == "rljob-rl-abcde-new" and api.lists() == 0
    # An event of it after its deletion (delivered out of turn) never brings it back, even
    # once nothing is held.
    w.forget(key)
    w.watched(key, old, deleted=False)
    assert _name(w) == "rljob-rl-abcde-new" and api.lists() == 1
    # A second live one: the copy is read again, and of the two the older stays.
    twin = workload("rljob-rl-abcde-twin", "2026-01-01T10:10:00Z")
    api.items["rljob-rl-abcde-twin"] = twin
    w.watched(key, twin, deleted=False)
    assert _name(w) == "rljob-rl-abcde-new" and api.lists() == 2
    assert list(api.items) == ["rljob-rl-abcde-new"]
    # An older copy of the one held (a create's answer after the watch's newer event) never
    # replaces it.
    newer = {**new, "metadata": {**new["metadata"], "resourceVersion": "50"}}
    w.watched(key, newer, deleted=False)
    w.watched(key, new, deleted=False)
    state = w.state(REF, JOB, "team", None)
    assert state is not None and state.workload is not None
    assert state.workload.resource_version == "50"


def test_a_refused_write_or_a_deletion_makes_the_next_reconcile_read() -> None:
    stale = workload("rljob-rl-abcde-x1", "2026-01-01T10:00:00Z", reserved=True)
    api = _Api(stale)
    w = _workloads(api)
    state = w.state(REF, JOB, "team", None)
    assert state is not None and state.workload is not None and api.lists() == 1
    api.items["rljob-rl-abcde-x1"]["metadata"]["resourceVersion"] = "7"  # changed since
    w.apply(WorkloadStep.deactivate, state, REF, "2026-01-01T12:00:00Z", 1)
    assert api.calls[-1] == ("patch", "rljob-rl-abcde-x1")  # refused: 409
    assert api.items["rljob-rl-abcde-x1"]["spec"].get("active") is None
    assert _name(w) == "rljob-rl-abcde-x1" and api.lists() == 2
    # Dropped with a stale copy: the finalizer is not removed, so it is not deleted either.
    w.apply(WorkloadStep.drop, state, REF, "2026-01-01T12:00:00Z", 1)
    assert "rljob-rl-abcde-x1" in api.items and api.calls[-1][0] == "patch"
    state = w.state(REF, JOB, "team", None)
    assert state is not None
    w.apply(WorkloadStep.drop, state, REF, "2026-01-01T12:00:00Z", 1)
    assert api.items == {} and _name(w) is None and api.lists() == 4


def test_a_job_made_and_let_go() -> None:
    """A Workload made is held at once (no read); a deleting job's Workloads lose Kueue's
    finalizer, and only theirs."""
    api = _Api()
    w = _workloads(api)
    want = kueue.build_workload(REF, RLJobSpec.model_validate(SPEC), "team", None)
    w.apply(WorkloadStep.create, QueueState("team", True, None, want), REF, "t", 1)
    (made,) = api.items
    assert made.startswith("rljob-rl-") and _name(w) == made and api.lists() == 0
    other = workload("rljob-x-00000-a", "2026-01-01T10:00:00Z", job_uid="another-job")
    api.items[other["metadata"]["name"]] = other
    w.let_go(REF)
    assert api.items[made]["metadata"]["finalizers"] == []
    assert other["metadata"]["finalizers"] == [kueue.FINALIZER]


def test_a_queue_name_kueue_refuses_gets_no_workload_and_says_why() -> None:
    api = _Api()
    body = {"metadata": {**JOB["metadata"], "labels": {kueue.LABEL_QUEUE: "Team_A"}}}
    state = _workloads(api).state(REF, body, "Team_A", RLJobSpec.model_validate(SPEC))
    assert state is not None and state.want is None and state.problem is not None
    assert state.problem[0] == "InvalidQueueName"
    assert "metadata.labels[kueue.x-k8s.io/queue-name]: is 'Team_A'" in state.problem[1]


def test_a_copy_older_than_its_time_to_live_is_read_again() -> None:
    clock = [0.0]
    api = _Api(workload("rljob-rl-abcde-x1", "2026-01-01T10:00:00Z"))
    w = _workloads(api, clock)
    assert _name(w) == "rljob-rl-abcde-x1" and api.lists() == 1
    clock[0] = 301.0
    api.items.clear()  # deleted in a watch gap
    assert _name(w) is None and api.lists() == 2
