"""Pure decisions: (job, observed children, now) → the operator's status fields and actions.

Level-based: the decision depends only on the RLJob as stored (spec and status) and on what
exists now, never on which event woke the operator, so a restarted operator picks up
exactly where the previous one stopped. All durable state lives in `status` (restart count,
backoff deadline) and in the driver pod's annotations (its attempt and the compute pods it
started with).

The operator writes its own status fields (`rljob_api.status.OPERATOR_FIELDS`), built from
the API's typed `Condition` and `RecoveryStatus`; the runtime's fields are only read here. What
a restart resumed from is never predicted: it is derived (`resume_figures`) from what the
restarted runtime reported it loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import ValidationError

from rljob_api import exits
from rljob_api.layout import HEAD
from rljob_api.spec import FailureKind, RLJobSpec
from rljob_api.status import (
    MESSAGE_MAX,
    OPERATOR_FIELDS,
    TERMINAL_PHASES,
    Condition,
    Phase,
    RecoveryStatus,
    parse_timestamp,
    timestamp,
)
from rljob_api.status import Failure as LastFailure
from rljob_api.validate import spec_problems
from rljob_operator import names
from rljob_operator.builders import (
    JobRef,
    Revisions,
    checkpoint_claim_name,
    claim_names,
    revisions,
    worker_groups,
)
from rljob_operator.observe import InTheWay, Observed, PodView

Obj = dict[str, Any]
# Phases in which an attempt is starting: the start-up deadline runs.
STARTING_PHASES = frozenset({Phase.pending.value, Phase.initializing.value,
                             Phase.recovering.value})
# The fields of status.recovery derived from the runtime's report each time
# (resume_figures); the operator decides the others itself and carries them over.
DERIVED_RECOVERY_FIELDS = {"resumed_from_step", "lost_steps"}
MAX_LISTED_PODS = 5


@dataclass(frozen=True)
class JobView:
    """The RLJob as stored: a valid spec, or the reason it is not."""

    name: str
    generation: int
    spec: RLJobSpec | None
    spec_error: str | None
    status: Obj
    namespace: str = ""
    uid: str = ""


def parse_job(body: Obj) -> JobView:
    meta = body["metadata"]
    name = meta["name"]
    raw = body.get("spec")
    spec: RLJobSpec | None = None
    errors = [str(p) for p in spec_problems(raw)]
    if len(name) > names.MAX_JOB_NAME:
        errors.append(f"metadata.name must be at most {names.MAX_JOB_NAME} characters "
                      "(KubeRay's RayCluster name limit); recreate the job with a shorter name")
    if not errors:
        try:
            spec = RLJobSpec.model_validate(raw)
        except ValidationError as err:
            errors.append(str(err))
    return JobView(
        name=name,
        generation=int(meta.get("generation") or 0),
        spec=spec,
        spec_error="; ".join(errors) if errors else None,
        status=dict(body.get("status") or {}),
        namespace=str(meta.get("namespace") or ""),
        uid=str(meta.get("uid") or ""),
    )


@dataclass(frozen=True)
class Failure:
    kind: str
    message: str
    pod: str | None
    retryable: bool = True  # False: the job fails at once with `kind` as the reason


@dataclass(frozen=True)
class Problem:
    """What keeps an attempt from starting: a condition reason and a message naming pods."""

    reason: str
    message: str
    pod: str | None = None


@dataclass(frozen=True)
class Actions:
    """Idempotent steps for the reconciler; each is safe to repeat or to find already done."""

    create_cluster: bool = False
    delete_cluster: bool = False
    patch_cluster: bool = False  # the RayCluster was built from another spec: patch it
    replace_pods: tuple[str, ...] = ()  # deleted gracefully: an outdated template, a lost worker
    create_driver: tuple[str, ...] | None = None  # compute pods the new driver starts with
    delete_driver: bool = False
    delete_pods: tuple[str, ...] = ()  # force-deleted: failed, or stranded on a lost node


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    status: Obj
    actions: Actions = field(default_factory=Actions)
    event: Event | None = None
    requeue_after: float | None = None
    restart: Failure | None = None  # set when this decision starts a restart


def operator_fields(status: Obj) -> Obj:
    return {k: status[k] for k in OPERATOR_FIELDS if status.get(k) is not None}


def _normal(status: Obj) -> Obj:
    out = dict(status)
    out["conditions"] = {c["type"]: c for c in status.get("conditions") or []}
    return out


def needs_write(current: Obj, desired: Obj) -> bool:
    """Whether the operator's fields differ from what is stored (no write when equal)."""
    return _normal(operator_fields(current)) != _normal(desired)


def backoff_seconds(spec: RLJobSpec, restart: int) -> int:
    """Delay before restart number `restart` (1-based): doubling, capped."""
    rec = spec.recovery
    return int(min(rec.backoff_seconds * 2 ** max(0, restart - 1), rec.max_backoff_seconds))


def _pod_list(pods: list[str]) -> str:
    shown = ", ".join(pods[:MAX_LISTED_PODS])
    more = len(pods) - MAX_LISTED_PODS
    return shown + (f" and {more} more" if more > 0 else "")


def unschedulable_message(pods: list[PodView], claims: tuple[str, ...] = (),
                          checkpoint_claim: str | None = None) -> str:
    """Which pods cannot be scheduled and the scheduler's reason, grouped by reason; when the
    reason is an unbound PersistentVolumeClaim, which claims the pods use and what the
    checkpoint claim needs."""
    by_reason: dict[str, list[str]] = {}
    for pod in pods:
        by_reason.setdefault(pod.unschedulable or "", []).append(pod.name)
    parts = []
    for reason, names_ in sorted(by_reason.items()):
        part = f"{len(names_)} pod(s) cannot be scheduled ({_pod_list(names_)}): {reason}"
        if "PersistentVolumeClaim" in reason and claims:
            part += (f" (claims the pods mount: {', '.join(claims)}; each must be Bound, "
                     "`kubectl describe pvc NAME` says why one is not")
            if checkpoint_claim:
                part += (f"; {checkpoint_claim} holds the shared checkpoints and needs a "
                         "ReadWriteMany volume: set spec.checkpoint.storageClassName to a class "
                         "that provides one, or spec.checkpoint.pvc to an existing claim")
            part += ")"
        parts.append(part)
    return "; ".join(parts)


def resume_figures(restarts: int, last_failure: Obj | None, resumed: Obj | None,
                   driver_uid: str | None = None) -> Obj:
    """`resumedFromStep` and `lostSteps` of the current attempt, from facts only.

    Inputs: `restarts` is the operator's restart count, i.e. the number of the attempt that
    runs now; `last_failure` is `status.recovery.lastFailure`, whose `step` is the progress the
    runtime had reported when the operator saw the failure; `resumed` is `status.resumed`, what
    a runtime reported it loaded (its `attempt`, `found`, `step`, `driverPodUid`);
    `driver_uid` is the UID of the driver pod that exists now, if any.

    Nothing is returned until the runtime of the current attempt has reported: the previous
    attempt's report says nothing about this one, nor does one of an earlier driver pod of
    the same attempt (before a suspension or a spec edit). A first attempt that found no checkpoint
    resumed nothing; a restarted one that found none resumed from step 0.
    """
    if not resumed or resumed.get("attempt") != restarts:
        return {}
    reporter = resumed.get("driverPodUid")
    if reporter and driver_uid and reporter != driver_uid:
        return {}
    if restarts == 0 and not resumed.get("found"):
        return {}
    step = int(resumed.get("step") or 0)
    out: Obj = {"resumedFromStep": step}
    failed_at = (last_failure or {}).get("step")
    if restarts > 0 and failed_at is not None:
        out["lostSteps"] = max(0, int(failed_at) - step)
    return out


def refine_last_failure(recovery: RecoveryStatus, obs: Observed) -> RecoveryStatus:
    """A `WorkerLost` failure (Ray lost a pod's node before Kubernetes noticed) renamed
    `NodeLost` once the pod's node is seen lost, before the next attempt starts (which waits
    for that pod's replacement): the reason then says what happened, the message what Ray saw
    first."""
    last = recovery.last_failure
    if last is None or last.reason != FailureKind.worker_lost.value:
        return recovery
    pod = next((p for p in obs.compute if p.name == last.pod), None)
    if pod is None or pod.node not in obs.lost_nodes:
        return recovery
    message = (f"node {pod.node} is not Ready or was removed; Ray saw it first: "
               f"{last.message}")[:MESSAGE_MAX]
    refined = last.model_copy(update={"reason": FailureKind.node_lost.value, "message": message})
    return recovery.model_copy(update={"last_failure": refined})


class _Decider:
    """One decision; helpers share the job, observation and clock."""

    def __init__(self, job: JobView, obs: Observed, now: datetime) -> None:
        self.job = job
        self.obs = obs
        self.now = now
        self.cur = job.status
        self.phase = self.cur.get("phase")
        self.recovery = RecoveryStatus.model_validate(self.cur.get("recovery") or {})
        if self.phase == Phase.recovering.value:
            self.recovery = refine_last_failure(self.recovery, obs)
        self.restarts = self.recovery.restarts
        observed = self.cur.get("observedGeneration")
        # The spec was edited since the last status write: a start-up begins afresh.
        self.edited = observed is not None and observed != job.generation
        # What the current spec builds; children of other revisions are patched or replaced.
        self.want: Revisions | None = None
        if job.spec is not None:
            self.want = revisions(JobRef(job.name, job.namespace, job.uid), job.spec)

    # -- status assembly -------------------------------------------------------------------

    def condition(self, kind: str, status: Literal["True", "False", "Unknown"], reason: str,
                  message: str) -> Condition:
        """A condition of this decision; its lastTransitionTime only moves when `status`
        changes."""
        prev = next((c for c in self.cur.get("conditions") or [] if c.get("type") == kind),
                    None)
        moved = prev is None or prev.get("status") != status
        return Condition(
            type=kind, status=status, reason=reason, message=message[:MESSAGE_MAX],
            last_transition_time=timestamp(self.now) if moved or prev is None
            else prev["lastTransitionTime"],
            observed_generation=self.job.generation,
        )

    def status(self, phase: str, conditions: list[Condition], recovery: RecoveryStatus,
               finished: bool = False, since: str | None = None) -> Obj:
        out: Obj = {
            "phase": phase,
            "observedGeneration": self.job.generation,
            "conditions": [c.model_dump(by_alias=True) for c in conditions],
            "recovery": recovery.model_dump(by_alias=True, exclude_unset=True,
                                            exclude_none=True),
        }
        if since is not None and phase in STARTING_PHASES:
            out["startingSince"] = since
        started = self.cur.get("startedAt")
        if started is None and phase == Phase.running.value:
            started = timestamp(self.now)
        if started:
            out["startedAt"] = started
        finished_at = self.cur.get("finishedAt") or (timestamp(self.now) if finished else None)
        if finished_at:
            out["finishedAt"] = finished_at
        return out

    def base_recovery(self, action: str | None, next_at: str | None = None,
                      last_failure: LastFailure | None = None) -> RecoveryStatus:
        """status.recovery of this decision; `last_failure` replaces the stored one, after
        the stored one has measured the steps lost by the attempt that runs now."""
        rec = self.recovery.model_dump(exclude=DERIVED_RECOVERY_FIELDS, exclude_unset=True)
        rec.update(restarts=self.restarts, action=action, next_attempt_at=next_at)
        if self.job.spec is not None:
            rec["max_restarts"] = self.job.spec.recovery.max_restarts
        driver = self.obs.driver
        rec.update(resume_figures(self.restarts, rec.get("last_failure"),
                                  self.cur.get("resumed"), driver.uid if driver else None))
        if last_failure is not None:
            rec["last_failure"] = last_failure
        return RecoveryStatus.model_validate(rec)

    def transition_event(self, phase: str, type_: str, message: str) -> Event | None:
        return None if phase == self.phase else Event(type_, phase, message)

    # -- terminal and special phases -------------------------------------------------------

    def terminal(self) -> Decision:
        """Succeeded/Failed stay so; compute is torn down, the driver pod kept for its logs."""
        status = operator_fields(self.cur)
        status["observedGeneration"] = self.job.generation
        return Decision(status, Actions(delete_cluster=self.obs.cluster == "present"))

    def fail(self, reason: str, message: str,
             last_failure: LastFailure | None = None) -> Decision:
        status = self.status(Phase.failed.value, [
            self.condition("Ready", "False", reason, message),
            self.condition("Failed", "True", reason, message),
        ], self.base_recovery(None, last_failure=last_failure), finished=True)
        return Decision(
            status,
            Actions(delete_cluster=self.obs.cluster == "present"),
            self.transition_event(Phase.failed.value, "Warning", f"{reason}: {message}"),
        )

    def succeed(self) -> Decision:
        message = "the driver completed every step"
        status = self.status(Phase.succeeded.value, [
            self.condition("Ready", "False", "Succeeded", message),
            self.condition("Succeeded", "True", "DriverSucceeded", message),
        ], self.base_recovery(None), finished=True)
        return Decision(status, Actions(delete_cluster=self.obs.cluster == "present"),
                        self.transition_event(Phase.succeeded.value, "Normal", message))

    def suspended(self) -> Decision:
        """The driver goes first (on SIGTERM its runtime finishes the step and saves, which
        needs the trainers and engines); the RayCluster only once the driver pod is gone."""
        driver = self.obs.driver
        if driver is not None and driver.node in self.obs.lost_nodes:
            driver = None  # no kubelet will stop it: force-deleted below, as stranded
        message = "spec.scheduling.suspend is true: compute released, checkpoints kept"
        if driver is not None:
            message = ("spec.scheduling.suspend is true: the driver stops (it saves the step "
                       "in progress), then compute is released; checkpoints are kept")
        status = self.status(Phase.suspended.value, [
            self.condition("Ready", "False", "Suspended", message),
            self.condition("Scheduled", "False", "Suspended", message),
            self.condition("Suspended", "True", "Suspended", message),
        ], self.base_recovery(None))
        actions = Actions(
            delete_cluster=self.obs.cluster == "present" and driver is None,
            delete_driver=driver is not None and not driver.deleting,
            delete_pods=self.stranded_pods(),
        )
        return Decision(status, actions,
                        self.transition_event(Phase.suspended.value, "Normal", message))

    def blocked(self, found: InTheWay) -> Decision:
        """A child's name is taken by an object this job does not own: nothing is created,
        adopted, patched or deleted; the conditions name the object, and the start-up
        deadline runs (an object nobody removes fails the job like any other blocked start)."""
        problem = Problem("ObjectInTheWay", found.describe(self.job.namespace))
        recovering = self.phase == Phase.recovering.value
        phase = self.phase if self.phase in STARTING_PHASES else Phase.pending.value
        next_at = self.recovery.next_attempt_at if recovering else None
        since = self.starting_since(next_at)
        deadline = self.deadline(since)
        if deadline is not None and self.now >= deadline:
            return self.startup_failed(since, problem)
        rec = self.base_recovery(problem.reason if recovering else None, next_at)
        status = self.status(phase, [
            self.condition("Ready", "False", problem.reason, problem.message),
            *self.scheduling_conditions(),
            self.started_condition(since, problem),
        ], rec, since=since)
        ready: Obj = next((c for c in self.cur.get("conditions") or []
                           if c.get("type") == "Ready"), {})
        event = None
        if ready.get("reason") != problem.reason or ready.get("message") != problem.message:
            event = Event("Warning", problem.reason, problem.message)
        left = (deadline - self.now).total_seconds() if deadline is not None else None
        return Decision(status, Actions(), event, left)

    # -- failures and recovery -------------------------------------------------------------

    def detect_failure(self, driver: PodView) -> Failure | None:
        """The first sign that the running attempt is broken, most specific cause first."""
        obs = self.obs
        if driver.node in obs.lost_nodes:
            return Failure(FailureKind.node_lost.value,
                           f"node {driver.node} is not Ready or was removed", driver.name)
        if driver.failure is not None:
            doomed = self.terminal_exit(driver)
            if doomed is not None:
                return doomed
            lost = self.lost_worker(driver)
            if lost is not None:
                return lost
            kind = driver.failure.kind
            if kind == FailureKind.pod_failed.value:
                kind = FailureKind.driver_failed.value
            message = driver.failure.message
            runtime = self.cur.get("runtimeFailure")
            if runtime:
                message = f"{runtime.get('reason')}: {runtime.get('message', '')}; {message}"
            return Failure(kind, message, driver.name)
        recorded = driver.recorded_compute
        for pod in obs.compute:
            if pod.node in obs.lost_nodes and pod.name in recorded:
                return Failure(FailureKind.node_lost.value,
                               f"node {pod.node} is not Ready or was removed", pod.name)
        for pod in obs.compute:
            if pod.failure is not None and pod.name in recorded:
                return Failure(pod.failure.kind, pod.failure.message, pod.name)
        present = {p.name for p in obs.compute if not p.deleting}
        for name in sorted(recorded - present):
            hint = obs.hints.get(name)
            if hint is not None:
                return Failure(hint.kind, hint.message, name)
            return Failure(FailureKind.pod_deleted.value, "the pod was deleted", name)
        return None

    def terminal_exit(self, driver: PodView) -> Failure | None:
        """A driver that exited with a code saying a restart cannot help (invalid job,
        non-finite values): a non-retryable failure, named after the runtime's own reason
        when this attempt's runtime reported one, else after the exit code."""
        hint = driver.failure
        code = hint.exit_code if hint is not None else None
        if hint is None or code not in exits.TERMINAL_REASONS:
            return None
        reason = exits.TERMINAL_REASONS[code]
        message = (f"the driver exited with code {code}: {exits.TERMINAL_MEANING[code]}; "
                   "a restart cannot help, so the job is not retried")
        runtime = self.attempt_failure(driver)
        if runtime.get("reason"):
            reason = str(runtime["reason"])
            detail = runtime.get("message")
            message += f"; {reason}: {detail}" if detail else f"; {reason}"
        return Failure(reason, message, driver.name, retryable=False)

    def attempt_failure(self, driver: PodView) -> Obj:
        """`status.runtimeFailure` when the runtime of this driver's attempt reported it
        (not one left over from an earlier attempt); else {}."""
        runtime: Obj = self.cur.get("runtimeFailure") or {}
        reported = parse_timestamp(runtime.get("time"))
        started = parse_timestamp(driver.failure.started_at if driver.failure else None)
        if reported is None or started is None or reported >= started:
            return runtime
        return {}

    def lost_worker(self, driver: PodView) -> Failure | None:
        """The driver failed because Ray lost the node of pods its runtime names
        (`runtimeFailure.lostPods`): the failure is named after what Kubernetes knows of those
        pods (a lost node, a deletion, a failure). Ray usually notices first (a node's
        NotReady takes Kubernetes about 40 s), so until Kubernetes agrees it is `WorkerLost`,
        renamed while the job recovers (`refine_last_failure`)."""
        runtime = self.attempt_failure(driver)
        lost = [str(p) for p in runtime.get("lostPods") or []]
        if not lost:
            return None
        pods = {p.name: p for p in self.obs.compute}
        for name in lost:
            pod = pods.get(name)
            if pod is not None and pod.node in self.obs.lost_nodes:
                return Failure(FailureKind.node_lost.value,
                               f"node {pod.node} is not Ready or was removed", name)
        for name in lost:
            pod = pods.get(name)
            if pod is None or pod.deleting:
                hint = self.obs.hints.get(name)
                if hint is not None:
                    return Failure(hint.kind, hint.message, name)
                return Failure(FailureKind.pod_deleted.value, "the pod was deleted", name)
            if pod.failure is not None:
                return Failure(pod.failure.kind, pod.failure.message, name)
        return Failure(FailureKind.worker_lost.value, str(runtime.get("message") or
                                                          "Ray lost the pod's node"), lost[0])

    def recover_or_fail(self, failure: Failure) -> Decision:
        spec = self.job.spec
        assert spec is not None
        last = LastFailure(reason=failure.kind, message=failure.message[:MESSAGE_MAX],
                           time=timestamp(self.now))
        if failure.pod is not None:
            last.pod = failure.pod
        if not failure.retryable:
            return self.fail(failure.kind, f"{failure.message} (pod {failure.pod})", last)
        retried = set(spec.recovery.retry_on)
        if FailureKind.node_lost in retried:
            # What Ray sees first of a lost node; it is renamed NodeLost once Kubernetes agrees.
            retried.add(FailureKind.worker_lost)
        if failure.kind not in retried:
            return self.fail(failure.kind, f"{failure.message} (pod {failure.pod}); "
                             f"{failure.kind} is not in spec.recovery.retryOn", last)
        if self.restarts >= spec.recovery.max_restarts:
            return self.fail(
                "RestartLimitExceeded",
                f"{failure.kind} of pod {failure.pod}: {failure.message}; all "
                f"{spec.recovery.max_restarts} restarts (spec.recovery.maxRestarts) are used",
                last,
            )
        restart = self.restarts + 1
        delay = backoff_seconds(spec, restart)
        progress = self.cur.get("progress") or {}
        if "rolloutStep" in progress:
            # What the runtime had reported: lostSteps is measured from here once the next
            # attempt says where it resumed.
            last.step = int(progress["rolloutStep"])
        self.restarts = restart
        rec = self.base_recovery("WaitingForBackoff",
                                 timestamp(self.now + timedelta(seconds=delay)), last)
        message = (f"{failure.kind} (pod {failure.pod}): {failure.message}; restart "
                   f"{restart}/{spec.recovery.max_restarts} in {delay}s; the runtime resumes "
                   "from its latest verified checkpoint")
        since = self.starting_since(rec.next_attempt_at)
        status = self.status(Phase.recovering.value, [
            self.condition("Ready", "False", failure.kind, message),
            *self.scheduling_conditions(),
            self.started_condition(since, None),
        ], rec, since=since)
        driver = self.obs.driver
        stranded = self.stranded_pods()
        failed = tuple(p.name for p in self.obs.compute if p.failure is not None)
        lost: tuple[str, ...] = ()
        if failure.kind == FailureKind.worker_lost.value:
            # Ray says the pod's node is gone while Kubernetes still counts the pod ready: it
            # is deleted (gracefully: on a lost node it stays terminating, bound to that node,
            # until the node is seen NotReady and it is force-deleted as stranded) so that no
            # attempt starts on it.
            lost = tuple(p.name for p in self.obs.compute
                         if p.name == failure.pod and not p.deleting)
        actions = Actions(
            create_cluster=self.obs.cluster == "absent",
            delete_driver=driver is not None and not driver.deleting,
            delete_pods=tuple(sorted(set(stranded) | set(failed))),
            replace_pods=lost,
        )
        return Decision(status, actions, Event("Warning", "Recovering", message),
                        requeue_after=float(delay), restart=failure)

    # -- start-up deadline -----------------------------------------------------------------

    def starting_since(self, recovering_from: str | None = None) -> str:
        """When the current start-up began: kept from the status, unless the spec was edited
        since (a fix restarts the clock); a restart's start-up begins when its backoff ends."""
        stored = self.cur.get("startingSince")
        if stored and not self.edited and parse_timestamp(stored) is not None:
            return str(stored)
        due = parse_timestamp(recovering_from)
        return timestamp(max(self.now, due) if due is not None else self.now)

    def deadline(self, since: str) -> datetime | None:
        spec = self.job.spec
        assert spec is not None
        start = parse_timestamp(since)
        timeout = spec.recovery.startup_timeout_seconds
        if timeout <= 0 or start is None:
            return None
        return start + timedelta(seconds=timeout)

    def startup_problem(self, since: str) -> Problem | None:
        """The first thing blocking start-up, most specific first: containers that cannot
        start (image pulls, crashes), compute pods failing while starting, unschedulable
        pods. The pods are named, with the kubelet's or scheduler's words."""
        obs = self.obs
        driver = obs.driver if obs.driver is not None and not obs.driver.deleting else None
        pods = [p for p in obs.compute if not p.deleting] + ([driver] if driver else [])
        stuck = [p for p in pods if p.stuck is not None]
        if stuck:
            first = stuck[0].stuck
            assert first is not None
            same = [p.name for p in stuck if p.stuck is not None
                    and p.stuck.reason == first.reason]
            return Problem(first.reason, f"{first.reason} in pod(s) {_pod_list(same)}: "
                           f"container {first.container}: {first.message}", stuck[0].name)
        started = parse_timestamp(since)
        failed = {p.name: p.failure for p in obs.compute if p.failure is not None}
        present = {p.name for p in obs.compute}
        for name, hint in obs.hints.items():
            seen = parse_timestamp(hint.seen_at)
            if name not in present and seen is not None and started is not None \
                    and seen >= started and name != names.driver_name(self.job.name):
                failed[name] = hint
        if failed:
            pod_names = sorted(failed)
            detail = failed[pod_names[0]]
            assert detail is not None
            return Problem("CrashLoop", f"{len(pod_names)} compute pod(s) failed while "
                           f"starting ({_pod_list(pod_names)}): {detail.message}; KubeRay "
                           "replaces them, so this repeats until the cause is fixed",
                           pod_names[0])
        unschedulable = [p for p in pods if p.unschedulable]
        if unschedulable:
            spec = self.job.spec
            assert spec is not None
            return Problem("Unschedulable", unschedulable_message(
                unschedulable, claim_names(self.job.name, spec),
                checkpoint_claim_name(self.job.name, spec)), unschedulable[0].name)
        return None

    def waiting_for(self) -> str:
        """What start-up still waits for, when nothing in particular blocks it."""
        running = [p for p in self.live() if p.phase == "Running" and p.ready]
        out = f"{len(running)} of {sum(self.expected().values())} compute pods run"
        driver = self.obs.driver
        if driver is not None and not driver.deleting:
            how = f" ({driver.waiting})" if driver.waiting else ""
            out += f"; the driver pod {driver.name} is {driver.phase}{how}"
        else:
            out += "; the driver pod is not created yet"
        return out

    def started_condition(self, since: str, problem: Problem | None) -> Condition:
        deadline = self.deadline(since)
        assert self.job.spec is not None
        timeout = self.job.spec.recovery.startup_timeout_seconds
        when = (f"start-up began at {since}; the job fails at {timestamp(deadline)} unless it has "
                f"started (spec.recovery.startupTimeoutSeconds: {timeout})"
                if deadline is not None else
                f"start-up began at {since}; no deadline (spec.recovery.startupTimeoutSeconds: "
                "0)")
        if problem is not None:
            return self.condition("Started", "False", problem.reason,
                                  f"{problem.message}; {when}")
        return self.condition("Started", "False", "Starting", f"{self.waiting_for()}; {when}")

    def startup_failed(self, since: str, problem: Problem | None) -> Decision:
        """Past the start-up deadline: Failed with what blocked it."""
        assert self.job.spec is not None
        timeout = self.job.spec.recovery.startup_timeout_seconds
        if problem is None:
            driver = self.obs.driver
            reason = ("DriverNotStarted" if driver is not None and self.compute_ready()
                      else "StartupTimeout")
            problem = Problem(reason, self.waiting_for(),
                              driver.name if driver is not None else None)
        message = (f"the job did not start within {timeout}s of {since} "
                   f"(spec.recovery.startupTimeoutSeconds): {problem.message}")
        last = LastFailure(reason=problem.reason, message=message[:MESSAGE_MAX],
                           time=timestamp(self.now))
        if problem.pod:
            last.pod = problem.pod
        decision = self.fail(problem.reason, message, last)
        driver = self.obs.driver
        # A driver that never got going is no evidence: it goes, with what it holds.
        stop = driver is not None and not driver.deleting and driver.phase in {"Pending",
                                                                                "Running"}
        return replace(decision, actions=replace(decision.actions, delete_driver=stop))

    # -- the normal path -------------------------------------------------------------------

    def stranded_pods(self) -> tuple[str, ...]:
        """Pods on lost nodes: no kubelet will ever finish them, so they are force-deleted
        for KubeRay to replace them elsewhere."""
        pods = [*self.obs.compute, *([self.obs.driver] if self.obs.driver else [])]
        return tuple(p.name for p in pods if p.node in self.obs.lost_nodes)

    def expected(self) -> dict[str, int]:
        assert self.job.spec is not None
        return {HEAD: 1, **worker_groups(self.job.spec)}

    def current(self, pod: PodView) -> bool:
        """Whether a compute pod was built from the template the current spec builds."""
        assert self.want is not None
        return pod.revision == self.want.templates.get(pod.component)

    def live(self) -> list[PodView]:
        """Compute pods that are alive and built from the current spec."""
        return [p for p in self.obs.live_compute() if self.current(p)]

    def outdated_pods(self) -> tuple[str, ...]:
        """Compute pods of another template revision (the spec changed since they were made):
        deleted, so that KubeRay makes them again from the patched RayCluster."""
        if self.obs.cluster != "present" or self.want is None:
            return ()
        return tuple(p.name for p in self.obs.compute if not p.deleting and not self.current(p))

    def cluster_outdated(self) -> bool:
        assert self.want is not None
        return self.obs.cluster == "present" and self.obs.cluster_revision != self.want.cluster

    def driver_outdated(self, driver: PodView | None) -> bool:
        """A driver built from another spec (its pod, its config or its RayCluster)."""
        return (driver is not None and self.want is not None
                and driver.revision != self.want.driver)

    def compute_ready(self) -> bool:
        """Exactly the expected compute pods of the current revision exist and run (a pod
        about to be scaled away must not become part of an attempt)."""
        live = self.live()
        for component, count in self.expected().items():
            pods = [p for p in live if p.component == component]
            if len(pods) != count or not all(p.phase == "Running" and p.ready for p in pods):
                return False
        return self.obs.cluster == "present"

    def all_scheduled(self) -> bool:
        live = [p for p in self.live() if p.unschedulable is None and p.node]
        return self.obs.cluster == "present" and len(live) >= sum(self.expected().values())

    def scheduling_conditions(self) -> list[Condition]:
        stuck = [p for p in self.obs.compute if p.unschedulable and not p.deleting]
        if stuck:
            spec = self.job.spec
            assert spec is not None
            message = unschedulable_message(stuck, claim_names(self.job.name, spec),
                                            checkpoint_claim_name(self.job.name, spec))
            sched = self.condition("Scheduled", "False", "Unschedulable", message)
        elif not self.all_scheduled():
            live = len([p for p in self.live() if p.node])
            sched = self.condition(
                "Scheduled", "False", "WaitingForPods",
                f"{live} of {sum(self.expected().values())} compute pods are placed")
        else:
            sched = self.condition("Scheduled", "True", "AllPodsScheduled",
                                   "every compute pod is bound to a node")
        return [sched, self.condition("Suspended", "False", "NotSuspended", "")]

    def active(self) -> Decision:
        driver = self.obs.driver
        # A driver of an earlier attempt, or one built from an earlier spec, is replaced.
        stale = driver is not None and (driver.restarts != self.restarts
                                        or self.driver_outdated(driver))
        attempt = driver if driver is not None and not stale and not driver.deleting else None
        running = self.phase == Phase.running.value
        if attempt is not None and attempt.phase == "Succeeded":
            return self.succeed()
        failure = None
        if attempt is not None:
            failure = self.detect_failure(attempt)
        elif running and (driver is None or (driver.deleting and not stale)):
            failure = Failure(FailureKind.pod_deleted.value, "the driver pod was deleted",
                              names.driver_name(self.job.name))
        if failure is not None:
            return self.recover_or_fail(failure)
        return self.progressing(driver, attempt, stale)

    def progressing(self, driver: PodView | None, attempt: PodView | None,
                    stale: bool) -> Decision:
        recovering = self.phase == Phase.recovering.value
        ready = self.compute_ready()
        create_driver: tuple[str, ...] | None = None
        requeue: float | None = None
        next_at = self.recovery.next_attempt_at if recovering else None
        waiting_phase = Phase.recovering.value if recovering else (
            Phase.initializing.value if self.all_scheduled() else Phase.pending.value)
        if attempt is not None and attempt.phase == "Running" and ready:
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
            if recovering and due is not None and self.now < due:
                phase, action = waiting_phase, "WaitingForBackoff"
                requeue = (due - self.now).total_seconds()
            else:
                phase, action = waiting_phase, "StartingDriver"
                if not recovering:
                    phase = Phase.initializing.value
                create_driver = tuple(p.name for p in self.live())
        if not recovering and phase != Phase.running.value:
            action = None
        rec = self.base_recovery(action, next_at)
        ready_cond = self.condition("Ready", "True", "Running",
                                    "the driver and every compute pod run")
        started = self.condition("Started", "True", "Started",
                                 "the driver and every compute pod run")
        since: str | None = None
        change = self.spec_change(driver)
        if phase != Phase.running.value:
            ready_cond = self.condition("Ready", "False", action or phase, f"phase {phase}")
            if change is not None:
                ready_cond = self.condition("Ready", "False", "ApplyingSpecChange", change)
            since = self.starting_since(next_at if recovering else None)
            problem = self.startup_problem(since)
            deadline = self.deadline(since)
            if deadline is not None and self.now >= deadline:
                return self.startup_failed(since, problem)
            if deadline is not None:
                left = (deadline - self.now).total_seconds()
                requeue = left if requeue is None else min(requeue, left)
            started = self.started_condition(since, problem)
        status = self.status(phase, [ready_cond, *self.scheduling_conditions(), started], rec,
                             since=since)
        # A driver that is stopping for a spec change saves the step in progress on SIGTERM,
        # which needs the trainers and engines: compute changes wait until its pod is gone.
        stopping = driver is not None and (stale or self.driver_outdated(driver))
        actions = Actions(
            create_cluster=self.obs.cluster == "absent",
            create_driver=create_driver,
            delete_driver=stale and driver is not None and not driver.deleting,
            delete_pods=self.stranded_pods(),
            patch_cluster=self.cluster_outdated() and not stopping,
            replace_pods=() if stopping else tuple(p for p in self.outdated_pods()
                                                   if p not in self.stranded_pods()),
        )
        event = self.phase_event(phase, rec)
        if change is not None and (actions.patch_cluster or (
                self.driver_outdated(driver) and driver is not None and not driver.deleting)):
            event = Event("Normal", "SpecChanged", change)
        return Decision(status, actions, event, requeue)

    def spec_change(self, driver: PodView | None) -> str | None:
        """What applying an edited spec still takes, in words; None when nothing is left."""
        steps = []
        if self.cluster_outdated():
            steps.append("patching the RayCluster")
        outdated = self.outdated_pods()
        if outdated:
            steps.append(f"replacing pod(s) {_pod_list(list(outdated))} built from the "
                         "previous spec")
        if self.driver_outdated(driver) and driver is not None:
            steps.append("stopping the driver, which restarts from the latest checkpoint (not "
                         "a failure, not counted as a restart)")
        if not steps:
            return None
        return f"applying generation {self.job.generation} of the spec: " + "; ".join(steps)

    def phase_event(self, phase: str, rec: RecoveryStatus) -> Event | None:
        resume = self.resume_event(rec)
        if phase == self.phase:
            return resume
        reason, message = phase, f"phase {phase}"
        if phase == Phase.running.value and self.phase == Phase.recovering.value:
            reason, message = "Resumed", f"running again after restart {rec.restarts}"
        elif phase == Phase.pending.value:
            message = "waiting for compute pods to be scheduled"
        if resume is not None:
            message += f"; {resume.message}"
        return Event("Normal", reason, message)

    def resume_event(self, rec: RecoveryStatus) -> Event | None:
        """Once per attempt: what its runtime reported it loaded (a fact, not a forecast)."""
        if rec.resumed_from_step is None or self.recovery.resumed_from_step is not None:
            return None
        resumed = self.cur.get("resumed") or {}
        if resumed.get("found"):
            message = (f"the runtime of attempt {resumed.get('attempt')} loaded the verified "
                       f"checkpoint of step {rec.resumed_from_step} ({resumed.get('path')})")
        else:
            message = (f"the runtime of attempt {resumed.get('attempt')} found no verified "
                       "checkpoint and starts at step 0")
        if rec.lost_steps is not None:
            message += f"; {rec.lost_steps} step(s) since it are redone"
        return Event("Normal", "ResumedFromCheckpoint", message)


def decide(job: JobView, obs: Observed, now: datetime) -> Decision:
    """The operator's status fields and next actions for one job."""
    d = _Decider(job, obs, now)
    if d.phase in TERMINAL_PHASES:
        return d.terminal()
    if job.spec is None:
        return d.fail("InvalidSpec", job.spec_error or "the spec is invalid")
    runtime = job.status.get("runtimeFailure")
    if runtime and runtime.get("retryable") is False:
        return d.fail(str(runtime.get("reason") or "RuntimeFailure"),
                      str(runtime.get("message") or "the runtime stopped the job"))
    if job.spec.scheduling.suspend:
        return d.suspended()
    if obs.in_the_way is not None:
        return d.blocked(obs.in_the_way)
    modes = obs.checkpoint_modes
    if modes is not None and "ReadWriteMany" not in modes:
        return d.fail("CheckpointVolumeNotShared", unshared_claim_message(
            str(job.spec.checkpoint.pvc), modes))
    return d.active()


def unshared_claim_message(claim: str, modes: tuple[str, ...]) -> str:
    """Why a user's checkpoint claim without ReadWriteMany cannot work, and the fixes."""
    return (f"spec.checkpoint.pvc: the claim {claim} has access modes "
            f"{', '.join(modes) or 'none'}, but the driver, the Ray head, the trainers and the "
            "engines are different pods, often on different nodes, that all write the "
            "checkpoint directory: it must be a ReadWriteMany claim (NFS, CephFS, a cloud file "
            "store), or leave spec.checkpoint.pvc unset and set spec.checkpoint.storageClassName "
            "to a class that provides ReadWriteMany volumes")


__all__ = ["Actions", "Decision", "Event", "Failure", "JobView", "decide", "needs_write",
           "operator_fields", "parse_job", "resume_figures"]
