"""Phase choice: (stored RLJob, observed children, now) → the job's phase and its Decision.

Level-based: the decision depends only on the RLJob as stored (spec and status) and on what
exists now, never on which event woke the operator, so a restarted operator picks up
exactly where the previous one stopped. All durable state lives in `status` (restart count,
backoff deadline) and in the driver pod's annotations (its attempt and the compute pods it
started with).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from rljob_api.layout import ROLLOUT
from rljob_api.spec import FailureKind, RLJobSpec
from rljob_api.status import (
    MESSAGE_MAX,
    TERMINAL_PHASES,
    Condition,
    Phase,
    RecoveryStatus,
    parse_timestamp,
    timestamp,
)
from rljob_api.status import Failure as LastFailure
from rljob_operator import names
from rljob_operator.admission import gate, queue_condition, stopped, workload_step
from rljob_operator.builders import worker_groups
from rljob_operator.decision import Actions, Decision, Event
from rljob_operator.failures import (
    Failure,
    Problem,
    detect_failure,
    pod_list,
    startup_problem,
    unshared_claim_message,
)
from rljob_operator.observe import InTheWay, Observed, PodView
from rljob_operator.situation import JobView, Situation
from rljob_operator.status import (
    STARTED_MESSAGE,
    STARTING_PHASES,
    build_status,
    condition,
    held_step,
    not_ready,
    operator_fields,
    recovery_status,
    scheduling_conditions,
    started_condition,
    waiting_for,
)

Obj = dict[str, Any]


def decide(job: JobView, obs: Observed, now: datetime) -> Decision:
    """The operator's status fields and next actions for one job."""
    s = Situation.of(job, obs, now)
    decision = queue_condition(s, _decide_phase(s, job, obs))
    step = workload_step(s, decision)
    if step is not None:
        decision = replace(decision, actions=replace(decision.actions, workload=step.value))
    return replace(decision, hold_step=held_step(job.status, decision.restarts))


def _decide_phase(s: Situation, job: JobView, obs: Observed) -> Decision:
    if s.phase in TERMINAL_PHASES:
        if finished(s.stored):
            return _terminal(s)
        decision = _decide(replace(s, phase=None), job, obs)
        message = (f"status.phase {s.phase} was not decided by the operator (no {s.phase}=True "
                   "condition with it): the phase is decided again from the job's children")
        return replace(decision, event=Event("Warning", "StatusRepaired", message))
    return _decide(s, job, obs)


def finished(status: Obj) -> bool:
    """Whether a terminal phase is the operator's: it writes Succeeded or Failed only with
    the condition of that name True and finishedAt, in one write. A terminal phase without
    them was written by hand (or by a runtime gone wrong, through the status subresource)
    and is not believed: taken at face value, it would tear down the compute of a job that
    runs, for good."""
    phase = status.get("phase")
    conds = [c for c in status.get("conditions") or []
             if c.get("type") == phase and c.get("status") == "True"]
    return bool(conds) and parse_timestamp(status.get("finishedAt")) is not None


def _decide(s: Situation, job: JobView, obs: Observed) -> Decision:
    """The decision of a job that has not finished."""
    if job.spec is None:
        return _fail(s, "InvalidSpec", job.spec_error or "the spec is invalid")
    runtime = job.status.get("runtimeFailure")
    if runtime and runtime.get("retryable") is False:
        return _fail(s, str(runtime.get("reason") or "RuntimeFailure"),
                     str(runtime.get("message") or "the runtime stopped the job"))
    if job.spec.scheduling.suspend:
        return _suspended(s)
    queued = gate(s)
    if queued is not None:
        return queued
    if obs.in_the_way is not None:
        return _blocked(s, obs.in_the_way)
    modes = obs.checkpoint_modes
    if modes is not None and "ReadWriteMany" not in modes:
        return _fail(s, "CheckpointVolumeNotShared", unshared_claim_message(
            str(job.spec.checkpoint.pvc), modes))
    return _active(s)


def backoff_seconds(spec: RLJobSpec, restart: int) -> int:
    """Delay before restart number `restart` (1-based): doubling, capped."""
    rec = spec.recovery
    return int(min(rec.backoff_seconds * 2 ** max(0, restart - 1), rec.max_backoff_seconds))


# -- terminal and special phases -----------------------------------------------------------


def _terminal(s: Situation) -> Decision:
    """Succeeded/Failed stay so; compute is torn down, the driver pod kept for its logs."""
    status = operator_fields(s.stored)
    status["observedGeneration"] = s.job.generation
    return Decision(status, Actions(delete_cluster=s.obs.cluster == "present"))


def _transition_event(s: Situation, phase: str, type_: str, message: str) -> Event | None:
    return None if phase == s.phase else Event(type_, phase, message)


def _fail(s: Situation, reason: str, message: str,
          last_failure: LastFailure | None = None) -> Decision:
    status = build_status(s, Phase.failed.value, [
        condition(s, "Ready", "False", reason, message),
        condition(s, "Failed", "True", reason, message),
    ], recovery_status(s, None, last_failure=last_failure), finished=True)
    return Decision(
        status,
        Actions(delete_cluster=s.obs.cluster == "present"),
        _transition_event(s, Phase.failed.value, "Warning", f"{reason}: {message}"),
    )


def _succeed(s: Situation) -> Decision:
    message = ("the driver placed every process, reported its devices (its log's "
               "device-plan lines) and stopped: spec.planOnly"
               if s.job.spec is not None and s.job.spec.plan_only
               else "the driver completed every step")
    status = build_status(s, Phase.succeeded.value, [
        condition(s, "Ready", "False", "Succeeded", message),
        condition(s, "Succeeded", "True", "DriverSucceeded", message),
    ], recovery_status(s, None), finished=True)
    return Decision(status, Actions(delete_cluster=s.obs.cluster == "present"),
                    _transition_event(s, Phase.succeeded.value, "Normal", message))


def _suspended(s: Situation) -> Decision:
    """The driver goes first (on SIGTERM its runtime finishes the step and saves, which needs
    the trainers and engines); the RayCluster only once the driver pod is gone."""
    return stopped(s, Phase.suspended.value, "Suspended",
                   "spec.scheduling.suspend is true: checkpoints are kept",
                   queued=False)


def _blocked(s: Situation, found: InTheWay) -> Decision:
    """A child's name is taken by an object this job does not own: nothing is created,
    adopted, patched or deleted; the conditions name the object, and the start-up deadline
    runs (an object nobody removes fails the job like any other blocked start)."""
    problem = Problem("ObjectInTheWay", found.describe(s.job.namespace))
    recovering = s.phase == Phase.recovering.value
    phase = s.phase if s.phase is not None and s.phase in STARTING_PHASES \
        else Phase.pending.value
    next_at = s.recovery.next_attempt_at if recovering else None
    since = s.starting_since(next_at)
    deadline = s.deadline(since)
    if deadline is not None and s.now >= deadline:
        return _startup_failed(s, since, problem)
    rec = recovery_status(s, problem.reason if recovering else None, next_at)
    status = build_status(s, phase, [
        condition(s, "Ready", "False", problem.reason, problem.message),
        *scheduling_conditions(s),
        started_condition(s, since, problem),
    ], rec, since=since)
    ready: Obj = next((c for c in s.stored.get("conditions") or []
                       if c.get("type") == "Ready"), {})
    event = None
    if ready.get("reason") != problem.reason or ready.get("message") != problem.message:
        event = Event("Warning", problem.reason, problem.message)
    left = (deadline - s.now).total_seconds() if deadline is not None else None
    return Decision(status, Actions(), event, left)


# -- failures and recovery -----------------------------------------------------------------


def _recover_or_fail(s: Situation, failure: Failure, retried_always: bool = False
                     ) -> Decision:
    """A restart after `failure` (with backoff), or Failed when the failure is not retried
    (`retried_always`: whatever spec.recovery.retryOn says) or the restarts are used up."""
    spec = s.spec
    last = LastFailure(reason=failure.kind, message=failure.message[:MESSAGE_MAX],
                       time=timestamp(s.now))
    if failure.pod is not None:
        last.pod = failure.pod
    if not failure.retryable:
        return _fail(s, failure.kind, f"{failure.message} (pod {failure.pod})", last)
    retried = set(spec.recovery.retry_on)
    if FailureKind.node_lost in retried:
        # What Ray sees first of a lost node; it is renamed NodeLost once Kubernetes agrees.
        retried.add(FailureKind.worker_lost)
    if failure.kind not in retried and not retried_always:
        return _fail(s, failure.kind, f"{failure.message} (pod {failure.pod}); "
                     f"{failure.kind} is not in spec.recovery.retryOn", last)
    if s.restarts >= spec.recovery.max_restarts:
        return _fail(
            s, "RestartLimitExceeded",
            f"{failure.kind} of pod {failure.pod}: {failure.message}; all "
            f"{spec.recovery.max_restarts} restarts (spec.recovery.maxRestarts) are used",
            last,
        )
    restart = s.restarts + 1
    delay = backoff_seconds(spec, restart)
    progress = s.stored.get("progress") or {}
    if "rolloutStep" in progress:
        # What the runtime had reported: lostSteps is measured from here once the next
        # attempt says where it resumed.
        last.step = int(progress["rolloutStep"])
    s = replace(s, restarts=restart)  # the status is of the attempt that comes next
    rec = recovery_status(s, "WaitingForBackoff",
                          timestamp(s.now + timedelta(seconds=delay)), last)
    message = (f"{failure.kind} (pod {failure.pod}): {failure.message}; restart "
               f"{restart}/{spec.recovery.max_restarts} in {delay}s; the runtime resumes "
               "from its latest verified checkpoint")
    since = s.starting_since(rec.next_attempt_at)
    status = build_status(s, Phase.recovering.value, [
        condition(s, "Ready", "False", failure.kind, message),
        *scheduling_conditions(s),
        started_condition(s, since, None),
    ], rec, since=since)
    driver = s.obs.driver
    stranded = s.stranded_pods()
    failed = tuple(p.name for p in s.obs.compute if p.failure is not None)
    lost: tuple[str, ...] = ()
    if failure.kind in {FailureKind.worker_lost.value, FailureKind.node_lost.value}:
        # Ray lost the pod's node, whether or not Kubernetes counts the pod lost yet: it is
        # deleted so that no attempt starts on it, gracefully; once it is terminating on a
        # node that is not Ready, it is force-deleted as stranded.
        lost = tuple(p.name for p in s.obs.compute if p.name == failure.pod
                     and not p.deleting and p.name not in stranded)
    actions = Actions(
        create_cluster=s.obs.cluster == "absent",
        delete_driver=driver is not None and not driver.deleting,
        delete_pods=tuple(sorted(set(stranded) | set(failed))),
        replace_pods=lost,
    )
    node_due = s.next_node_loss()
    return Decision(status, actions, Event("Warning", "Recovering", message),
                    requeue_after=float(delay) if node_due is None else min(delay, node_due),
                    restart=failure)


def _startup_failed(s: Situation, since: str, problem: Problem | None) -> Decision:
    """Past the start-up deadline: Failed with what blocked it, or, for a job recovering
    from a failure (it ran before), restarted again like any failure, counted against
    spec.recovery.maxRestarts: a replacement pod on a fresh node may pull a large image
    for longer than a first start does, and a job that trained for days should not be
    failed for good by one slow pod. Only an attempt whose driver has not started running
    gets here (`_progressing`): a running driver is never failed for a slow or NotReady
    pod."""
    timeout = s.spec.recovery.startup_timeout_seconds
    if problem is None:
        driver = s.obs.driver
        reason = ("DriverNotStarted" if driver is not None and s.compute_ready()
                  else "StartupTimeout")
        problem = Problem(reason, waiting_for(s), driver.name if driver is not None else None)
    message = (f"the job did not start within {timeout}s of {since} "
               f"(spec.recovery.startupTimeoutSeconds): {problem.message}")
    if s.phase == Phase.recovering.value:
        return _recover_or_fail(s, Failure(problem.reason, message, problem.pod),
                                retried_always=True)
    last = LastFailure(reason=problem.reason, message=message[:MESSAGE_MAX],
                       time=timestamp(s.now))
    if problem.pod:
        last.pod = problem.pod
    decision = _fail(s, problem.reason, message, last)
    driver = s.obs.driver
    # A driver that never got going is no evidence: it goes, with what it holds.
    stop = driver is not None and not driver.deleting and driver.phase in {"Pending", "Running"}
    return replace(decision, actions=replace(decision.actions, delete_driver=stop))


# -- the normal path -----------------------------------------------------------------------


def _active(s: Situation) -> Decision:
    """A job that should run: its attempt succeeded, failed, or is on its way."""
    driver = s.obs.driver
    # A driver of an earlier attempt, or one built from an earlier spec, is replaced.
    stale = driver is not None and (driver.restarts != s.restarts or s.driver_outdated(driver))
    attempt = driver if driver is not None and not stale and not driver.deleting else None
    running = s.phase == Phase.running.value
    if attempt is not None and attempt.phase == "Succeeded":
        return _succeed(s)
    failure = None
    if attempt is not None:
        failure = detect_failure(attempt, s.obs, s.stored.get("runtimeFailure"))
    elif running and (driver is None or (driver.deleting and not stale)):
        failure = Failure(FailureKind.pod_deleted.value, "the driver pod was deleted",
                          names.driver_name(s.job.name))
    if failure is not None:
        return _recover_or_fail(s, failure)
    return _progressing(s, driver, attempt, stale)


def attempt_pods(s: Situation) -> tuple[str, ...]:
    """The compute pods whose loss ends the attempt the new driver starts: every live one,
    but rollout pods when the runtime replaces lost engines itself
    (`RLJobSpec.replaces_engines`): KubeRay recreates such a pod, the driver starts its
    engine again in it, and training goes on."""
    spec = s.job.spec
    spared = spec is not None and spec.replaces_engines()
    return tuple(p.name for p in s.live() if not (spared and p.component == ROLLOUT))


def _progressing(s: Situation, driver: PodView | None, attempt: PodView | None,
                 stale: bool) -> Decision:
    """Pending, Initializing, Running or Recovering: what the attempt waits for, and the
    steps that bring it closer."""
    recovering = s.phase == Phase.recovering.value
    ready = s.compute_ready()
    create_driver: tuple[str, ...] | None = None
    requeue: float | None = None
    next_at = s.recovery.next_attempt_at if recovering else None
    waiting_phase = Phase.recovering.value if recovering else (
        Phase.initializing.value if s.all_scheduled() else Phase.pending.value)
    if attempt is not None and attempt.phase == "Running":
        # The attempt has started: its driver runs (it is only made once every compute pod
        # runs). From here the start-up deadline no longer applies: a compute pod that turns
        # NotReady or is slow to come back is reported (Ready=False/PodsNotReady), not
        # failed; if the runtime cannot do without it, the driver fails and the job restarts.
        phase, action, next_at = Phase.running.value, None, None
    elif attempt is not None:
        phase, action = waiting_phase, "StartingDriver"
        if not recovering:
            phase = Phase.initializing.value
    elif driver is not None:
        phase, action = waiting_phase, "StoppingDriver"
    elif not ready:
        phase, action = waiting_phase, "WaitingForPods"
    else:
        due = parse_timestamp(next_at)
        if recovering and due is not None and s.now < due:
            phase, action = waiting_phase, "WaitingForBackoff"
            requeue = (due - s.now).total_seconds()
        else:
            phase, action = waiting_phase, "StartingDriver"
            if not recovering:
                phase = Phase.initializing.value
            create_driver = attempt_pods(s)
    if not recovering and phase != Phase.running.value:
        action = None
    rec = recovery_status(s, action, next_at)
    ready_cond = condition(s, "Ready", "True", "Running", "the driver and every compute pod run")
    started = condition(s, "Started", "True", "Started", STARTED_MESSAGE)
    since: str | None = None
    change = _spec_change(s, driver)
    node_due = s.next_node_loss()
    if node_due is not None:
        requeue = node_due if requeue is None else min(requeue, node_due)
    unready = not_ready(s) if phase == Phase.running.value else None
    if unready is not None:
        ready_cond = condition(s, "Ready", "False", "PodsNotReady", unready)
    if phase != Phase.running.value:
        ready_cond = condition(s, "Ready", "False", action or phase, f"phase {phase}")
        if change is not None:
            ready_cond = condition(s, "Ready", "False", "ApplyingSpecChange", change)
        since = s.starting_since(next_at if recovering else None)
        problem = startup_problem(s.obs, s.job.name, s.spec, since)
        deadline = s.deadline(since)
        if deadline is not None and s.now >= deadline:
            return _startup_failed(s, since, problem)
        if deadline is not None:
            left = (deadline - s.now).total_seconds()
            requeue = left if requeue is None else min(requeue, left)
        started = started_condition(s, since, problem)
    status = build_status(s, phase, [ready_cond, *scheduling_conditions(s), started], rec,
                          since=since)
    # A driver that is stopping for a spec change saves the step in progress on SIGTERM,
    # which needs the trainers and engines: compute changes wait until its pod is gone.
    stopping = driver is not None and (stale or s.driver_outdated(driver))
    actions = Actions(
        create_cluster=s.obs.cluster == "absent",
        create_driver=create_driver,
        delete_driver=stale and driver is not None and not driver.deleting,
        delete_pods=s.stranded_pods(),
        patch_cluster=s.cluster_outdated() and not stopping,
        replace_pods=() if stopping else tuple(p for p in s.outdated_pods()
                                               if p not in s.stranded_pods()),
    )
    event = _phase_event(s, phase, rec) or _readiness_event(s, ready_cond)
    if event is not None and unready is not None and event.reason != "PodsNotReady":
        event = replace(event, message=f"{event.message}; {unready}")
    if change is not None and (actions.patch_cluster or (
            s.driver_outdated(driver) and driver is not None and not driver.deleting)):
        event = Event("Normal", "SpecChanged", change)
    elif actions.patch_cluster and s.resized_groups():
        event = Event("Warning", "ChildRepaired", resized_message(s))
    return Decision(status, actions, event, requeue)


def resized_message(s: Situation) -> str:
    """What a hand edit of the RayCluster's worker groups is met with, in words."""
    want = worker_groups(s.spec)
    parts = [f"{g} {s.obs.cluster_groups.get(g, 'absent')} (the spec builds "
             f"{want.get(g, 'none')})" for g in s.resized_groups()]
    return ("the RayCluster's worker groups were edited by hand: " + "; ".join(parts)
            + "; patched back to what the spec builds")


def _readiness_event(s: Situation, ready: Condition) -> Event | None:
    """While the driver runs: a Warning when pods stop being Ready or what they wait for
    changes, a Normal event once every pod is Ready again."""
    stored: Obj = next((c for c in s.stored.get("conditions") or []
                        if c.get("type") == "Ready"), {})
    if ready.reason == "PodsNotReady" and (stored.get("reason") != ready.reason
                                           or stored.get("message") != ready.message):
        return Event("Warning", "PodsNotReady", ready.message)
    if ready.status == "True" and stored.get("reason") == "PodsNotReady":
        return Event("Normal", "PodsReady", "every pod is Ready again")
    return None


def _spec_change(s: Situation, driver: PodView | None) -> str | None:
    """What applying an edited spec still takes, in words; None when nothing is left."""
    steps = []
    assert s.want is not None
    if s.obs.cluster == "present" and s.obs.cluster_revision != s.want.cluster:
        steps.append("patching the RayCluster")
    outdated = s.outdated_pods()
    if outdated:
        steps.append(f"replacing pod(s) {pod_list(list(outdated))} built from the "
                     "previous spec")
    if s.driver_outdated(driver) and driver is not None:
        steps.append("stopping the driver, which restarts from the latest checkpoint (not "
                     "a failure, not counted as a restart)")
    if not steps:
        return None
    return f"applying generation {s.job.generation} of the spec: " + "; ".join(steps)


def _phase_event(s: Situation, phase: str, rec: RecoveryStatus) -> Event | None:
    resume = _resume_event(s, rec)
    if phase == s.phase:
        return resume
    reason, message = phase, f"phase {phase}"
    if phase == Phase.running.value and s.phase == Phase.recovering.value:
        reason, message = "Resumed", f"running again after restart {rec.restarts}"
    elif phase == Phase.pending.value:
        message = "waiting for compute pods to be scheduled"
    if resume is not None:
        message += f"; {resume.message}"
    return Event("Normal", reason, message)


def _resume_event(s: Situation, rec: RecoveryStatus) -> Event | None:
    """Once per attempt: what its runtime reported it loaded (a fact, not a forecast)."""
    if rec.resumed_from_step is None or s.recovery.resumed_from_step is not None:
        return None
    resumed = s.stored.get("resumed") or {}
    if resumed.get("found"):
        message = (f"the runtime of attempt {resumed.get('attempt')} loaded the verified "
                   f"checkpoint of step {rec.resumed_from_step} ({resumed.get('path')})")
    else:
        message = (f"the runtime of attempt {resumed.get('attempt')} found no verified "
                   "checkpoint and starts at step 0")
    if rec.lost_steps is not None:
        message += f"; {rec.lost_steps} step(s) since it are redone"
    return Event("Normal", "ResumedFromCheckpoint", message)
