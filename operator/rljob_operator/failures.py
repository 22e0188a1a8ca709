"""Failure detection: what broke a running attempt, and what keeps one from starting.

Pure: (observed children, what the runtime reported in `status.runtimeFailure`) → a
`Failure` or a `Problem`, most specific cause first, with the pods named.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rljob_api import exits
from rljob_api.layout import ROLLOUT
from rljob_api.spec import FailureKind, RLJobSpec
from rljob_api.status import MESSAGE_MAX, RecoveryStatus, parse_timestamp
from rljob_operator import names
from rljob_operator.builders import checkpoint_claim_name, claim_names
from rljob_operator.observe import FailureHint, Observed, PodView

Obj = dict[str, Any]
MAX_LISTED_PODS = 5


@dataclass(frozen=True)
class Failure:
    """What broke the running attempt."""

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


def pod_list(pods: list[str]) -> str:
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
        part = f"{len(names_)} pod(s) cannot be scheduled ({pod_list(names_)}): {reason}"
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


def job_unschedulable_message(job: str, spec: RLJobSpec, pods: list[PodView]) -> str:
    """`unschedulable_message` with the claims the job's pods mount."""
    return unschedulable_message(pods, claim_names(job, spec), checkpoint_claim_name(job, spec))


def unshared_claim_message(claim: str, modes: tuple[str, ...]) -> str:
    """Why a user's checkpoint claim without ReadWriteMany cannot work, and the fixes."""
    return (f"spec.checkpoint.pvc: the claim {claim} has access modes "
            f"{', '.join(modes) or 'none'}, but the driver, the Ray head, the trainers and the "
            "engines are different pods, often on different nodes, that all write the "
            "checkpoint directory: it must be a ReadWriteMany claim (NFS, CephFS, a cloud file "
            "store), or leave spec.checkpoint.pvc unset and set spec.checkpoint.storageClassName "
            "to a class that provides ReadWriteMany volumes")


# -- a running attempt ---------------------------------------------------------------------


def _node_lost(node: str | None, pod: str, obs: Observed) -> Failure:
    outage = obs.outages.get(node) if node is not None else None
    message = outage.describe(str(node)) if outage is not None \
        else f"node {node} is not Ready or was removed"
    return Failure(FailureKind.node_lost.value, message, pod)


def _gone(name: str, hint: FailureHint | None) -> Failure:
    """A pod that is no longer there: its failure when the watch saw one, else a deletion."""
    if hint is not None:
        return Failure(hint.kind, hint.message, name)
    return Failure(FailureKind.pod_deleted.value, "the pod was deleted", name)


def detect_failure(driver: PodView, obs: Observed, runtime: Obj | None) -> Failure | None:
    """The first sign that the running attempt of `driver` is broken, most specific cause
    first; `runtime` is `status.runtimeFailure` as stored."""
    if driver.node in obs.lost_nodes:
        return _node_lost(driver.node, driver.name, obs)
    if driver.failure is not None:
        doomed = terminal_exit(driver, runtime)
        if doomed is not None:
            return doomed
        lost = lost_worker(driver, obs, runtime)
        if lost is not None:
            return lost
        kind = driver.failure.kind
        if kind == FailureKind.pod_failed.value:
            kind = FailureKind.driver_failed.value
        message = driver.failure.message
        if runtime:
            message = f"{runtime.get('reason')}: {runtime.get('message', '')}; {message}"
        reported = attempt_failure(driver, runtime)
        stranded = _on_a_node_out(obs, driver.recorded_compute)
        if stranded is not None and reported.get("reason") == exits.WORKER_FAILED and \
                _explains(obs.outages[str(stranded.node)].since,
                          parse_timestamp(reported.get("time"))):
            # Ray's head went with its node: the runtime could not ask a dead GCS which pods
            # were lost, and the driver failed on what Ray said. The node names the cause.
            lost = _node_lost(stranded.node, stranded.name, obs)
            return Failure(lost.kind, f"{lost.message}; the driver failed first: "
                                      f"{message}"[:MESSAGE_MAX], stranded.name)
        return Failure(kind, message, driver.name)
    recorded = driver.recorded_compute
    for pod in obs.compute:
        if pod.node in obs.lost_nodes and pod.name in recorded:
            return _node_lost(pod.node, pod.name, obs)
    for pod in obs.compute:
        if pod.failure is not None and pod.name in recorded:
            return Failure(pod.failure.kind, pod.failure.message, pod.name)
    present = {p.name for p in obs.compute if not p.deleting}
    missing = sorted(recorded - present)
    if missing:
        return _gone(missing[0], obs.hints.get(missing[0]))
    return None


def attempt_failure(driver: PodView, runtime: Obj | None) -> Obj:
    """`status.runtimeFailure` when the runtime of this driver's attempt reported it (not one
    left over from an earlier attempt); else {}."""
    runtime = runtime or {}
    reported = parse_timestamp(runtime.get("time"))
    started = parse_timestamp(driver.failure.started_at if driver.failure else None)
    if reported is None or started is None or reported >= started:
        return runtime
    return {}


def terminal_exit(driver: PodView, runtime: Obj | None) -> Failure | None:
    """A driver that exited with a code saying a restart cannot help (invalid job,
    non-finite values): a non-retryable failure, named after the runtime's own reason when
    this attempt's runtime reported one, else after the exit code."""
    hint = driver.failure
    code = hint.exit_code if hint is not None else None
    if hint is None or code not in exits.TERMINAL_REASONS:
        return None
    reason = exits.TERMINAL_REASONS[code]
    message = (f"the driver exited with code {code}: {exits.TERMINAL_MEANING[code]}; "
               "a restart cannot help, so the job is not retried")
    reported = attempt_failure(driver, runtime)
    if reported.get("reason"):
        reason = str(reported["reason"])
        detail = reported.get("message")
        message += f"; {reason}: {detail}" if detail else f"; {reason}"
    return Failure(reason, message, driver.name, retryable=False)


def lost_worker(driver: PodView, obs: Observed, runtime: Obj | None) -> Failure | None:
    """The driver failed because Ray lost the node of pods its runtime names
    (`runtimeFailure.lostPods`): the failure is named after what Kubernetes knows of those
    pods (a node that is not Ready, a deletion, a failure). Ray usually notices first (a
    node's NotReady takes Kubernetes about 50 s by default), so until Kubernetes agrees it is
    `WorkerLost`, renamed while the job recovers (`refine_last_failure`)."""
    reported = attempt_failure(driver, runtime)
    lost = [str(p) for p in reported.get("lostPods") or []]
    if not lost:
        return None
    pods = {p.name: p for p in obs.compute}
    for name in lost:
        pod = pods.get(name)
        # The attempt already failed: a node that is not Ready names the cause, lost or not
        # (yet); counting it lost only decides whether its pods are force-deleted.
        if pod is not None and pod.node in obs.outages:
            return _node_lost(pod.node, name, obs)
    for name in lost:
        pod = pods.get(name)
        if pod is None or pod.deleting:
            return _gone(name, obs.hints.get(name))
        if pod.failure is not None:
            return Failure(pod.failure.kind, pod.failure.message, name)
    return Failure(FailureKind.worker_lost.value, str(reported.get("message") or
                                                      "Ray lost the pod's node"), lost[0])


def _on_a_node_out(obs: Observed, names: Collection[str]) -> PodView | None:
    """The first compute pod of `names` on a node that is not Ready."""
    return next((p for p in obs.compute if p.node in obs.outages and p.name in names), None)


# How long before and after a worker failure a node's outage may begin to explain it: Ray
# fails on a lost node within seconds, Kubernetes marks the node NotReady only after its
# node-monitor grace (50 s by default), and an outage that began earlier may have been the
# cause all along.
OUTAGE_BEFORE_S = 300.0
OUTAGE_AFTER_S = 120.0


def _explains(since: datetime | None, failed: datetime | None) -> bool:
    """Whether a node outage that began at `since` (None: the node is gone) can be why a
    worker failed at `failed`."""
    if since is None or failed is None:
        return True
    return -OUTAGE_BEFORE_S <= (since - failed).total_seconds() <= OUTAGE_AFTER_S


def refine_last_failure(recovery: RecoveryStatus, obs: Observed,
                        engines_replaced: bool = False) -> RecoveryStatus:
    """A failure Kubernetes explains only later, renamed `NodeLost` once it does, before the
    next attempt starts (which waits for the pods' replacements): a `WorkerLost` (Ray lost a
    pod's node before Kubernetes noticed) once that pod's node is seen not Ready, and a
    `DriverFailed` on the runtime's `WorkerFailed` once a compute pod's node stopped being
    Ready close enough to the failure (Ray's head went with its node, and the driver failed
    on what Ray said). The reason then says what happened, the message
    what was seen first. A rollout pod never explains a driver failure where engines are
    replaced (`engines_replaced`): its loss costs no attempt."""
    last = recovery.last_failure
    if last is None:
        return recovery
    if last.reason == FailureKind.worker_lost.value:
        pod = next((p for p in obs.compute if p.name == last.pod), None)
        first = "Ray saw it first"
    elif last.reason == FailureKind.driver_failed.value and \
            last.message.startswith(f"{exits.WORKER_FAILED}:"):
        pod = next((p for p in obs.compute if p.node in obs.outages
                    and not (engines_replaced and p.component == ROLLOUT)
                    and _explains(obs.outages[str(p.node)].since, parse_timestamp(last.time))),
                   None)
        first = "the driver failed first"
    else:
        return recovery
    if pod is None or pod.node not in obs.outages:
        return recovery
    outage = obs.outages[str(pod.node)]
    message = f"{outage.describe(str(pod.node))}; {first}: {last.message}"[:MESSAGE_MAX]
    refined = last.model_copy(update={"reason": FailureKind.node_lost.value, "message": message,
                                      "pod": pod.name})
    return recovery.model_copy(update={"last_failure": refined})


# -- a start-up ----------------------------------------------------------------------------


def startup_problem(obs: Observed, job: str, spec: RLJobSpec, since: str) -> Problem | None:
    """The first thing blocking the start-up that began at `since`, most specific first:
    containers that cannot start (image pulls, crashes), compute pods failing while
    starting, unschedulable pods. The pods are named, with the kubelet's or scheduler's
    words."""
    driver = obs.driver if obs.driver is not None and not obs.driver.deleting else None
    pods = [p for p in obs.compute if not p.deleting] + ([driver] if driver else [])
    stuck = [p for p in pods if p.stuck is not None]
    if stuck:
        first = stuck[0].stuck
        assert first is not None
        same = [p.name for p in stuck if p.stuck is not None
                and p.stuck.reason == first.reason]
        return Problem(first.reason, f"{first.reason} in pod(s) {pod_list(same)}: "
                       f"container {first.container}: {first.message}", stuck[0].name)
    started = parse_timestamp(since)
    failed = {p.name: p.failure for p in obs.compute if p.failure is not None}
    present = {p.name for p in obs.compute}
    for name, hint in obs.hints.items():
        seen = parse_timestamp(hint.seen_at)
        if name not in present and seen is not None and started is not None \
                and seen >= started and name != names.driver_name(job):
            failed[name] = hint
    if failed:
        pod_names = sorted(failed)
        detail = failed[pod_names[0]]
        assert detail is not None
        return Problem("CrashLoop", f"{len(pod_names)} compute pod(s) failed while "
                       f"starting ({pod_list(pod_names)}): {detail.message}; KubeRay "
                       "replaces them, so this repeats until the cause is fixed",
                       pod_names[0])
    unschedulable = [p for p in pods if p.unschedulable]
    if unschedulable:
        return Problem("Unschedulable", job_unschedulable_message(job, spec, unschedulable),
                       unschedulable[0].name)
    return None
