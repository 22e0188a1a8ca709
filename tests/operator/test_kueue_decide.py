"""Pure Kueue decisions: a queued job's Workload (what it asks for), its phase while Kueue
holds it, preempts or admits it, and the one change to its Workload each reconcile makes."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

from rljob_api.spec import RLJobSpec
from rljob_operator import kueue
from rljob_operator.builders import JobRef, build_raycluster
from rljob_operator.decision import Decision
from rljob_operator.kueue import QueueState, parse_workload
from rljob_operator.observe import observe
from rljob_operator.phases import decide
from rljob_operator.situation import parse_job
from tests.operator.test_decide import READY_NODE, SPEC, T0, built, compute, conditions, driver

pytestmark = pytest.mark.unit
Obj = dict[str, Any]
REF = JobRef("rl", "ns", "u")


def queued_job(status: Obj | None = None, spec: Obj | None = None,
               labels: Obj | None = None) -> Obj:
    return {"metadata": {"name": "rl", "namespace": "ns", "uid": "u", "generation": 1,
                         "labels": {kueue.LABEL_QUEUE: "team"} if labels is None else labels},
            "spec": spec if spec is not None else SPEC, "status": status or {}}


def want(spec: Obj | None = None) -> Obj:
    return kueue.build_workload(REF, RLJobSpec.model_validate(spec or SPEC), "team", None)


def cond(type_: str, status: str, reason: str = "R", message: str = "") -> Obj:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T11:00:00Z"}


def stored(*conds: Obj, deleting: bool = False, spec: Obj | None = None,
           active: bool = True, ours: bool = True) -> Obj:
    wl = want(spec)
    wl["metadata"]["name"] = wl["metadata"]["generateName"] + "x7k2p"  # as the API server names it
    wl["metadata"]["resourceVersion"] = "7"
    wl["spec"]["active"] = active
    if not active and ours:
        wl["metadata"]["annotations"][kueue.ANNOTATION_SUSPENDED] = "true"
    if deleting:
        wl["metadata"]["deletionTimestamp"] = "2026-01-01T11:00:00Z"
    wl["status"] = {"conditions": list(conds)}
    if any(c["type"] == "QuotaReserved" and c["status"] == "True" for c in conds):
        wl["status"]["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
            {"name": s["name"], "flavors": {"nvidia.com/gpu": "gpu"}}
            for s in wl["spec"]["podSets"]]}
    return wl


ADMITTED = (cond("QuotaReserved", "True", "QuotaReserved"), cond("Admitted", "True", "Admitted"))
READY = (*ADMITTED, cond("PodsReady", "True", "Started"))


def run(body: Obj, workload: Obj | None, pods: list[Obj] | None = None,
        cluster: bool = False, enabled: bool = True, queue: str | None = "team",
        problem: tuple[str, str] | None = None) -> Decision:
    rc = {"metadata": {"name": "rl"}} if cluster else None
    pods, rc = built(body, pods or [], rc)
    obs = observe("rl", rc, pods, [READY_NODE], None, now=T0, node_lost_after=0.0)
    job = parse_job(body)
    assert job.queue == queue, job.spec_error
    view = parse_workload(workload) if workload is not None else None
    wanted = want(body["spec"]) if queue is not None else None
    obs = replace(obs, queue=QueueState(queue, enabled, view, wanted, problem=problem))
    return decide(job, obs, T0)


def test_the_workload_covers_every_pod_with_its_real_requests() -> None:
    wl = want()
    sets = {s["name"]: s for s in wl["spec"]["podSets"]}
    assert {k: s["count"] for k, s in sets.items()} == {
        "head": 1, "trainer": 1, "rollout": 2, "driver": 1}

    def gpus(name: str) -> int:
        return sum(int(c["resources"].get("requests", {}).get("nvidia.com/gpu", 0))
                   for c in sets[name]["template"]["spec"]["containers"])

    assert (gpus("trainer"), gpus("rollout"), gpus("head"), gpus("driver")) == (2, 1, 0, 0)
    # What KubeRay adds to every worker pod counts too: its wait-gcs-ready init container.
    for name in ("trainer", "rollout"):
        (init,) = sets[name]["template"]["spec"]["initContainers"]
        assert init["resources"]["requests"] == {"cpu": "200m", "memory": "256Mi"}
    assert "initContainers" not in sets["head"]["template"]["spec"]
    # The driver's status writer (a native sidecar) takes quota too.
    assert sets["driver"]["template"]["spec"]["initContainers"][0]["resources"]
    meta = wl["metadata"]
    assert meta["finalizers"] == [kueue.FINALIZER]
    assert meta["ownerReferences"][0]["controller"] is True
    # Kueue's shape, `rljob-<job>-<5 hex>-`, and a suffix the API server adds to each.
    assert "name" not in meta and re.fullmatch(r"rljob-rl-[0-9a-f]{5}-", meta["generateName"])
    assert meta["labels"] == {kueue.LABEL_JOB_UID: "u"}
    long = kueue.workload_prefix("j" * 53, "u")  # the longest job name the API server takes
    assert len(long) == 58 and re.fullmatch(r"rljob-j{45}-[0-9a-f]{5}-", long)
    assert wl["spec"]["queueName"] == "team" and "priority" not in wl["spec"]


def test_a_job_without_a_queue_is_not_gated() -> None:
    body = queued_job(labels={})
    assert parse_job(body).queue is None
    d = decide(parse_job(body), observe("rl", None, [], [READY_NODE], None, now=T0), T0)
    assert d.phase == "Pending" and d.actions.create_cluster and d.actions.workload is None


def test_a_new_queued_job_makes_only_its_workload() -> None:
    d = run(queued_job(), None)
    assert d.phase == "Queued"
    assert not d.actions.create_cluster and d.actions.create_driver is None
    assert d.actions.workload == "create"
    assert conditions(d)["Queued"]["reason"] == "WorkloadPending"


def test_a_pending_workload_shows_kueues_reason() -> None:
    d = run(queued_job(), stored(cond("QuotaReserved", "False", "Pending",
                                      "insufficient quota for nvidia.com/gpu")))
    assert d.phase == "Queued" and not d.actions.create_cluster
    c = conditions(d)["Queued"]
    assert c["reason"] == "Pending" and "insufficient quota" in c["message"]
    assert d.actions.workload is None


def test_an_admitted_job_starts_and_says_who_admitted_it() -> None:
    d = run(queued_job(), stored(*ADMITTED))
    assert d.phase == "Pending" and d.actions.create_cluster
    assert conditions(d)["Admitted"]["message"].endswith("ClusterQueue cq")
    assert d.actions.workload is None


def test_the_quota_stays_held_while_pods_of_a_deleted_raycluster_terminate() -> None:
    """The RayCluster is gone (deleted in the background) but its pods still terminate:
    they are no compute pods of the job any more, yet they still hold what they asked."""
    evicted = stored(*ADMITTED, cond("Evicted", "True", "Preempted", "by high"))
    body = queued_job({"phase": "Preempted"})
    left = [{**p, "metadata": {**p["metadata"], "ownerReferences": [
        {"kind": "RayCluster", "uid": "deleted-cluster", "controller": True}]}}
        for p in compute()]
    obs = observe("rl", None, left, [READY_NODE], None, uid="u", now=T0)
    assert obs.compute == () and obs.pods_left == 4
    job = parse_job(body)
    obs = replace(obs, queue=QueueState("team", True, parse_workload(evicted), want()))
    assert decide(job, obs, T0).actions.workload is None
    gone = replace(obs, pods_left=0)
    assert decide(job, gone, T0).actions.workload == "release"


def test_eviction_stops_the_driver_first_then_gives_the_quota_back() -> None:
    evicted = stored(*ADMITTED, cond("Evicted", "True", "Preempted", "by high"),
                     cond("Preempted", "True", "InClusterQueue", "by high"))
    running = queued_job({"phase": "Running"})
    d = run(running, evicted, [*compute(), driver()], cluster=True)
    assert d.phase == "Preempted"
    assert d.actions.delete_driver and not d.actions.delete_cluster
    assert d.actions.workload is None  # pods still run: the quota stays held
    assert conditions(d)["Preempted"]["message"].startswith("Kueue evicted")
    assert d.event is not None and d.event.reason == "Preempted"
    # The driver is gone: the cluster goes.
    d = run(running, evicted, compute(), cluster=True)
    assert d.actions.delete_cluster and d.actions.workload is None
    # Nothing left: the quota goes back.
    d = run(running, evicted)
    assert d.actions.workload == "release"
    patch = kueue.release_patch(parse_workload(evicted), "2026-01-01T12:00:00Z", 1)
    got = {c["type"]: c for c in patch["status"]["conditions"]}
    assert patch["status"]["admission"] is None
    assert (got["QuotaReserved"]["status"], got["QuotaReserved"]["reason"]) == (
        "False", "Pending")
    assert (got["Admitted"]["status"], got["Requeued"]["status"]) == ("False", "True")
    assert patch["metadata"]["resourceVersion"] == "7"


def test_after_the_release_the_job_reads_queued_with_the_eviction_reason() -> None:
    released = stored(cond("QuotaReserved", "False", "Pending"), cond("Evicted", "True",
                                                                      "Preempted", "by high"))
    d = run(queued_job({"phase": "Preempted"}), released)
    assert d.phase == "Queued" and conditions(d)["Queued"]["reason"] == "Preempted"
    assert d.actions.workload is None


def test_a_spec_change_requeues_an_admitted_job_and_updates_a_waiting_workload() -> None:
    bigger = {**SPEC, "rollout": {"engines": 4, "gpusPerEngine": 1}}
    waiting = stored(cond("QuotaReserved", "False", "Pending"))
    assert run(queued_job(spec=bigger), waiting).actions.workload == "update"
    d = run(queued_job({"phase": "Running"}, spec=bigger), stored(*ADMITTED),
            [*compute(), driver()], cluster=True)
    assert d.phase == "Queued" and conditions(d)["Queued"]["reason"] == "SpecChanged"
    assert d.actions.delete_driver and d.actions.workload is None
    assert run(queued_job(spec=bigger), stored(*ADMITTED)).actions.workload == "drop"


def test_suspend_deactivates_the_workload_and_resume_activates_only_its_own() -> None:
    suspended = {**SPEC, "scheduling": {"suspend": True}}
    d = run(queued_job(spec=suspended), stored(*ADMITTED))
    assert d.phase == "Suspended" and d.actions.workload == "deactivate"
    assert "Admitted" not in conditions(d)
    waiting = cond("QuotaReserved", "False", "Pending")
    d = run(queued_job(), stored(waiting, active=False))
    assert d.actions.workload == "activate"
    # Deactivated by Kueue (its requeuing limit) or by hand: left so, and said.
    d = run(queued_job(), stored(waiting, active=False, ours=False))
    assert d.actions.workload is None and conditions(d)["Queued"]["reason"] == "Inactive"
    # Created suspended: made inactive, so it can never be admitted (nor preempt) first.
    made = kueue.build_workload(REF, RLJobSpec.model_validate(suspended), "team", None)
    assert made["spec"]["active"] is False
    assert made["metadata"]["annotations"][kueue.ANNOTATION_SUSPENDED] == "true"


def test_an_ended_job_finishes_its_workload_once_its_pods_are_gone_then_lets_it_go() -> None:
    done = {"phase": "Succeeded", "finishedAt": "2026-01-01T12:00:00Z",
            "conditions": [cond("Succeeded", "True", "DriverSucceeded")]}
    d = run(queued_job(done), stored(*ADMITTED), compute(), cluster=True)
    assert d.actions.delete_cluster and d.actions.workload is None
    assert run(queued_job(done), stored(*ADMITTED)).actions.workload == "finish"
    finished = stored(*ADMITTED, cond("Finished", "True", "Succeeded"))
    assert run(queued_job(done), finished).actions.workload == "unhold"


def test_a_deleted_workload_is_let_go_once_the_pods_are_gone() -> None:
    gone = stored(*ADMITTED, deleting=True)
    d = run(queued_job({"phase": "Running"}), gone, [*compute(), driver()], cluster=True)
    assert d.phase == "Queued" and d.actions.delete_driver and d.actions.workload is None
    assert run(queued_job(), gone).actions.workload == "unhold"


def test_a_queue_in_label_and_field_must_agree_and_an_ended_job_gives_its_quota_back() -> None:
    body = queued_job({"phase": "Running"}, spec={**SPEC, "scheduling": {"queue": "other"}})
    job = parse_job(body)
    assert job.spec is None and "spec.scheduling.queue: is 'other'" in str(job.spec_error)
    d = run(body, stored(*ADMITTED), queue=None)
    assert d.phase == "Failed" and d.actions.workload == "finish"



def test_a_queue_name_kueue_refuses_holds_the_job_only_with_the_integration() -> None:
    """With `--kueue` the job waits, saying why (no Workload is made for the name); without
    it the name means nothing, and a job with it runs (and keeps running after an upgrade)."""
    body = queued_job(labels={kueue.LABEL_QUEUE: "Team_A"})
    assert parse_job(body).spec is not None
    problem = ("InvalidQueueName", "metadata.labels[kueue.x-k8s.io/queue-name]: is 'Team_A'")
    d = run(body, None, queue="Team_A", problem=problem)
    assert d.phase == "Queued" and d.actions.workload is None
    assert conditions(d)["Queued"]["reason"] == "InvalidQueueName"
    d = run(queued_job({"phase": "Running"}, labels={kueue.LABEL_QUEUE: "Team_A"}), None,
            [*compute(), driver()], cluster=True, enabled=False, queue="Team_A")
    assert d.phase == "Running" and not d.actions.delete_cluster


def test_without_the_integration_a_queued_job_runs_and_says_why() -> None:
    d = run(queued_job(), None, enabled=False)
    assert d.phase == "Pending" and d.actions.create_cluster and d.actions.workload is None
    c = conditions(d)["Queued"]
    assert (c["status"], c["reason"]) == ("False", "KueueIntegrationOff")
    assert "kueue.enabled" in c["message"]


def test_a_removed_queue_label_stops_the_job_drops_its_workload_then_runs_it() -> None:
    body = queued_job({"phase": "Running"}, labels={})
    d = run(body, stored(*ADMITTED), [*compute(), driver()], cluster=True, queue=None)
    assert d.phase == "Queued" and conditions(d)["Queued"]["reason"] == "QueueRemoved"
    assert d.actions.delete_driver and d.actions.workload is None
    assert run(body, stored(*ADMITTED), queue=None).actions.workload == "drop"
    d = run(queued_job({"phase": "Queued"}, labels={}), None, queue=None)
    assert d.phase == "Pending" and d.actions.create_cluster


def test_an_image_edit_keeps_the_admission_and_a_priority_change_is_made_in_place() -> None:
    image = {**SPEC, "trainer": {**SPEC["trainer"], "image": "example.com/trainer:2"}}
    running = queued_job({"phase": "Running"}, spec=image)
    d = run(running, stored(*READY), [*compute(), driver()], cluster=True)
    assert d.phase != "Queued" and d.actions.workload is None
    wpc = kueue.Priority("WorkloadPriorityClass", "high", 10)
    wanted = kueue.build_workload(REF, RLJobSpec.model_validate(SPEC), "team", wpc)

    def held(ref: Obj | None, value: int | None, reserved: bool = True) -> kueue.WorkloadView:
        wl = stored(*(READY if reserved else (cond("QuotaReserved", "False", "Pending"),)))
        wl["spec"]["priorityClassRef"], wl["spec"]["priority"] = ref, value
        return parse_workload(wl)

    # Admitted: a new value of its class, or another WorkloadPriorityClass, in place...
    assert kueue.priority_changed(held(wpc.ref(), 5), wanted)
    assert kueue.priority_changed(held({**wpc.ref(), "name": "low"}, 5), wanted)
    assert not kueue.priority_changed(held(wpc.ref(), 10), wanted)
    # ...but a class added, or of another kind, only once it holds no quota (Kueue's rules).
    assert not kueue.priority_changed(held(None, None), wanted)
    pc = kueue.Priority("PriorityClass", "high", 10).ref()
    assert not kueue.priority_changed(held(pc, 10), wanted)
    assert kueue.priority_changed(held(pc, 10, reserved=False), wanted)



def test_an_admitted_job_that_runs_tells_kueue_its_pods_are_ready() -> None:
    d = run(queued_job({"phase": "Running"}), stored(*ADMITTED), [*compute(), driver()],
            cluster=True)
    assert d.phase == "Running" and d.actions.workload == "pods-ready"
    ready = stored(*ADMITTED, cond("PodsReady", "True", "Started"))
    d = run(queued_job({"phase": "Running"}), ready, [*compute(), driver()], cluster=True)
    assert d.actions.workload is None


def test_quota_held_for_admission_checks_or_a_missing_flavor_starts_nothing() -> None:
    d = run(queued_job(), stored(cond("QuotaReserved", "True", "QuotaReserved"),
                                 cond("Admitted", "False", "UnsatisfiedChecks")))
    assert d.phase == "Queued" and not d.actions.create_cluster
    assert conditions(d)["Queued"]["reason"] == "AwaitingAdmissionChecks"
    d = run(queued_job(), stored(*ADMITTED), problem=("FlavorNotFound", "gone"))
    assert d.phase == "Queued" and not d.actions.create_cluster
    assert conditions(d)["Queued"]["reason"] == "FlavorNotFound"
    d = run(queued_job(), None, problem=("PriorityClassNotFound", "no class"))
    assert d.actions.workload is None and conditions(d)["Queued"]["reason"] == \
        "PriorityClassNotFound"


def test_flavors_are_applied_to_each_pod_set() -> None:
    view = parse_workload(stored(*ADMITTED))
    placement = kueue.flavored(view, {"gpu": {"spec": {
        "nodeLabels": {"pool": "a"}, "tolerations": [{"key": "t", "operator": "Exists"}]}}})
    rc = kueue.place_raycluster(build_raycluster(REF, RLJobSpec.model_validate(SPEC)),
                                placement)
    for t in [rc["spec"]["headGroupSpec"]["template"],
              *(g["template"] for g in rc["spec"]["workerGroupSpecs"])]:
        assert t["spec"]["nodeSelector"]["pool"] == "a"
        assert {"key": "t", "operator": "Exists"} in t["spec"]["tolerations"]
        assert t["metadata"]["labels"][kueue.LABEL_PODSET]


def test_pods_of_a_lost_node_do_not_hold_the_quota_and_are_force_deleted() -> None:
    """A deleted RayCluster's pod stuck terminating on a lost node is run by no kubelet: it
    neither keeps the quota from going back nor stays (force-deleted, as stranded)."""
    evicted = stored(*ADMITTED, cond("Evicted", "True", "Preempted", "by high"))
    stuck = {**compute()[0], "metadata": {**compute()[0]["metadata"], "ownerReferences": [
        {"kind": "RayCluster", "uid": "deleted-cluster", "controller": True}]}}
    lost = {"metadata": {"name": "n1"}, "status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-01-01T11:00:00Z"}]}}
    obs = observe("rl", None, [stuck], [lost], None, uid="u", now=T0, node_lost_after=30)
    assert obs.pods_left == 0 and obs.stranded_orphans == (stuck["metadata"]["name"],)
    obs = replace(obs, queue=QueueState("team", True, parse_workload(evicted), want()))
    d = decide(parse_job(queued_job({"phase": "Queued"})), obs, T0)
    assert d.actions.workload == "release"
    assert stuck["metadata"]["name"] in d.actions.delete_pods
