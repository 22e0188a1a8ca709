"""Pure decisions: observed children + stored status → phase, conditions, recovery, actions."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rljob_api.spec import RLJobSpec
from rljob_api.status import OPERATOR_FIELDS
from rljob_api.status import timestamp as iso
from rljob_api.validate import spec_problems
from rljob_operator import names
from rljob_operator.builders import JobRef, revisions
from rljob_operator.cache import Store
from rljob_operator.decision import Actions, Decision
from rljob_operator.observe import FailureHint, InTheWay, Relabel, label_repairs, observe
from rljob_operator.phases import backoff_seconds, decide, finished
from rljob_operator.situation import parse_job
from rljob_operator.status import merge_patch_to, needs_write, resume_figures

pytestmark = pytest.mark.unit
Obj = dict[str, Any]
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
SPEC: Obj = {
    "trainer": {"replicas": 1, "gpusPerReplica": 2},
    "rollout": {"engines": 2, "gpusPerEngine": 1},
    "recovery": {"maxRestarts": 2, "backoffSeconds": 10, "maxBackoffSeconds": 15},
}
COMPUTE = [("rl-head-a", "head"), ("rl-trainer-worker-a", "trainer"),
           ("rl-rollout-worker-a", "rollout"), ("rl-rollout-worker-b", "rollout")]


def pod(name: str, component: str, phase: str = "Running", node: str | None = "n1",
        annotations: Obj | None = None, unschedulable: str | None = None,
        deleting: bool = False) -> Obj:
    conditions: list[Obj] = []
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False",
                           "reason": "Unschedulable", "message": unschedulable})
        node = None
    elif phase == "Running":
        conditions.append({"type": "Ready", "status": "True"})
    meta: Obj = {"name": name, "labels": {"rljob.io/component": component},
                 "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = iso(T0)
    return {"metadata": meta, "spec": {"nodeName": node, "containers": [{"name": "c"}]},
            "status": {"phase": phase, "conditions": conditions}}


def driver(restarts: int = 0, phase: str = "Running", recorded: tuple[str, ...] = (),
           **kw: Any) -> Obj:
    names = ",".join(sorted(recorded or [n for n, _ in COMPUTE]))
    return pod("rl-driver", "driver", phase, annotations={
        "rljob.io/restarts": str(restarts), "rljob.io/compute-pods": names}, **kw)


def compute(skip: str | None = None) -> list[Obj]:
    return [pod(n, c) for n, c in COMPUTE if n != skip]


READY_NODE = {"metadata": {"name": "n1"}, "status": {"conditions": [
    {"type": "Ready", "status": "True"}]}}


def job(status: Obj | None = None, spec: Obj | None = None, name: str = "rl",
        generation: int = 1) -> Obj:
    return {"metadata": {"name": name, "namespace": "ns", "uid": "u", "generation": generation},
            "spec": spec if spec is not None else SPEC, "status": status or {}}


def built(body: Obj, pods: list[Obj], rc: Obj | None) -> tuple[list[Obj], Obj | None]:
    """The children as the operator built them from `body`'s spec: a pod or RayCluster
    without a revision gets the one the spec builds (a test sets another to mean outdated)."""
    spec = RLJobSpec.model_validate(body["spec"])
    want = revisions(JobRef.of(body), spec)
    out = copy.deepcopy(pods)
    for p in out:
        component = p["metadata"]["labels"]["rljob.io/component"]
        rev = want.driver if component == "driver" else want.templates.get(component, "?")
        p["metadata"].setdefault("annotations", {}).setdefault("rljob.io/revision", rev)
    if rc is not None:
        rc = copy.deepcopy(rc)
        rc["metadata"].setdefault("annotations", {}).setdefault("rljob.io/revision",
                                                                want.cluster)
    return out, rc


def run(body: Obj, pods: list[Obj], now: datetime = T0, cluster: bool = True,
        nodes: list[Obj] | None = None, hints: dict[str, FailureHint] | None = None,
        lost_after: float = 0.0) -> Decision:
    rc = {"metadata": {"name": "rl"}} if cluster else None
    if spec_problems(body["spec"]) == []:
        pods, rc = built(body, pods, rc)
    obs = observe("rl", rc, pods, [READY_NODE] if nodes is None else nodes, hints, now=now,
                  node_lost_after=lost_after)
    return decide(parse_job(body), obs, now)


def applied(body: Obj, d: Decision) -> Obj:
    """The RLJob after the operator's status write (server-side apply: the operator's fields
    are replaced, those it leaves out removed; runtime fields untouched)."""
    kept = {k: v for k, v in body["status"].items() if k not in OPERATOR_FIELDS}
    status = {**kept, **d.status}
    if d.hold_step is not None:  # the merge patch of the runtime's progress.rolloutStep
        status["progress"] = {**kept.get("progress", {}), "rolloutStep": d.hold_step}
    return job(status, body["spec"], body["metadata"]["name"], body["metadata"]["generation"])


def conditions(d: Decision) -> dict[str, Obj]:
    return {c["type"]: c for c in d.status["conditions"]}


# Runtime fields below (progress, checkpoint, resumed) are test inputs standing for what a
# runtime reported; the tests assert only what the operator derives from them.
RUNNING: Obj = {"phase": "Running", "startedAt": iso(T0),
                "recovery": {"restarts": 0, "maxRestarts": 2},
                "progress": {"rolloutStep": 9}, "checkpoint": {"step": 6, "verified": True}}


def test_new_job_creates_its_cluster_and_waits_pending() -> None:
    d = run(job(), [], cluster=False)
    assert d.status["phase"] == "Pending" and d.actions.create_cluster
    assert d.status["recovery"] == {"restarts": 0, "maxRestarts": 2}
    assert conditions(d)["Scheduled"]["reason"] == "WaitingForPods"


def test_unschedulable_pods_are_named_with_the_scheduler_reason() -> None:
    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    pods = [pod("rl-head-a", "head"), pod("rl-trainer-worker-a", "trainer", "Pending",
                                          unschedulable=why)]
    d = run(job(), pods)
    cond = conditions(d)["Scheduled"]
    assert d.status["phase"] == "Pending"
    assert (cond["status"], cond["reason"]) == ("False", "Unschedulable")
    assert cond["message"] == f"1 pod(s) cannot be scheduled (rl-trainer-worker-a): {why}"


def test_ready_compute_starts_the_driver_then_runs() -> None:
    body = job()
    d = run(body, compute())
    assert d.status["phase"] == "Initializing"
    # Rollout pods are left out: the runtime replaces a lost engine without a restart.
    assert d.actions.create_driver == ("rl-head-a", "rl-trainer-worker-a")
    body = applied(body, d)
    d = run(body, [*compute(), driver()], now=T0 + timedelta(seconds=5))
    assert d.status["phase"] == "Running"
    assert d.status["startedAt"] == iso(T0 + timedelta(seconds=5))
    assert d.event is not None and d.event.reason == "Running"
    assert conditions(d)["Ready"]["status"] == "True"


def test_nothing_to_write_when_nothing_changed() -> None:
    body = job(RUNNING)
    first = run(body, [*compute(), driver()])
    body = applied(body, first)
    later = run(body, [*compute(), driver()], now=T0 + timedelta(minutes=5))
    assert not needs_write(body["status"], later.status)
    assert later.event is None and later.actions.create_driver is None
    # A runtime report changes only runtime fields: still nothing for the operator to write.
    body["status"]["progress"] = {"rolloutStep": 10}
    assert not needs_write(body["status"], run(body, [*compute(), driver()]).status)


def test_condition_transition_time_moves_only_with_its_status() -> None:
    body = applied(job(RUNNING), run(job(RUNNING), [*compute(), driver()]))
    before = conditions(run(body, [*compute(), driver()]))["Ready"]["lastTransitionTime"]
    lost = run(body, [*compute("rl-trainer-worker-a"), driver()], now=T0 + timedelta(hours=1))
    assert conditions(lost)["Ready"]["lastTransitionTime"] == iso(T0 + timedelta(hours=1))
    assert before == iso(T0)


def test_deleted_compute_pod_starts_a_restart_and_records_the_progress_it_had() -> None:
    body = job(RUNNING)  # input: the runtime had reported rollout step 9
    d = run(body, [*compute("rl-trainer-worker-a"), pod("rl-trainer-worker-z", "trainer"),
                   driver()])
    assert d.status["phase"] == "Recovering"
    rec = d.status["recovery"]
    assert rec["restarts"] == 1
    # Nothing is predicted: where the next attempt resumes is known once its runtime says so.
    assert "resumedFromStep" not in rec and "lostSteps" not in rec
    assert rec["lastFailure"] == {"reason": "PodDeleted", "message": "the pod was deleted",
                                  "pod": "rl-trainer-worker-a", "time": iso(T0), "step": 9}
    assert rec["action"] == "WaitingForBackoff"
    assert rec["nextAttemptAt"] == iso(T0 + timedelta(seconds=10))
    assert d.actions.delete_driver and d.requeue_after == 10
    assert d.event is not None and d.event.type == "Warning"
    assert d.restart is not None and d.restart.kind == "PodDeleted"


def test_a_lost_rollout_pod_ends_the_attempt_only_when_engines_are_not_replaced() -> None:
    """KubeRay recreates a lost rollout pod and the runtime starts its engine again there
    (spec.recovery.maxEngineRestarts): the driver does not record rollout pods, and their
    loss is no failure of its attempt. With maxEngineRestarts 0 they are recorded, and a
    deleted one restarts the job as before."""
    spared = run(job(), compute()).actions.create_driver
    assert spared is not None and not any("rollout" in p for p in spared)
    d = run(job(RUNNING), [*compute("rl-rollout-worker-b"), driver(recorded=spared)])
    assert d.status["phase"] == "Running" and d.restart is None
    strict = {**SPEC, "recovery": {**SPEC["recovery"], "maxEngineRestarts": 0}}
    recorded = run(job(spec=strict), compute()).actions.create_driver
    assert recorded == tuple(sorted(n for n, _ in COMPUTE))
    d = run(job(RUNNING, spec=strict), [*compute("rl-rollout-worker-b"),
                                        driver(recorded=recorded)])
    assert d.restart is not None and d.restart.kind == "PodDeleted"


def test_watch_hint_names_the_real_cause_of_a_vanished_pod() -> None:
    hint = FailureHint("PodFailed", "container exited with code 137 (OOMKilled)")
    d = run(job(RUNNING), [*compute("rl-rollout-worker-b"), driver()],
            hints={"rl-rollout-worker-b": hint})
    assert d.status["recovery"]["lastFailure"]["reason"] == "PodFailed"
    assert "OOMKilled" in d.status["recovery"]["lastFailure"]["message"]


def test_recovery_waits_for_backoff_then_starts_the_next_attempt() -> None:
    body = job(RUNNING)
    body = applied(body, run(body, [*compute("rl-trainer-worker-a"), driver()]))
    fresh = [*compute("rl-trainer-worker-a"), pod("rl-trainer-worker-z", "trainer")]
    stale = run(body, [*fresh, driver(restarts=0)], now=T0 + timedelta(seconds=1))
    assert stale.actions.delete_driver and stale.status["recovery"]["restarts"] == 1
    early = run(body, fresh, now=T0 + timedelta(seconds=4))
    assert early.actions.create_driver is None and early.requeue_after == 6
    assert early.status["recovery"]["action"] == "WaitingForBackoff"
    due = run(body, fresh, now=T0 + timedelta(seconds=10))
    assert due.actions.create_driver is not None
    assert "rl-trainer-worker-z" in due.actions.create_driver
    body = applied(body, due)
    attempt_1 = [*fresh, driver(restarts=1, recorded=due.actions.create_driver)]
    back = run(body, attempt_1, now=T0 + timedelta(seconds=12))
    assert back.status["phase"] == "Running"
    assert back.event is not None and back.event.reason == "Resumed"
    assert "nextAttemptAt" not in back.status["recovery"]
    # Input: attempt 0's report is still stored; it says nothing about attempt 1.
    body = applied(body, back)
    body["status"]["resumed"] = {"attempt": 0, "found": False, "step": 0, "at": iso(T0)}
    stale = run(body, attempt_1, now=T0 + timedelta(seconds=13))
    assert "resumedFromStep" not in stale.status["recovery"] and stale.event is None
    # Input: attempt 1's runtime reports the checkpoint it loaded.
    body["status"]["resumed"] = {"attempt": 1, "found": True, "step": 6, "at": iso(T0),
                                 "path": "/ckpt/rl/checkpoints/step_00000006"}
    reported = run(body, attempt_1, now=T0 + timedelta(seconds=14))
    rec = reported.status["recovery"]
    assert (rec["resumedFromStep"], rec["lostSteps"]) == (6, 3)  # failed at step 9
    assert reported.event is not None and reported.event.reason == "ResumedFromCheckpoint"
    assert "step 6" in reported.event.message and "3 step(s)" in reported.event.message
    assert needs_write(body["status"], reported.status)
    assert "resumed" not in reported.status  # the runtime's field: read, never written
    body = applied(body, reported)
    again = run(body, attempt_1, now=T0 + timedelta(seconds=20))
    assert again.event is None and not needs_write(body["status"], again.status)


def test_a_restarted_job_shows_the_step_it_has_until_its_new_runtime_reports() -> None:
    """Input: attempt 0's runtime had reported rollout step 9 and a verified checkpoint of
    step 6. From the restart on, the operator sets the STEP column (progress.rolloutStep)
    to 6, through the backoff and the new driver's start, and again after a late report of
    the lost attempt's runtime; once attempt 1's runtime reported progress, it stands."""
    running = {**RUNNING, "progress": {"attempt": 0, "rolloutStep": 9}}
    body = job(running)
    assert run(body, [*compute(), driver()]).hold_step is None  # a first attempt
    failed = run(body, [*compute("rl-trainer-worker-a"), driver()])
    assert failed.status["phase"] == "Recovering" and failed.hold_step == 6
    assert failed.status["recovery"]["lastFailure"]["step"] == 9
    assert "progress" not in failed.status  # the runtime's field: not in the operator's apply
    body = applied(body, failed)
    assert body["status"]["progress"] == {"attempt": 0, "rolloutStep": 6}
    fresh = [*compute("rl-trainer-worker-a"), pod("rl-trainer-worker-z", "trainer")]
    due = run(body, fresh, now=T0 + timedelta(seconds=10))
    assert due.actions.create_driver is not None and due.hold_step is None  # shown already
    body = applied(body, due)
    attempt_1 = [*fresh, driver(restarts=1, recorded=due.actions.create_driver)]
    # Input: the lost attempt's runtime reports once more on its way out.
    body["status"]["progress"] = {"attempt": 0, "rolloutStep": 10, "meanReward": 0.5}
    late = run(body, attempt_1, now=T0 + timedelta(seconds=12))
    assert late.status["phase"] == "Running" and late.hold_step == 6
    # Input: attempt 1's runtime reports where it starts, before it even placed its workers,
    # then its steps; whatever it reports stands (it may resume from a newer checkpoint).
    for step in (7, 8):
        body["status"]["progress"] = {"attempt": 1, "rolloutStep": step}
        assert run(body, attempt_1, now=T0 + timedelta(seconds=14)).hold_step is None
    # A runtime that reports no attempt (an older release) is the lost one's until resumed.
    body["status"]["progress"] = {"rolloutStep": 9}
    assert run(body, attempt_1, now=T0 + timedelta(seconds=15)).hold_step == 6
    # Without a verified checkpoint the runtime starts over: the job has step 0.
    unverified = {**running, "checkpoint": {"step": 6, "verified": False}}
    assert run(job(unverified), [*compute("rl-trainer-worker-a"), driver()]).hold_step == 0
    # A job that fails while it restarts keeps showing the step it has.
    body = applied(job(running), failed)
    body["status"]["progress"]["rolloutStep"] = 9  # input: the late report again
    body["status"]["recovery"]["restarts"] = 2  # input: the last restart is used up
    ended = run(body, [*compute("rl-trainer-worker-b"),
                       driver(restarts=2, recorded=due.actions.create_driver)],
                now=T0 + timedelta(seconds=30))
    assert ended.status["phase"] == "Failed" and ended.hold_step == 6, ended.status
    body = applied(body, ended)
    assert run(body, [], now=T0 + timedelta(seconds=40)).hold_step is None


def test_resume_figures_come_only_from_the_current_attempts_report() -> None:
    failure = {"reason": "PodDeleted", "step": 14}  # input: progress when the failure was seen

    def report(attempt: int, found: bool, step: int) -> Obj:  # input: the runtime's report
        return {"attempt": attempt, "found": found, "step": step}

    assert resume_figures(2, failure, report(2, True, 10)) == {"resumedFromStep": 10,
                                                               "lostSteps": 4}
    assert resume_figures(2, failure, report(1, True, 10)) == {}  # an older attempt's report
    assert resume_figures(2, failure, None) == {}  # not reported yet
    # A restart that found no checkpoint starts over: everything is redone.
    assert resume_figures(1, failure, report(1, False, 0)) == {"resumedFromStep": 0,
                                                               "lostSteps": 14}
    # A first attempt resumed nothing, unless it found a checkpoint (e.g. after suspend).
    assert resume_figures(0, None, report(0, False, 0)) == {}
    assert resume_figures(0, None, report(0, True, 30)) == {"resumedFromStep": 30}
    # A failure seen before any progress was reported: the lost steps are unknown.
    assert resume_figures(1, {"reason": "PodDeleted"}, report(1, True, 0)) == {
        "resumedFromStep": 0}
    assert resume_figures(1, failure, report(1, True, 20))["lostSteps"] == 0
    # The same attempt's earlier driver pod (before a suspension or a spec edit) says
    # nothing about the pod that runs now.
    earlier = {**report(2, True, 10), "driverPodUid": "pod-1"}
    assert resume_figures(2, failure, earlier, "pod-2") == {}
    assert resume_figures(2, failure, earlier, "pod-1") == {"resumedFromStep": 10,
                                                            "lostSteps": 4}


def test_an_unbound_claim_names_the_checkpoint_claim_and_what_it_needs() -> None:
    why = ("0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims. "
           "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling.")
    spec = {**SPEC, "data": {"pvc": "datasets"}}
    pods = [pod("rl-head-a", "head", "Pending", unschedulable=why)]
    cond = conditions(run(job(spec=spec), pods))["Scheduled"]
    assert cond["reason"] == "Unschedulable"
    assert cond["message"].startswith(f"1 pod(s) cannot be scheduled (rl-head-a): {why}")
    assert "(claims the pods mount: rl-checkpoints, datasets; each must be Bound" \
        in cond["message"]
    assert "rl-checkpoints holds the shared checkpoints and needs a ReadWriteMany volume" \
        in cond["message"]
    assert "spec.checkpoint.storageClassName" in cond["message"]


def test_backoff_doubles_up_to_the_cap() -> None:
    spec = parse_job(job()).spec
    assert spec is not None
    assert [backoff_seconds(spec, n) for n in (1, 2, 3)] == [10, 15, 15]


def test_restart_limit_fails_the_job_and_releases_compute() -> None:
    status = {**RUNNING, "recovery": {"restarts": 2, "maxRestarts": 2}}
    d = run(job(status), [*compute(), driver(restarts=2, phase="Failed")])
    assert d.status["phase"] == "Failed" and d.status["finishedAt"] == iso(T0)
    cond = conditions(d)["Failed"]
    assert cond["reason"] == "RestartLimitExceeded" and "DriverFailed" in cond["message"]
    assert d.actions.delete_cluster and d.status["recovery"]["restarts"] == 2


def test_failure_not_in_retry_on_fails_at_once() -> None:
    spec = {**SPEC, "recovery": {**SPEC["recovery"], "retryOn": ["PodFailed"]}}
    d = run(job(RUNNING, spec), [*compute("rl-head-a"), driver()])
    assert d.status["phase"] == "Failed"
    assert conditions(d)["Failed"]["reason"] == "PodDeleted"


def test_lost_node_is_a_failure_and_its_pods_are_force_deleted() -> None:
    lost = {"metadata": {"name": "n1"}, "status": {"conditions": [
        {"type": "Ready", "status": "Unknown"}]}}
    d = run(job(RUNNING), [*compute(), driver()], nodes=[lost])
    rec = d.status["recovery"]
    assert rec["lastFailure"]["reason"] == "NodeLost" and "n1" in rec["lastFailure"]["message"]
    assert set(d.actions.delete_pods) == {n for n, _ in COMPUTE} | {"rl-driver"}
    gone = run(job(RUNNING), [*compute(), driver()], nodes=[])  # node object deleted
    assert gone.status["recovery"]["lastFailure"]["reason"] == "NodeLost"


def test_non_retryable_runtime_failure_fails_with_its_reason() -> None:
    status = {**RUNNING, "runtimeFailure": {"reason": "NonFiniteWeights", "message": "NaN",
                                            "retryable": False, "time": iso(T0)}}
    d = run(job(status), [*compute(), driver()])
    assert d.status["phase"] == "Failed"
    assert conditions(d)["Failed"]["reason"] == "NonFiniteWeights"
    assert "runtimeFailure" not in d.status  # the runtime's field is never written back


def exited(code: int, started: datetime = T0) -> Obj:
    """The driver pod as the kubelet reports it once its container ended with `code`."""
    pod_ = driver(phase="Failed")
    pod_["status"]["containerStatuses"] = [{"name": "c", "state": {"terminated": {
        "exitCode": code, "reason": "Error", "startedAt": iso(started),
        "finishedAt": iso(started + timedelta(seconds=30))}}}]
    return pod_


@pytest.mark.parametrize(("code", "reason"), [(2, "InvalidSpec"), (3, "NonFiniteValues")])
def test_driver_exit_code_of_a_doomed_job_fails_at_once_without_a_restart(
        code: int, reason: str) -> None:
    d = run(job(RUNNING), [*compute(), exited(code)])
    assert d.status["phase"] == "Failed" and d.status["finishedAt"] == iso(T0)
    cond = conditions(d)["Failed"]
    assert cond["reason"] == reason == conditions(d)["Ready"]["reason"]
    assert f"the driver exited with code {code}" in cond["message"]
    assert "rl-driver" in cond["message"]
    rec = d.status["recovery"]
    assert rec["restarts"] == 0 and d.restart is None
    assert (rec["lastFailure"]["reason"], rec["lastFailure"]["pod"]) == (reason, "rl-driver")
    assert d.actions.delete_cluster and d.actions.create_driver is None
    assert not d.actions.delete_driver  # kept for its logs


def test_doomed_exit_takes_the_reason_this_attempts_runtime_reported() -> None:
    later = iso(T0 + timedelta(seconds=20))
    report = {"reason": "NonFiniteLoss", "message": "3 steps in a row; evidence in /x",
              "retryable": True, "time": later}
    d = run(job({**RUNNING, "runtimeFailure": report}), [*compute(), exited(3)])
    cond = conditions(d)["Failed"]
    assert cond["reason"] == "NonFiniteLoss" and "evidence in /x" in cond["message"]
    # A report older than this attempt's start is a previous attempt's: not this reason.
    old = {**report, "reason": "WeightSyncFailed", "time": iso(T0 - timedelta(minutes=5))}
    d = run(job({**RUNNING, "runtimeFailure": old}), [*compute(), exited(2)])
    assert conditions(d)["Failed"]["reason"] == "InvalidSpec"
    assert "WeightSyncFailed" not in conditions(d)["Failed"]["message"]


@pytest.mark.parametrize("code", [1, 137, 143])
def test_other_driver_exits_are_restarted(code: int) -> None:
    d = run(job(RUNNING), [*compute(), exited(code)])
    assert d.status["phase"] == "Recovering" and d.status["recovery"]["restarts"] == 1
    last = d.status["recovery"]["lastFailure"]
    assert last["reason"] == "DriverFailed" and f"code {code}" in last["message"]


def lost_worker_report(*pods: str) -> Obj:
    """What a runtime reports when Ray lost the nodes of `pods` under its attempt."""
    return {"reason": "WorkerLost", "message": "Ray lost the node of rl-trainer-worker-a "
            "(health check failed); first error: ActorDiedError", "retryable": True,
            "time": iso(T0 + timedelta(seconds=20)), "lostPods": list(pods)}


def test_a_worker_ray_lost_is_named_after_what_kubernetes_knows_of_its_pod() -> None:
    status = {**RUNNING, "runtimeFailure": lost_worker_report("rl-trainer-worker-a")}
    # Kubernetes has not noticed yet: WorkerLost, and the pod goes, so that no attempt
    # starts on it while it still reads Ready.
    d = run(job(status), [*compute(), exited(1)])
    last = d.status["recovery"]["lastFailure"]
    assert (last["reason"], last["pod"]) == ("WorkerLost", "rl-trainer-worker-a")
    assert "health check failed" in last["message"]
    assert d.actions.replace_pods == ("rl-trainer-worker-a",) and not d.actions.delete_pods
    # Its node is already NotReady: NodeLost.
    lost = {"metadata": {"name": "n2"}, "status": {"conditions": [
        {"type": "Ready", "status": "Unknown"}]}}
    pods = [pod(n, c, node="n2" if n == "rl-trainer-worker-a" else "n1") for n, c in COMPUTE]
    d = run(job(status), [*pods, exited(1)], nodes=[READY_NODE, lost])
    last = d.status["recovery"]["lastFailure"]
    assert (last["reason"], last["pod"]) == ("NodeLost", "rl-trainer-worker-a")
    # The pod is being deleted: PodDeleted; a report of an earlier attempt names nothing.
    pods = [pod(n, c, deleting=n == "rl-trainer-worker-a") for n, c in COMPUTE]
    d = run(job(status), [*pods, exited(1)])
    assert d.status["recovery"]["lastFailure"]["reason"] == "PodDeleted"
    old = {**status["runtimeFailure"], "time": iso(T0 - timedelta(minutes=5))}
    d = run(job({**RUNNING, "runtimeFailure": old}), [*compute(), exited(1)])
    assert d.status["recovery"]["lastFailure"]["reason"] == "DriverFailed"


def test_retry_on_node_lost_covers_a_worker_lost_first_seen_by_ray() -> None:
    status = {**RUNNING, "runtimeFailure": lost_worker_report("rl-trainer-worker-a")}
    spec = {**SPEC, "recovery": {**SPEC["recovery"], "retryOn": ["NodeLost"]}}
    d = run(job(status, spec), [*compute(), exited(1)])
    assert d.status["phase"] == "Recovering", d.status
    spec = {**SPEC, "recovery": {**SPEC["recovery"], "retryOn": ["PodFailed"]}}
    d = run(job(status, spec), [*compute(), exited(1)])
    assert d.status["phase"] == "Failed"
    assert "WorkerLost is not in spec.recovery.retryOn" in conditions(d)["Failed"]["message"]


def test_worker_lost_reads_node_lost_once_kubernetes_sees_the_node_go() -> None:
    status = {**RUNNING, "runtimeFailure": lost_worker_report("rl-trainer-worker-a")}
    first = run(job(status), [*compute(), exited(1)])
    body = applied(job(status), first)
    # Still Ready in Kubernetes: the reason stays as Ray saw it.
    same = run(body, [*compute(), exited(1)], now=T0 + timedelta(seconds=5))
    assert same.status["recovery"]["lastFailure"]["reason"] == "WorkerLost"
    lost = {"metadata": {"name": "n2"}, "status": {"conditions": [
        {"type": "Ready", "status": "Unknown"}]}}
    pods = [pod(n, c, node="n2" if n == "rl-trainer-worker-a" else "n1",
                deleting=n == "rl-trainer-worker-a") for n, c in COMPUTE]
    later = run(body, pods, now=T0 + timedelta(seconds=50), nodes=[READY_NODE, lost])
    rec = later.status["recovery"]
    assert rec["restarts"] == 1 and later.restart is None  # the same failure, not another
    assert rec["lastFailure"]["reason"] == "NodeLost"
    assert rec["lastFailure"]["message"].startswith("node n2 is not Ready")
    assert "health check failed" in rec["lastFailure"]["message"]
    assert "rl-trainer-worker-a" in later.actions.delete_pods  # stranded: force-deleted


def node_not_ready(name: str, since: datetime) -> Obj:
    return {"metadata": {"name": name}, "status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "lastTransitionTime": iso(since)}]}}


def test_a_driver_that_failed_with_the_heads_node_reads_node_lost() -> None:
    # The runtime could not ask a dead GCS which pods went: no lostPods, only what Ray said.
    report = {"reason": "WorkerFailed", "message": "actor unavailable", "retryable": True,
              "time": iso(T0 + timedelta(seconds=20))}
    status = {**RUNNING, "runtimeFailure": report}
    pods = [pod(n, c, node="n2" if c == "head" else "n1") for n, c in COMPUTE]
    # The head's node is already NotReady when the driver's failure is seen: NodeLost.
    d = run(job(status), [*pods, exited(1)],
            nodes=[READY_NODE, node_not_ready("n2", T0 + timedelta(seconds=10))])
    last = d.status["recovery"]["lastFailure"]
    assert (last["reason"], last["pod"]) == ("NodeLost", "rl-head-a"), last
    assert "actor unavailable" in last["message"] and "n2" in last["message"]
    # Kubernetes has not noticed yet: DriverFailed, renamed once the node is seen NotReady,
    # the same failure (no second restart).
    ready_n2 = {**READY_NODE, "metadata": {"name": "n2"}}
    first = run(job(status), [*pods, exited(1)], nodes=[READY_NODE, ready_n2])
    assert first.status["recovery"]["lastFailure"]["reason"] == "DriverFailed"
    body = applied(job(status), first)
    later = run(body, pods, now=T0 + timedelta(seconds=50),
                nodes=[READY_NODE, node_not_ready("n2", T0 + timedelta(seconds=45))])
    rec = later.status["recovery"]
    assert rec["restarts"] == 1 and later.restart is None
    assert (rec["lastFailure"]["reason"], rec["lastFailure"]["pod"]) == ("NodeLost", "rl-head-a")
    assert "the driver failed first" in rec["lastFailure"]["message"]
    # Only a rollout pod's node went, and engines are replaced: its loss is not the cause.
    spread = [pod(n, c, node="n2" if c == "rollout" else "n1") for n, c in COMPUTE]
    rollout_only = run(body, spread, now=T0 + timedelta(seconds=50),
                       nodes=[READY_NODE, node_not_ready("n2", T0 + timedelta(seconds=45))])
    assert rollout_only.status["recovery"]["lastFailure"]["reason"] == "DriverFailed"
    # Another runtime failure is not Ray's: a node that is not Ready names neither.
    storage = {**report, "reason": "StorageError", "message": "the workdir is full"}
    d = run(job({**RUNNING, "runtimeFailure": storage}), [*pods, exited(1)],
            nodes=[READY_NODE, node_not_ready("n2", T0 + timedelta(seconds=10))])
    assert d.status["recovery"]["lastFailure"]["reason"] == "DriverFailed"
    assert not d.actions.replace_pods
    first = run(job({**RUNNING, "runtimeFailure": storage}), [*pods, exited(1)],
                nodes=[READY_NODE, ready_n2])
    later = run(applied(job({**RUNNING, "runtimeFailure": storage}), first), pods,
                now=T0 + timedelta(seconds=50),
                nodes=[READY_NODE, node_not_ready("n2", T0 + timedelta(seconds=45))])
    assert later.status["recovery"]["lastFailure"]["reason"] == "DriverFailed"
    # A node that went long after the failure does not explain it.
    much_later = run(body, pods, now=T0 + timedelta(minutes=4),
                     nodes=[READY_NODE, node_not_ready("n2", T0 + timedelta(minutes=3))])
    assert much_later.status["recovery"]["lastFailure"]["reason"] == "DriverFailed"


def test_invalid_spec_and_overlong_name_fail_naming_the_field() -> None:
    bad = {**SPEC, "rollout": {"gpus": 3, "gpusPerEngine": 2}}
    d = run(job(spec=bad), [])
    assert d.status["phase"] == "Failed"
    assert "spec.rollout.gpus" in conditions(d)["Failed"]["message"]
    long = run(job(name="x" * 60), [])
    assert "metadata.name must be at most 53" in conditions(long)["Failed"]["message"]
    dotted = run(job(name="rl.v2"), [])  # a valid object name, but no RayCluster's
    assert "metadata.name must be a DNS-1035 label" in conditions(dotted)["Failed"]["message"]


def test_suspend_tears_down_and_resume_waits_for_the_old_driver() -> None:
    spec = {**SPEC, "scheduling": {"suspend": True}}
    d = run(job(RUNNING, spec, generation=2), [*compute(), driver()])
    assert d.status["phase"] == "Suspended"
    # The driver goes first: it saves on SIGTERM, which needs the trainers and engines.
    assert d.actions.delete_driver and not d.actions.delete_cluster
    assert conditions(d)["Suspended"]["status"] == "True"
    stopping = run(applied(job(RUNNING, spec, generation=2), d),
                   [*compute(), driver(deleting=True)])
    assert not stopping.actions.delete_cluster and not stopping.actions.delete_driver
    gone = run(applied(job(RUNNING, spec, generation=2), d), compute())
    assert gone.actions.delete_cluster and gone.status["phase"] == "Suspended"
    # A driver stuck terminating on a lost node never goes by itself: it is force-deleted
    # and the compute goes with it.
    lost = {"metadata": {"name": "n1"}, "status": {"conditions": [
        {"type": "Ready", "status": "Unknown"}]}}
    stuck = run(applied(job(RUNNING, spec, generation=2), d),
                [*compute(), driver(deleting=True)], nodes=[lost])
    assert stuck.actions.delete_cluster and "rl-driver" in stuck.actions.delete_pods
    body = applied(job(RUNNING, spec, generation=2), d)
    body["spec"] = SPEC
    # The old driver is still terminating: no restart is counted, nothing new starts.
    resumed = run(body, [*compute(), driver(deleting=True)], cluster=False)
    assert resumed.status["recovery"]["restarts"] == 0
    assert resumed.actions.create_cluster and resumed.actions.create_driver is None
    assert resumed.status["phase"] == "Pending"


def test_a_plan_only_job_says_it_planned_when_its_driver_succeeds() -> None:
    """`spec.planOnly`: the Succeeded job says it stopped after planning, not that it
    completed every step."""
    body = job(RUNNING, spec={**SPEC, "planOnly": True})
    d = run(body, [*compute(), driver(phase="Succeeded")])
    assert d.status["phase"] == "Succeeded"
    (cond,) = [c for c in d.status["conditions"] if c["type"] == "Succeeded"]
    assert "device-plan" in cond["message"] and "every step" not in cond["message"]


def test_succeeded_driver_finishes_the_job_and_terminal_phases_stay() -> None:
    body = job(RUNNING)
    d = run(body, [*compute(), driver(phase="Succeeded")])
    assert d.status["phase"] == "Succeeded" and d.actions.delete_cluster
    body = applied(body, d)
    again = run(body, [driver(phase="Succeeded")], cluster=False)
    assert not needs_write(body["status"], again.status)
    assert not again.actions.create_cluster and again.actions.create_driver is None


# -- start-up deadline -----------------------------------------------------------------------

def waiting(name: str, component: str, reason: str, message: str = "",
            init: bool = False) -> Obj:
    """A pod placed on a node whose container waits, as the kubelet reports it."""
    pod_ = pod(name, component, "Pending")
    pod_["status"]["conditions"] = []
    key = "initContainerStatuses" if init else "containerStatuses"
    pod_["status"][key] = [{"name": "ray-worker", "image": "ghcr.io/x/trainer:9.9",
                            "state": {"waiting": {"reason": reason, "message": message}}}]
    return pod_


def started(d: Decision) -> Obj:
    return conditions(d)["Started"]


@pytest.mark.parametrize(("kubelet", "reason"), [
    ("ErrImagePull", "ImagePullBackOff"), ("ImagePullBackOff", "ImagePullBackOff"),
    ("CrashLoopBackOff", "CrashLoopBackOff"),
    ("CreateContainerConfigError", "CreateContainerConfigError")])
def test_a_container_that_cannot_start_is_named_at_once_then_fails_the_job(
        kubelet: str, reason: str) -> None:
    stuck = waiting("rl-trainer-worker-a", "trainer", kubelet, "manifest unknown",
                    init=kubelet == "CrashLoopBackOff")
    pods = [*compute("rl-trainer-worker-a"), stuck]
    d = run(job(), pods)
    assert d.status["phase"] == "Initializing" and d.status["startingSince"] == iso(T0)
    cond = started(d)
    assert (cond["status"], cond["reason"]) == ("False", reason)
    assert "rl-trainer-worker-a" in cond["message"] and "ray-worker" in cond["message"]
    assert "ghcr.io/x/trainer:9.9" in cond["message"]
    assert f"fails at {iso(T0 + timedelta(seconds=600))}" in cond["message"]
    assert d.requeue_after == 600
    body = applied(job(), d)
    later = run(body, pods, now=T0 + timedelta(seconds=599))
    assert later.status["phase"] == "Initializing" and later.status["startingSince"] == iso(T0)
    assert not needs_write(body["status"], later.status)  # the clock is not re-written
    late = run(body, pods, now=T0 + timedelta(seconds=600))
    assert late.status["phase"] == "Failed" and "startingSince" not in late.status
    failed = conditions(late)["Failed"]
    assert failed["reason"] == reason and "rl-trainer-worker-a" in failed["message"]
    assert "did not start within 600s" in failed["message"]
    assert late.status["recovery"]["lastFailure"]["pod"] == "rl-trainer-worker-a"
    assert late.actions.delete_cluster and late.status["recovery"]["restarts"] == 0


def test_unschedulable_pods_fail_the_job_after_the_deadline() -> None:
    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    pods = [pod("rl-head-a", "head"), pod("rl-trainer-worker-a", "trainer", "Pending",
                                          unschedulable=why)]
    spec = {**SPEC, "recovery": {**SPEC["recovery"], "startupTimeoutSeconds": 60}}
    body = applied(job(spec=spec), run(job(spec=spec), pods))
    assert started(run(body, pods))["reason"] == "Unschedulable"
    d = run(body, pods, now=T0 + timedelta(seconds=61))
    failed = conditions(d)["Failed"]
    assert d.status["phase"] == "Failed" and failed["reason"] == "Unschedulable"
    assert why in failed["message"] and "rl-trainer-worker-a" in failed["message"]


def test_compute_pods_failing_while_starting_read_as_a_crash_loop() -> None:
    body = applied(job(), run(job(), compute("rl-rollout-worker-b")))
    crash = FailureHint("PodFailed", "container exited with code 1 (Error)", exit_code=1,
                        seen_at=iso(T0 + timedelta(seconds=5)))
    older = FailureHint("PodFailed", "exited 137", seen_at=iso(T0 - timedelta(minutes=5)))
    d = run(body, compute("rl-rollout-worker-b"), now=T0 + timedelta(seconds=6),
            hints={"rl-rollout-worker-x": crash, "rl-old": older})
    cond = started(d)
    assert cond["reason"] == "CrashLoop" and "rl-rollout-worker-x" in cond["message"]
    assert "code 1" in cond["message"] and "rl-old" not in cond["message"]
    d = run(body, compute("rl-rollout-worker-b"), now=T0 + timedelta(seconds=6),
            hints={"rl-old": older})  # a failure from before this start-up: not a crash loop
    assert started(d)["reason"] == "Starting"


def test_a_driver_that_never_runs_fails_the_job_and_goes() -> None:
    body = applied(job(), run(job(), compute()))
    pending = driver(phase="Pending")
    pending["status"]["conditions"] = []
    pending["status"]["containerStatuses"] = [
        {"name": "c", "state": {"waiting": {"reason": "ContainerCreating"}}}]
    d = run(body, [*compute(), pending], now=T0 + timedelta(seconds=30))
    cond = started(d)
    assert cond["reason"] == "Starting"
    assert "4 of 4 compute pods run; the driver pod rl-driver is Pending (ContainerCreating)" \
        in cond["message"]
    d = run(body, [*compute(), pending], now=T0 + timedelta(seconds=600))
    failed = conditions(d)["Failed"]
    assert failed["reason"] == "DriverNotStarted" and "ContainerCreating" in failed["message"]
    assert d.actions.delete_driver and d.actions.delete_cluster


def test_no_deadline_with_zero_and_running_clears_the_clock() -> None:
    spec = {**SPEC, "recovery": {**SPEC["recovery"], "startupTimeoutSeconds": 0}}
    stuck = [*compute("rl-head-a"), waiting("rl-head-a", "head", "ImagePullBackOff")]
    d = run(job(spec=spec), stuck, now=T0 + timedelta(days=3))
    assert d.status["phase"] != "Failed" and "no deadline" in started(d)["message"]
    assert d.requeue_after is None
    body = applied(job(), run(job(), compute()))
    d = run(body, [*compute(), driver()], now=T0 + timedelta(seconds=3))
    assert d.status["phase"] == "Running" and "startingSince" not in d.status
    assert (started(d)["status"], started(d)["reason"]) == ("True", "Started")


def test_a_spec_edit_restarts_the_clock() -> None:
    stuck = [*compute("rl-head-a"), waiting("rl-head-a", "head", "ImagePullBackOff")]
    body = applied(job(), run(job(), stuck))
    edited = job(body["status"], generation=2)
    d = run(edited, stuck, now=T0 + timedelta(seconds=500))
    assert d.status["startingSince"] == iso(T0 + timedelta(seconds=500))
    d = run(applied(edited, d), stuck, now=T0 + timedelta(seconds=700))
    assert d.status["phase"] != "Failed"


def test_a_restarts_start_up_begins_when_its_backoff_ends() -> None:
    d = run(job(RUNNING), [*compute("rl-trainer-worker-a"), driver()])
    assert d.status["phase"] == "Recovering"
    assert d.status["startingSince"] == d.status["recovery"]["nextAttemptAt"] == \
        iso(T0 + timedelta(seconds=10))
    assert started(d)["reason"] == "Starting"


# -- objects in the way --------------------------------------------------------------------

OURS = [{"apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "name": "rl", "uid": "u",
         "controller": True}]


def of_cluster(pods: list[Obj], uid: str = "rc-1") -> list[Obj]:
    """Compute pods as KubeRay makes them: controlled by the RayCluster with `uid`."""
    out = copy.deepcopy(pods)
    for p in out:
        p["metadata"]["ownerReferences"] = [{"kind": "RayCluster", "name": "rl", "uid": uid,
                                             "controller": True}]
    return out


def decide_owned(body: Obj, rc: Obj | None, pods: list[Obj],
                 in_the_way: InTheWay | None = None, now: datetime = T0) -> Decision:
    """A decision on what observe makes of the children when it knows the job's UID."""
    pods, rc = built(body, pods, rc)
    obs = observe("rl", rc, pods, [READY_NODE], uid="u", in_the_way=in_the_way)
    return decide(parse_job(body), obs, now)


def test_a_raycluster_of_the_jobs_name_that_is_not_its_own_blocks_the_job() -> None:
    foreign = {"metadata": {"name": "rl", "uid": "rc-x", "ownerReferences": [
        {"kind": "RLJob", "name": "rl", "uid": "an-earlier-rl", "controller": True}]}}
    d = decide_owned(job(), foreign, [])
    assert d.status["phase"] == "Pending"
    assert d.actions == Actions()  # nothing created, patched or deleted
    ready, start = conditions(d)["Ready"], started(d)
    assert ready["reason"] == start["reason"] == "ObjectInTheWay"
    assert "RayCluster ns/rl exists and is not this RLJob's (owned by RLJob rl (uid " \
           "an-earlier-rl))" in ready["message"]
    assert d.event is not None and d.event.type == "Warning"
    body = applied(job(), d)
    assert decide_owned(body, foreign, []).event is None  # said once
    late = decide_owned(body, foreign, [], now=T0 + timedelta(seconds=600))
    assert late.status["phase"] == "Failed"
    assert conditions(late)["Failed"]["reason"] == "ObjectInTheWay"
    assert not late.actions.delete_cluster  # never someone else's
    mine = {"metadata": {"name": "rl", "uid": "rc-1", "ownerReferences": OURS}}
    assert decide_owned(job(), mine, of_cluster(compute())).actions.create_driver is not None


def test_a_driver_pod_name_taken_by_someone_else_blocks_and_is_left_alone() -> None:
    mine = {"metadata": {"name": "rl", "uid": "rc-1", "ownerReferences": OURS}}
    squatter = pod("rl-driver", "driver")
    d = decide_owned(job(RUNNING), mine, [*of_cluster(compute()), squatter])
    assert started(d)["reason"] == "ObjectInTheWay"
    assert "Pod ns/rl-driver exists" in started(d)["message"]
    assert "it has no owner" in started(d)["message"]
    assert not d.actions.delete_driver and d.actions.create_driver is None


def test_an_object_found_by_a_create_blocks_until_it_is_gone() -> None:
    found = InTheWay("ConfigMap", "rl-spec", "it has no owner")
    mine = {"metadata": {"name": "rl", "uid": "rc-1", "ownerReferences": OURS}}
    d = decide_owned(job(), None, [], in_the_way=found)
    assert "ConfigMap ns/rl-spec" in conditions(d)["Ready"]["message"]
    assert not d.actions.create_cluster
    assert decide_owned(applied(job(), d), None, []).actions.create_cluster
    assert decide_owned(job(), mine, of_cluster(compute())).actions.create_driver is not None


def test_pods_of_another_raycluster_are_not_this_jobs() -> None:
    mine = {"metadata": {"name": "rl", "uid": "rc-1", "ownerReferences": OURS}}
    old = pod("rl-trainer-worker-old", "trainer")
    old["metadata"]["ownerReferences"] = [{"kind": "RayCluster", "uid": "rc-0",
                                           "controller": True}]
    obs = observe("rl", mine, [*of_cluster(compute()), old], [READY_NODE], uid="u")
    assert "rl-trainer-worker-old" not in {p.name for p in obs.compute}
    assert len(obs.compute) == len(COMPUTE)


def test_a_pod_that_only_wears_the_jobs_labels_is_not_its_compute_pod() -> None:
    """Made by hand with the job's labels and owned by nobody: never counted, replaced or
    deleted as one of the job's pods (it has no revision: taken for the job's, it would be
    replaced as outdated, i.e. deleted)."""
    mine = {"metadata": {"name": "rl", "uid": "rc-1", "ownerReferences": OURS}}
    fake = pod("rl-rollout-worker-fake", "rollout", annotations={"rljob.io/revision": "x"})
    ours = driver()
    ours["metadata"]["ownerReferences"] = OURS
    d = decide_owned(job(RUNNING), mine, [*of_cluster(compute()), ours, fake])
    assert "rl-rollout-worker-fake" not in {*d.actions.replace_pods, *d.actions.delete_pods}
    assert d.status["phase"] == "Running"


# -- spec edits on a running job --------------------------------------------------------------

def edited(changes: Obj, status: Obj = RUNNING) -> tuple[Obj, Obj]:
    """The job before (generation 1) and after an edit merging `changes` into its spec."""
    before = job(status)
    spec = copy.deepcopy(SPEC)
    for key, value in changes.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return before, job({**status, "observedGeneration": 1}, spec=spec, generation=2)


def test_a_runtime_field_edit_restarts_only_the_driver_and_is_no_failure() -> None:
    before, after = edited({"algorithm": {"lr": 3e-6}})
    pods, rc = built(before, [*compute(), driver()], {"metadata": {"name": "rl"}})
    d = decide(parse_job(after), observe("rl", rc, pods, [READY_NODE]), T0)
    assert d.status["phase"] == "Initializing" and d.status["observedGeneration"] == 2
    assert d.actions.delete_driver and not d.actions.patch_cluster
    assert d.actions.replace_pods == () and d.actions.create_driver is None
    ready = conditions(d)["Ready"]
    assert ready["reason"] == "ApplyingSpecChange" and "generation 2" in ready["message"]
    assert "restarts from the latest checkpoint" in ready["message"]
    assert d.event is not None and d.event.reason == "SpecChanged"
    assert d.restart is None and d.status["recovery"]["restarts"] == 0
    # The old driver is gone: a new one starts on the same compute pods, then runs.
    body = applied(after, d)
    d = decide(parse_job(body), observe("rl", rc, pods[:-1], [READY_NODE]), T0)
    assert d.actions.create_driver == tuple(sorted(n for n, c in COMPUTE if c != "rollout"))
    d = run(applied(body, d), [*pods[:-1], driver()])
    assert d.status["phase"] == "Running" and d.status["recovery"]["restarts"] == 0
    assert not d.actions.delete_driver


def test_a_compute_field_edit_patches_the_raycluster_and_replaces_changed_pods() -> None:
    before, after = edited({"rollout": {"engines": 2, "gpusPerEngine": 1, "image": "r:2"}})
    old_pods, rc = built(before, [*compute(), driver()], {"metadata": {"name": "rl"}})
    d = decide(parse_job(after), observe("rl", rc, old_pods, [READY_NODE]), T0)
    # The driver stops first (it saves on SIGTERM, with the pods it runs on)...
    assert d.actions.delete_driver and not d.actions.patch_cluster
    assert d.actions.replace_pods == ()
    assert "patching the RayCluster" in conditions(d)["Ready"]["message"]
    # ... and once its pod is gone the RayCluster is patched and the changed pods replaced.
    no_driver = old_pods[:-1]
    d = decide(parse_job(applied(after, d)), observe("rl", rc, no_driver, [READY_NODE]), T0)
    assert d.actions.patch_cluster and not d.actions.delete_driver
    assert set(d.actions.replace_pods) == {"rl-rollout-worker-a", "rl-rollout-worker-b"}
    # Patched and replaced: the new rollout pods start, and only then a new driver.
    new_rc = built(after, [], {"metadata": {"name": "rl"}})[1]
    fresh, _ = built(after, [pod("rl-rollout-worker-c", "rollout"),
                             pod("rl-rollout-worker-d", "rollout")], None)
    keep = [p for p in old_pods if p["metadata"]["labels"]["rljob.io/component"]
            in ("head", "trainer")]
    body = applied(after, d)
    waiting = decide(parse_job(body), observe("rl", new_rc, keep, [READY_NODE]), T0)
    assert waiting.actions.create_driver is None
    d = decide(parse_job(body), observe("rl", new_rc, [*keep, *fresh], [READY_NODE]), T0)
    assert not d.actions.patch_cluster and d.actions.replace_pods == ()
    assert d.actions.create_driver is not None


def test_scaling_waits_for_exactly_the_new_count_before_the_driver_starts() -> None:
    before, after = edited({"trainer": {"replicas": 2, "gpusPerReplica": 2}})
    old_pods, rc = built(before, [*compute(), driver()], {"metadata": {"name": "rl"}})
    d = decide(parse_job(after), observe("rl", rc, old_pods, [READY_NODE]), T0)
    assert d.actions.delete_driver and not d.actions.patch_cluster  # the driver stops first
    body = applied(after, d)
    no_driver = [p for p in old_pods if p["metadata"]["name"] != "rl-driver"]
    d = decide(parse_job(body), observe("rl", rc, no_driver, [READY_NODE]), T0)
    assert d.actions.patch_cluster and d.actions.replace_pods == ()  # same template
    body = applied(body, d)
    new_rc = built(after, [], {"metadata": {"name": "rl"}})[1]
    one = [p for p in old_pods if p["metadata"]["name"] != "rl-driver"]
    d = decide(parse_job(body), observe("rl", new_rc, one, [READY_NODE]), T0)
    assert d.actions.create_driver is None  # 1 of 2 trainers
    two, _ = built(after, [*one, pod("rl-trainer-worker-b", "trainer")], None)
    d = decide(parse_job(body), observe("rl", new_rc, two, [READY_NODE]), T0)
    # head and 2 trainers recorded; the rollout pods are not (`attempt_pods`)
    assert d.actions.create_driver is not None and len(d.actions.create_driver) == 3
    # Scaling back down: a pod about to be removed never joins an attempt.
    down = job(applied(body, d)["status"], spec=before["spec"], generation=3)
    d = decide(parse_job(down), observe("rl", new_rc, two, [READY_NODE]), T0)
    assert d.actions.patch_cluster and d.actions.create_driver is None


def test_an_operator_field_edit_restarts_nothing() -> None:
    before, after = edited({"recovery": {"maxRestarts": 7, "backoffSeconds": 1,
                                         "maxBackoffSeconds": 1, "startupTimeoutSeconds": 60}})
    pods, rc = built(before, [*compute(), driver()], {"metadata": {"name": "rl"}})
    d = decide(parse_job(after), observe("rl", rc, pods, [READY_NODE]), T0)
    assert d.status["phase"] == "Running" and d.status["recovery"]["maxRestarts"] == 7
    assert d.actions == Actions() and d.event is None


# -- slow pods and nodes that are not Ready -------------------------------------------------

SHORT = {**SPEC, "recovery": {**SPEC["recovery"], "startupTimeoutSeconds": 60}}


def not_ready(p: Obj) -> Obj:
    """A running pod whose Ready condition went False (a readiness probe, or the node
    controller after its node stopped reporting)."""
    p["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    return p


def node(name: str, status: str, since: datetime | None) -> Obj:
    cond: Obj = {"type": "Ready", "status": status}
    if since is not None:
        cond["lastTransitionTime"] = iso(since)
    return {"metadata": {"name": name}, "status": {"conditions": [cond]}}


def on_n2(name: str, ready: bool = True, deleting: bool = False) -> list[Obj]:
    """The compute pods, `name` bound to node n2 (not Ready, being deleted, as asked), the
    others to n1."""
    out = [pod(n, c, node="n1") for n, c in COMPUTE if n != name]
    moved = pod(name, dict(COMPUTE)[name], node="n2", deleting=deleting)
    return [*out, moved if ready else not_ready(moved)]


def test_a_running_driver_outlasts_a_not_ready_pod_past_the_startup_timeout() -> None:
    body = applied(job(RUNNING, SHORT), run(job(RUNNING, SHORT), [*compute(), driver()]))
    slow = [*compute("rl-trainer-worker-a"), not_ready(pod("rl-trainer-worker-a", "trainer"))]
    first = run(body, [*slow, driver()], now=T0 + timedelta(seconds=1))
    assert first.status["phase"] == "Running" and "startingSince" not in first.status
    ready = conditions(first)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "PodsNotReady")
    assert "rl-trainer-worker-a (Running, not Ready)" in ready["message"]
    assert started(first)["status"] == "True"
    assert first.event is not None and (first.event.type, first.event.reason) == (
        "Warning", "PodsNotReady")
    assert first.requeue_after is None
    body = applied(body, first)
    # An hour later, far past startupTimeoutSeconds: still Running, nothing deleted.
    later = run(body, [*slow, driver()], now=T0 + timedelta(hours=1))
    assert later.status["phase"] == "Running" and later.restart is None
    assert later.actions == Actions() and later.event is None
    assert not needs_write(body["status"], later.status)
    back = run(body, [*compute(), driver()], now=T0 + timedelta(hours=1, seconds=5))
    assert conditions(back)["Ready"]["status"] == "True"
    assert back.event is not None and back.event.reason == "PodsReady"


def test_a_restarted_driver_runs_while_a_pod_is_slow_to_come_back() -> None:
    """A restart whose driver runs has started: a pod slow to be Ready (its container still
    being created, an image being pulled) is reported, and no deadline fails the job."""
    status = {**RUNNING, "phase": "Recovering", "startingSince": iso(T0),
              "recovery": {"restarts": 1, "maxRestarts": 2}}
    creating = waiting("rl-rollout-worker-b", "rollout", "ContainerCreating")
    pods = [*compute("rl-rollout-worker-b"), creating, driver(restarts=1)]
    d = run(job(status, SHORT), pods, now=T0 + timedelta(minutes=30))
    assert d.status["phase"] == "Running" and d.actions == Actions()
    assert "rl-rollout-worker-b (Pending: ContainerCreating)" in conditions(d)["Ready"]["message"]
    assert d.event is not None and d.event.reason == "Resumed"
    assert "ContainerCreating" in d.event.message


def test_a_never_started_job_stuck_in_image_pull_still_fails_at_its_deadline() -> None:
    stuck = [*compute("rl-head-a"), waiting("rl-head-a", "head", "ImagePullBackOff")]
    body = applied(job(spec=SHORT), run(job(spec=SHORT), stuck))
    d = run(body, stuck, now=T0 + timedelta(seconds=61))
    assert d.status["phase"] == "Failed"
    assert conditions(d)["Failed"]["reason"] == "ImagePullBackOff"


def test_node_outages_count_as_lost_after_the_bound_or_at_once_when_gone() -> None:
    pods = [*on_n2("rl-trainer-worker-a"), driver()]
    nodes = [READY_NODE, node("n2", "Unknown", T0)]
    early = observe("rl", None, pods, nodes, now=T0 + timedelta(seconds=119),
                    node_lost_after=120)
    assert early.lost_nodes == frozenset() and set(early.pending_losses()) == {"n2"}
    assert early.outages["n2"].lost_at == T0 + timedelta(seconds=120)
    due = observe("rl", None, pods, nodes, now=T0 + timedelta(seconds=120), node_lost_after=120)
    assert due.lost_nodes == {"n2"} and due.pending_losses() == {}
    gone = observe("rl", None, pods, [READY_NODE], now=T0, node_lost_after=120)
    assert gone.lost_nodes == {"n2"}
    # A condition without a time cannot be debounced; 0 turns debouncing off.
    untimed = observe("rl", None, pods, [READY_NODE, node("n2", "False", None)], now=T0,
                      node_lost_after=120)
    assert untimed.lost_nodes == {"n2"}
    assert observe("rl", None, pods, nodes, now=T0, node_lost_after=0).lost_nodes == {"n2"}


def test_a_brief_node_not_ready_costs_nothing() -> None:
    body = applied(job(RUNNING), run(job(RUNNING), [*compute(), driver()]))
    pods = [*on_n2("rl-trainer-worker-a", ready=False), driver()]
    nodes = [READY_NODE, node("n2", "Unknown", T0)]
    d = run(body, pods, now=T0 + timedelta(seconds=30), nodes=nodes, lost_after=120)
    assert d.status["phase"] == "Running" and d.restart is None
    assert d.actions == Actions()  # no pod deleted
    message = conditions(d)["Ready"]["message"]
    assert f"node n2 is not Ready (Unknown) since {iso(T0)}" in message
    assert f"count as lost at {iso(T0 + timedelta(seconds=120))}" in message
    assert d.requeue_after == 90  # looked at again when the bound expires
    body = applied(body, d)
    back = run(body, [*compute(), driver()], now=T0 + timedelta(seconds=60))
    assert back.status["phase"] == "Running" and back.actions == Actions()
    assert back.status["recovery"]["restarts"] == 0


def test_a_node_not_ready_past_the_bound_is_lost_and_its_pods_force_deleted() -> None:
    pods = [*on_n2("rl-trainer-worker-a"), driver()]
    nodes = [READY_NODE, node("n2", "Unknown", T0)]
    d = run(job(RUNNING), pods, now=T0 + timedelta(seconds=120), nodes=nodes, lost_after=120)
    last = d.status["recovery"]["lastFailure"]
    assert (last["reason"], last["pod"]) == ("NodeLost", "rl-trainer-worker-a")
    assert last["message"] == f"node n2 is not Ready (Unknown) since {iso(T0)}"
    assert d.actions.delete_pods == ("rl-trainer-worker-a",) and d.actions.delete_driver


def test_pods_going_anyway_on_a_node_not_ready_are_force_deleted_at_once() -> None:
    """A pod the operator deleted (its worker was lost) on a node that is not Ready: no
    kubelet finishes its deletion, and its replacement waits for it."""
    status = {**RUNNING, "phase": "Recovering", "startingSince": iso(T0),
              "recovery": {"restarts": 1, "maxRestarts": 2}}
    pods = on_n2("rl-trainer-worker-a", ready=False, deleting=True)
    nodes = [READY_NODE, node("n2", "Unknown", T0)]
    d = run(job(status), pods, now=T0 + timedelta(seconds=5), nodes=nodes, lost_after=120)
    assert d.actions.delete_pods == ("rl-trainer-worker-a",)
    # Not being deleted: left alone until the bound, and the start-up says what it waits for.
    d = run(job(status), on_n2("rl-trainer-worker-a", ready=False),
            now=T0 + timedelta(seconds=5), nodes=nodes, lost_after=120)
    assert d.actions.delete_pods == () and d.requeue_after == 115
    assert "node n2 is not Ready (Unknown)" in started(d)["message"]


def test_a_worker_ray_lost_on_a_node_not_ready_is_node_lost_and_goes_at_once() -> None:
    status = {**RUNNING, "runtimeFailure": lost_worker_report("rl-trainer-worker-a")}
    nodes = [READY_NODE, node("n2", "Unknown", T0)]
    d = run(job(status), [*on_n2("rl-trainer-worker-a"), exited(1)],
            now=T0 + timedelta(seconds=30), nodes=nodes, lost_after=120)
    last = d.status["recovery"]["lastFailure"]
    assert (last["reason"], last["pod"]) == ("NodeLost", "rl-trainer-worker-a")
    assert d.actions.replace_pods == ("rl-trainer-worker-a",) and not d.actions.delete_pods


def test_a_recoverys_slow_replacement_pod_restarts_again_never_fails_the_job() -> None:
    """A job that ran before, recovering, whose replacement pod is still being created past
    the start-up deadline (a large image on a fresh node): restarted again, counted, with
    the reason; failed only once its restarts are used up."""
    body = applied(job(RUNNING), run(job(RUNNING), [*compute("rl-trainer-worker-a"),
                                                    driver()]))
    assert body["status"]["phase"] == "Recovering"
    slow = [*compute("rl-trainer-worker-a"),
            waiting("rl-trainer-worker-b", "trainer", "ContainerCreating")]
    since = datetime.fromisoformat(body["status"]["startingSince"].replace("Z", "+00:00"))
    timeout = RLJobSpec.model_validate(SPEC).recovery.startup_timeout_seconds
    late = since + timedelta(seconds=timeout + 1)
    d = run(body, slow, now=late)
    assert d.status["phase"] == "Recovering", d.status
    recovery = d.status["recovery"]
    assert recovery["restarts"] == body["status"]["recovery"]["restarts"] + 1
    assert recovery["lastFailure"]["reason"] == "StartupTimeout"
    assert "did not start within" in recovery["lastFailure"]["message"]
    assert not d.actions.delete_cluster  # the pod keeps pulling; the next attempt waits
    spent = copy.deepcopy(body)
    spent["status"]["recovery"]["restarts"] = SPEC["recovery"]["maxRestarts"]
    d = run(spent, slow, now=late)
    assert d.status["phase"] == "Failed"
    assert conditions(d)["Failed"]["reason"] == "RestartLimitExceeded"


# -- hand edits (the control-plane test is test_operator_chaos.py) ----------------------------

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
