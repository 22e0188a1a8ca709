"""What one decision knows: the RLJob as stored, its observed children and the clock, with
the facts derived from them that failure detection, status building and phase choice share.

Nothing here decides anything; every value is a pure function of (job, observed, now).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from rljob_api.layout import HEAD
from rljob_api.spec import RLJobSpec
from rljob_api.status import Phase, RecoveryStatus, parse_timestamp, timestamp
from rljob_api.validate import name_problems, queue_name, queue_problems, spec_problems
from rljob_operator.builders import JobRef, Revisions, revisions, worker_groups
from rljob_operator.failures import refine_last_failure
from rljob_operator.observe import Observed, PodView

Obj = dict[str, Any]


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
    queue: str | None = None  # the Kueue LocalQueue it is queued in (`kueue.queue_of`)


def parse_job(body: Obj) -> JobView:
    meta = body["metadata"]
    name = meta["name"]
    raw = body.get("spec")
    spec: RLJobSpec | None = None
    # The same checks as admission (rljob_api.rules), for a job stored before they were
    # there: it fails naming the field instead of making children that can never run.
    errors = [str(p) for p in (*name_problems(meta), *queue_problems(meta, raw),
                               *spec_problems(raw))]
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
        queue=queue_name(meta, raw) if not queue_problems(meta, raw) else None,
    )


def stored_recovery(status: Obj, obs: Observed) -> RecoveryStatus:
    """status.recovery as far as it can be believed. The status subresource takes any
    value of the right type from whoever may write it (`kubectl edit --subresource=status`,
    a runtime gone wrong): a recovery the model refuses is read as empty, and a restart
    count below zero, or below the attempt of the job's own running driver pod (whose
    annotation the operator wrote when it made the pod, after writing that count), is
    taken as the driver's attempt; a count taken at face value would have the driver
    replaced as one of an earlier attempt."""
    try:
        recovery = RecoveryStatus.model_validate(status.get("recovery") or {})
    except ValidationError:
        recovery = RecoveryStatus()
    driver = obs.driver
    floor = max(0, driver.restarts or 0) if driver is not None and not driver.deleting else 0
    if recovery.restarts < floor:
        recovery = recovery.model_copy(update={"restarts": floor})
    return recovery


@dataclass(frozen=True)
class Situation:
    """One decision's inputs and what follows from them directly."""

    job: JobView
    obs: Observed
    now: datetime
    phase: str | None  # as stored
    # status.recovery as stored, its WorkerLost failure refined while the job recovers
    recovery: RecoveryStatus
    restarts: int  # the number of the attempt this decision is about
    edited: bool  # the spec was edited since the last status write: a start-up begins afresh
    # What the current spec builds; children of other revisions are patched or replaced.
    want: Revisions | None

    @classmethod
    def of(cls, job: JobView, obs: Observed, now: datetime) -> Situation:
        phase = job.status.get("phase")
        recovery = stored_recovery(job.status, obs)
        if phase == Phase.recovering.value:
            recovery = refine_last_failure(
                recovery, obs, job.spec is not None and job.spec.replaces_engines())
        observed = job.status.get("observedGeneration")
        want = None
        if job.spec is not None:
            want = revisions(JobRef(job.name, job.namespace, job.uid), job.spec)
        return cls(job=job, obs=obs, now=now, phase=phase, recovery=recovery,
                   restarts=recovery.restarts,
                   edited=observed is not None and observed != job.generation, want=want)

    @property
    def stored(self) -> Obj:
        """The job's status as stored (the runtime's fields included)."""
        return self.job.status

    @property
    def spec(self) -> RLJobSpec:
        """The valid spec; only asked for once the job is known to have one."""
        assert self.job.spec is not None
        return self.job.spec

    # -- the compute pods against what the spec builds -------------------------------------

    def expected(self) -> dict[str, int]:
        return {HEAD: 1, **worker_groups(self.spec)}

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
        """The RayCluster was built from another spec, or its worker groups were resized by
        hand: either way it is patched to what the current spec builds."""
        assert self.want is not None
        return self.obs.cluster == "present" and (
            self.obs.cluster_revision != self.want.cluster or bool(self.resized_groups()))

    def resized_groups(self) -> list[str]:
        """Worker groups whose sizes (replicas, minReplicas, maxReplicas) differ from what
        the spec builds, or that the spec does not build: a hand edit the revision
        annotation does not show (KubeRay scales to it, taking or dropping GPUs the job was
        not given or needs)."""
        if self.obs.cluster != "present" or not self.obs.cluster_groups:
            return []
        want = worker_groups(self.spec)
        have = self.obs.cluster_groups
        return sorted(g for g in {*want, *have}
                      if have.get(g) != (want.get(g),) * 3)

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

    def stranded_pods(self) -> tuple[str, ...]:
        """Pods no kubelet will finish: those on lost nodes, and those already being deleted
        on a node that is not Ready (they go in any case, and a replacement waits for them).
        They are force-deleted for KubeRay to replace them elsewhere. A pod that is not
        being deleted on a node that is not Ready yet counts as lost is left alone: the node
        may come back, and its pods with it."""
        pods = [*self.obs.compute, *([self.obs.driver] if self.obs.driver else [])]
        return tuple(p.name for p in pods if p.node in self.obs.lost_nodes
                     or (p.deleting and p.node in self.obs.outages))

    def next_node_loss(self) -> float | None:
        """Seconds until the first node of the job's pods that is not Ready counts as lost
        (None: no such node): the decision is made again at that moment, not a resync
        later."""
        due = [o.lost_at for o in self.obs.pending_losses().values() if o.lost_at is not None]
        return max(0.0, (min(due) - self.now).total_seconds()) if due else None

    # -- the start-up clock ----------------------------------------------------------------

    def starting_since(self, recovering_from: str | None = None) -> str:
        """When the current start-up began: kept from the status, unless the spec was edited
        since (a fix restarts the clock); a restart's start-up begins when its backoff ends."""
        stored = self.stored.get("startingSince")
        if stored and not self.edited and parse_timestamp(stored) is not None:
            return str(stored)
        due = parse_timestamp(recovering_from)
        return timestamp(max(self.now, due) if due is not None else self.now)

    def deadline(self, since: str) -> datetime | None:
        start = parse_timestamp(since)
        timeout = self.spec.recovery.startup_timeout_seconds
        if timeout <= 0 or start is None:
            return None
        return start + timedelta(seconds=timeout)
