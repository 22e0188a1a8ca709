"""Status building: the operator's status fields of one decision, and whether they differ
from what is stored.

The operator writes its own fields (`rljob_api.status.OPERATOR_FIELDS`), built from the
API's typed `Condition` and `RecoveryStatus`; of the runtime's fields it writes one, and only
between a restart and the new runtime's first report: the step the job has
(`held_step`). What a restart resumed from is never predicted: it is derived
(`resume_figures`) from what the restarted runtime reported it loaded.
"""

from __future__ import annotations

from typing import Any, Literal

from rljob_api.status import (
    MESSAGE_MAX,
    OPERATOR_FIELDS,
    Condition,
    Phase,
    RecoveryStatus,
    parse_timestamp,
    timestamp,
)
from rljob_api.status import Failure as LastFailure
from rljob_operator.failures import MAX_LISTED_PODS, Problem, job_unschedulable_message
from rljob_operator.observe import PodView
from rljob_operator.situation import Situation

Obj = dict[str, Any]
# Phases in which an attempt is starting: the start-up deadline runs, and what the pods
# mount is made again if it is missing.
STARTING_PHASES = frozenset({Phase.pending.value, Phase.initializing.value,
                             Phase.recovering.value})
STARTED_MESSAGE = "the driver runs; it was started once every compute pod ran"
# The fields of status.recovery derived from the runtime's report each time
# (resume_figures); the operator decides the others itself and carries them over.
DERIVED_RECOVERY_FIELDS = {"resumed_from_step", "lost_steps"}


def operator_fields(status: Obj) -> Obj:
    return {k: status[k] for k in OPERATOR_FIELDS if status.get(k) is not None}


def _normal(status: Obj) -> Obj:
    out = dict(status)
    out["conditions"] = {c["type"]: c for c in status.get("conditions") or []}
    return out


def needs_write(current: Obj, desired: Obj) -> bool:
    """Whether the operator's fields differ from what is stored (no write when equal)."""
    return _normal(operator_fields(current)) != _normal(desired)


def merge_patch_to(current: Obj, desired: Obj) -> Obj:
    """The JSON merge patch (RFC 7386) that turns `current` into `desired`: keys `desired`
    lacks are set to null, maps are patched key by key, anything else is replaced."""
    out: Obj = {k: None for k in current if k not in desired}
    for key, want in desired.items():
        have = current.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            sub = merge_patch_to(have, want)
            if sub:
                out[key] = sub
        elif have != want:
            out[key] = want
    return out


def held_step(stored: Obj, restarts: int) -> int | None:
    """The rollout step to show in status.progress.rolloutStep (the STEP column), when the
    progress there is still a lost attempt's and shows another; None otherwise.

    Until the new attempt's runtime reports (its first report, before it places workers,
    carries `attempt`), the progress is the one the lost attempt reached, steps the job no
    longer has, through the backoff and the new driver's start. The job has the step of the
    latest verified checkpoint the runtime reported in status.checkpoint, which is where the
    runtime resumes (0 without one). A late report of the lost attempt's runtime shows its
    step again and is corrected the same way."""
    progress = stored.get("progress") or {}
    step = progress.get("rolloutStep")
    attempt = progress.get("attempt")
    if restarts == 0 or not isinstance(step, int) or (
            isinstance(attempt, int) and attempt >= restarts):
        return None
    checkpoint = stored.get("checkpoint") or {}
    has = checkpoint.get("step")
    if checkpoint.get("verified") is not True or not isinstance(has, int):
        has = 0
    return has if step != has else None


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


def condition(s: Situation, kind: str, status: Literal["True", "False", "Unknown"],
              reason: str, message: str) -> Condition:
    """A condition of this decision; its lastTransitionTime only moves when `status`
    changes."""
    prev = next((c for c in s.stored.get("conditions") or [] if c.get("type") == kind), None)
    # A stored time that is no time (a hand-written status) is not carried over.
    moved = prev is None or prev.get("status") != status \
        or parse_timestamp(prev.get("lastTransitionTime")) is None
    return Condition(
        type=kind, status=status, reason=reason, message=message[:MESSAGE_MAX],
        last_transition_time=timestamp(s.now) if moved or prev is None
        else prev["lastTransitionTime"],
        observed_generation=s.job.generation,
    )


def build_status(s: Situation, phase: str, conditions: list[Condition],
                 recovery: RecoveryStatus, finished: bool = False,
                 since: str | None = None) -> Obj:
    """The operator's status fields: `since` is when a start-up began (kept only while the
    phase is a starting one); `finished` stamps finishedAt once."""
    out: Obj = {
        "phase": phase,
        "observedGeneration": s.job.generation,
        "conditions": [c.model_dump(by_alias=True) for c in conditions],
        "recovery": recovery.model_dump(by_alias=True, exclude_unset=True, exclude_none=True),
    }
    if since is not None and phase in STARTING_PHASES:
        out["startingSince"] = since
    started = s.stored.get("startedAt")
    if parse_timestamp(started) is None:
        started = None  # not a time: a hand-written status
    if started is None and phase == Phase.running.value:
        started = timestamp(s.now)
    if started:
        out["startedAt"] = started
    # Only a finished job has one (a hand-written one on a job that runs is dropped).
    finished_at = None
    if finished:
        stored = s.stored.get("finishedAt")
        finished_at = stored if parse_timestamp(stored) is not None else timestamp(s.now)
    if finished_at:
        out["finishedAt"] = finished_at
    return out


def recovery_status(s: Situation, action: str | None, next_at: str | None = None,
                    last_failure: LastFailure | None = None) -> RecoveryStatus:
    """status.recovery of this decision; `last_failure` replaces the stored one, after the
    stored one has measured the steps lost by the attempt that runs now."""
    rec = s.recovery.model_dump(exclude=DERIVED_RECOVERY_FIELDS, exclude_unset=True)
    rec.update(restarts=s.restarts, action=action, next_attempt_at=next_at)
    if s.job.spec is not None:
        rec["max_restarts"] = s.job.spec.recovery.max_restarts
    driver = s.obs.driver
    rec.update(resume_figures(s.restarts, rec.get("last_failure"), s.stored.get("resumed"),
                              driver.uid if driver else None))
    if last_failure is not None:
        rec["last_failure"] = last_failure
    return RecoveryStatus.model_validate(rec)


def scheduling_conditions(s: Situation) -> list[Condition]:
    """Scheduled (which pods cannot be placed, and why) and Suspended (not)."""
    stuck = [p for p in s.obs.compute if p.unschedulable and not p.deleting]
    if stuck:
        message = job_unschedulable_message(s.job.name, s.spec, stuck)
        sched = condition(s, "Scheduled", "False", "Unschedulable", message)
    elif not s.all_scheduled():
        live = len([p for p in s.live() if p.node])
        sched = condition(s, "Scheduled", "False", "WaitingForPods",
                          f"{live} of {sum(s.expected().values())} compute pods are placed")
    else:
        sched = condition(s, "Scheduled", "True", "AllPodsScheduled",
                          "every compute pod is bound to a node")
    return [sched, condition(s, "Suspended", "False", "NotSuspended", "")]


def waiting_for(s: Situation) -> str:
    """What start-up still waits for, when nothing in particular blocks it."""
    running = [p for p in s.live() if p.phase == "Running" and p.ready]
    out = f"{len(running)} of {sum(s.expected().values())} compute pods run"
    driver = s.obs.driver
    if driver is not None and not driver.deleting:
        how = f" ({driver.waiting})" if driver.waiting else ""
        out += f"; the driver pod {driver.name} is {driver.phase}{how}"
    else:
        out += "; the driver pod is not created yet"
    return "; ".join([out, *_node_waits(s)])


def _node_waits(s: Situation) -> list[str]:
    """Nodes of the job's pods that are not Ready and not counted lost yet, and when they
    will be (their pods force-deleted, a running attempt restarted as NodeLost)."""
    return [f"{outage.describe(node)}; its pods count as lost at {timestamp(outage.lost_at)} "
            "unless it is Ready again"
            for node, outage in sorted(s.obs.pending_losses().items())
            if outage.lost_at is not None]


def _pod_wait(pod: PodView) -> str:
    """What a pod that is not Ready waits for, in the kubelet's words where it gave some."""
    if pod.phase == "Running":
        return f"{pod.name} (Running, not Ready)"
    return f"{pod.name} ({pod.phase}: {pod.waiting})" if pod.waiting \
        else f"{pod.name} ({pod.phase})"


def not_ready(s: Situation) -> str | None:
    """While the attempt's driver runs: which of its pods are not Ready and what each waits
    for (a container being created or its image pulled, a readiness probe, a node that is not
    Ready); None when every pod is Ready. A report, not a failure: the job is not failed for
    it, and no start-up deadline runs."""
    driver = s.obs.driver
    pods = [*([driver] if driver is not None else []), *s.live()]
    waiting = [p for p in pods if not (p.phase == "Running" and p.ready)]
    nodes = _node_waits(s)
    if not waiting and not nodes:
        return None
    parts = ["the driver runs"]
    if waiting:
        shown = [_pod_wait(p) for p in waiting[:MAX_LISTED_PODS]]
        more = len(waiting) - MAX_LISTED_PODS
        parts.append("not Ready: " + ", ".join(shown) + (f" and {more} more" if more > 0
                                                          else ""))
    return "; ".join([*parts, *nodes])


def started_condition(s: Situation, since: str, problem: Problem | None) -> Condition:
    """Started (False) while a start-up runs: what blocks it or what it waits for, and its
    deadline."""
    deadline = s.deadline(since)
    timeout = s.spec.recovery.startup_timeout_seconds
    when = (f"start-up began at {since}; the job fails at {timestamp(deadline)} unless it has "
            f"started (spec.recovery.startupTimeoutSeconds: {timeout})"
            if deadline is not None else
            f"start-up began at {since}; no deadline (spec.recovery.startupTimeoutSeconds: "
            "0)")
    if problem is not None:
        return condition(s, "Started", "False", problem.reason, f"{problem.message}; {when}")
    return condition(s, "Started", "False", "Starting", f"{waiting_for(s)}; {when}")
