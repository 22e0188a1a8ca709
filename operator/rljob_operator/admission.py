"""Kueue admission as phases: a queued job runs only while its Workload is admitted; until
then, and after an eviction, it stops the way `spec.suspend` stops it (the driver saves the
step in progress on SIGTERM, then compute is released), and the operator keeps the Workload
in step with the job (`workload_step`). Pure: (situation, decision) → decision."""

from __future__ import annotations

from dataclasses import replace
from enum import Enum

from rljob_api.status import TERMINAL_PHASES, Phase
from rljob_operator.decision import Actions, Decision, Event
from rljob_operator.kueue import priority_changed, shape_changed
from rljob_operator.situation import Situation
from rljob_operator.status import build_status, condition, recovery_status


class WorkloadStep(str, Enum):
    """The one change to the job's Workload a reconcile makes."""

    create = "create"
    update = "update"  # pod sets, queue or priority, on a workload that holds no quota
    reprioritize = "reprioritize"  # a new priority, in place (also while admitted)
    deactivate = "deactivate"  # spec.scheduling.suspend: Kueue evicts an inactive workload
    activate = "activate"  # resumed: only a workload the operator itself deactivated
    release = "release"  # evicted and the pods are gone: the quota goes back to Kueue
    pods_ready = "pods-ready"  # the job runs: PodsReady=True (Kueue's waitForPodsReady)
    finish = "finish"  # the job ended and its pods are gone: Finished=True frees the quota
    unhold = "unhold"  # Kueue's finalizer removed: the workload ended or is being deleted
    drop = "drop"  # the job changed what it queues while admitted: replaced by a new one


def inactive(s: Situation) -> bool:
    """Nothing of the job that takes quota is left: no RayCluster, and no pod of the job
    that has not ended (a deleted RayCluster's pods included, while they terminate)."""
    return s.obs.cluster == "absent" and s.obs.pods_left == 0


def stopped(s: Situation, phase: str, reason: str, message: str, queued: bool) -> Decision:
    """The job stops as for `spec.suspend`: the driver goes first (on SIGTERM its runtime
    finishes the step and saves, which needs the trainers and engines), the RayCluster only
    once the driver pod is gone; checkpoints are kept."""
    driver = s.obs.driver
    if driver is not None and driver.name in s.stranded_pods():
        driver = None  # no kubelet will stop it: force-deleted, as stranded
    if driver is not None:
        message += "; the driver stops (it saves the step in progress), then compute goes"
    elif not queued:
        message += "; compute released"
    conds = [condition(s, "Ready", "False", reason, message),
             condition(s, "Scheduled", "False", reason, message)]
    if queued:
        conds.append(condition(s, "Queued", "True", reason, message))
        conds.append(condition(s, "Suspended", "False", "NotSuspended", ""))
    else:
        conds.append(condition(s, "Suspended", "True", "Suspended", message))
    if phase == Phase.preempted.value:
        conds.append(condition(s, "Preempted", "True", reason, message))
    status = build_status(s, phase, conds, recovery_status(s, None))
    actions = Actions(
        delete_cluster=s.obs.cluster == "present" and driver is None,
        delete_driver=driver is not None and not driver.deleting,
        delete_pods=tuple(sorted({*s.stranded_pods(), *s.obs.stranded_orphans})),
    )
    stored: dict[str, object] = next(
        (c for c in s.stored.get("conditions") or [] if c.get("type") == "Ready"), {})
    event = None
    if phase != s.phase or stored.get("reason") != reason:
        event = Event("Warning" if phase == Phase.preempted.value else "Normal", phase,
                      message)
    return Decision(status, actions, event)


def gate(s: Situation) -> Decision | None:
    """The decision of a job queued in Kueue that may not run now; None once its Workload
    is admitted (it then runs, on the flavors Kueue assigned), and for a job the
    integration does not manage (`--kueue` off: it runs as without Kueue)."""
    queue = s.obs.queue
    if queue is None or not queue.enabled:
        return None
    wl = queue.workload
    if queue.name is None:
        if wl is None:
            return None
        return stopped(s, Phase.queued.value, "QueueRemoved",
                       f"the job no longer names a LocalQueue: it stops, its Workload "
                       f"{wl.name} goes, and then it runs outside Kueue", queued=True)
    cq = f"LocalQueue {queue.name}"
    if wl is None:
        if queue.problem is not None:
            return stopped(s, Phase.queued.value, *queue.problem, queued=True)
        return stopped(s, Phase.queued.value, "WorkloadPending",
                       f"queued in {cq}: its Workload is made once nothing of the job runs",
                       queued=True)
    if wl.deleting:
        return stopped(s, Phase.queued.value, "WorkloadDeleted",
                       f"Workload {wl.name} is being deleted; the job is queued again with a "
                       "new one once its pods are gone", queued=True)
    if wl.reserved and queue.want is not None and shape_changed(wl, queue.want):
        return stopped(s, Phase.queued.value, "SpecChanged",
                       f"the spec changed what Workload {wl.name} asks of Kueue (pods, "
                       "requests or queue) while it held quota: the job stops and is queued "
                       "again as it is now", queued=True)
    if wl.evicted is not None:
        preempted = wl.evicted.reason == "Preempted"
        why = wl.preempted.words() if preempted and wl.preempted else wl.evicted.words()
        phase = Phase.preempted.value if preempted and wl.reserved else Phase.queued.value
        return stopped(s, phase, wl.evicted.reason or "Evicted",
                       f"Kueue evicted Workload {wl.name} ({why}); it is queued again once the "
                       "job's pods are gone, and resumes from its latest checkpoint when "
                       "admitted", queued=True)
    if wl.admitted:
        # A flavor gone after the pods were placed changes nothing for them.
        unstarted = s.obs.driver is None and s.obs.cluster == "absent"
        if queue.problem is not None and unstarted:
            return stopped(s, Phase.queued.value, *queue.problem, queued=True)
        return None
    if wl.reserved:
        return stopped(s, Phase.queued.value, "AwaitingAdmissionChecks",
                       f"Workload {wl.name} holds quota in ClusterQueue {wl.cluster_queue} and "
                       "waits for its admission checks", queued=True)
    if not wl.active:
        return stopped(s, Phase.queued.value, "Inactive",
                       f"Workload {wl.name} is inactive (spec.active false, set by Kueue or "
                       "by hand): Kueue admits it once it is active again", queued=True)
    if wl.pending is None or not wl.pending.reason:
        return stopped(s, Phase.queued.value, "WaitingForKueue",
                       f"Workload {wl.name} waits in {cq}; Kueue has not said why yet",
                       queued=True)
    return stopped(s, Phase.queued.value, wl.pending.reason,
                   f"Workload {wl.name} waits in {cq}: {wl.pending.message}", queued=True)


def workload_step(s: Situation, decision: Decision) -> WorkloadStep | None:
    """What to change on the job's Workload after `decision`. Quota goes back to Kueue
    (release, finish, unhold, drop) only once no pod of the job is left."""
    queue = s.obs.queue
    if queue is None or not queue.enabled:
        return None
    wl = queue.workload
    terminal = decision.phase in TERMINAL_PHASES
    idle = inactive(s)
    if wl is None:
        ready = queue.name is not None and queue.want is not None and queue.problem is None
        return WorkloadStep.create if ready and not terminal and idle else None
    if wl.deleting:
        return WorkloadStep.unhold if wl.held and idle else None
    if terminal:
        if not idle:
            return None
        if not wl.finished:
            return WorkloadStep.finish
        return WorkloadStep.unhold if wl.held else None
    if queue.name is None:
        return WorkloadStep.drop if idle else None
    if wl.evicted is not None and wl.reserved:
        return WorkloadStep.release if idle else None
    suspended = s.job.spec is not None and s.job.spec.scheduling.suspend
    if suspended and wl.active:
        return WorkloadStep.deactivate
    if not suspended and not wl.active and wl.deactivated_by_us:
        return WorkloadStep.activate
    want = queue.want
    if want is not None and shape_changed(wl, want):
        if not wl.reserved:
            return WorkloadStep.update
        return WorkloadStep.drop if idle else None
    if want is not None and priority_changed(wl, want):
        return WorkloadStep.reprioritize
    if wl.admitted and not wl.pods_ready and decision.phase == Phase.running.value:
        return WorkloadStep.pods_ready
    return None


def queue_condition(s: Situation, decision: Decision) -> Decision:
    """A running queued job's status says which ClusterQueue admitted it; a job that names
    a queue the operator does not manage says so."""
    queue = s.obs.queue
    if queue is None or decision.phase in TERMINAL_PHASES or decision.phase in (
            Phase.queued.value, Phase.preempted.value, Phase.suspended.value):
        return decision
    wl = queue.workload
    if not queue.enabled:
        cond = condition(s, "Queued", "False", "KueueIntegrationOff",
                         f"the job names LocalQueue {queue.name}, but this operator does not "
                         "manage Kueue workloads (chart value kueue.enabled, flag --kueue): "
                         "it runs without Kueue")
    elif wl is not None and wl.admitted:
        cond = condition(s, "Admitted", "True", "Admitted",
                         f"Workload {wl.name} is admitted by ClusterQueue {wl.cluster_queue}")
    else:
        return decision
    status = dict(decision.status)
    status["conditions"] = [*status.get("conditions", []), cond.model_dump(by_alias=True)]
    return replace(decision, status=status)
