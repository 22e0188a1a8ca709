"""One reconcile of one RLJob: read, decide (pure), write status, act.

The status is written before the actions, so a crash between the two leaves a status that
the next reconcile, recomputing from the same stored state, turns into the same actions;
actions are idempotent, and child names are fixed, so nothing is ever duplicated.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes.client.exceptions import ApiException

from rljob_api.status import Phase, parse_timestamp, timestamp
from rljob_operator import builders, names
from rljob_operator.admission import WorkloadStep
from rljob_operator.builders import JobRef, Obj
from rljob_operator.cache import POD, RAYCLUSTER, RLJOB, NodeCache, Store, pod_unready
from rljob_operator.config import NODE_LOST_AFTER_SECONDS
from rljob_operator.controller import GONE, Gone
from rljob_operator.decision import Actions, Decision, Event
from rljob_operator.engine_events import engine_events, seen
from rljob_operator.kube import Kube, NamespaceTerminating, ObjectInTheWay
from rljob_operator.kueue import Flavored, QueueState, place_driver, place_raycluster
from rljob_operator.memory import ClaimModes, Ensured, Memory, SupportCheck
from rljob_operator.metrics import Metrics
from rljob_operator.observe import Relabel, label_repairs, observe, owned_by
from rljob_operator.phases import decide
from rljob_operator.situation import JobView, parse_job
from rljob_operator.status import STARTING_PHASES, needs_write
from rljob_operator.support import (
    SUPPORT_RECHECK_MAX_SECONDS,
    SUPPORT_RECHECK_SECONDS,
    Support,
    spec_version,
)
from rljob_operator.workloads import Workloads

log = logging.getLogger("rljob_operator")
SAFETY_RESYNC_SECONDS = 600.0
OVERDUE_SECONDS = 10.0
STUCK_SECONDS = 120.0


# The Workload steps that hand quota back to Kueue.
QUOTA_BACK = frozenset({WorkloadStep.release, WorkloadStep.finish, WorkloadStep.unhold,
                        WorkloadStep.drop})


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Reconciler:
    """With a `store` (the watch cache), a reconcile reads the job, its RayCluster and pods
    from it, and each job is read fresh from the API server once per `resync` seconds (at a
    per-job offset, so that hundreds of jobs do not resync together); without one, every
    reconcile reads the API server. `kube` is made with the same store, which it tells of
    the operator's own writes. `memory` holds what is remembered of each job between
    reconciles."""

    def __init__(self, kube: Kube, metrics: Metrics, memory: Memory,
                 clock: Callable[[], datetime] = _utcnow, store: Store | None = None,
                 nodes: NodeCache | None = None,
                 resync: float = SAFETY_RESYNC_SECONDS,
                 monotonic: Callable[[], float] = time.monotonic,
                 node_lost_after: float = NODE_LOST_AFTER_SECONDS,
                 workloads: Workloads | None = None) -> None:
        self.kube = kube
        self.metrics = metrics
        self.memory = memory
        self.clock = clock
        self.store = store
        self.nodes = nodes or NodeCache(kube.list_nodes, ttl=0.0, min_age=0.0)
        self.resync = resync
        self.monotonic = monotonic
        self.node_lost_after = node_lost_after
        self.workloads = workloads  # None: the Kueue integration is off
        # For the support objects' creates, which go out together.
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rljob-support")

    def _due_fresh(self, namespace: str, name: str, overdue: bool = False) -> bool:
        """Whether this reconcile reads the API server: the first sight of a job (a new one,
        or every job after the operator starts: kopf's initial listing has no end marker),
        the safety resync, the first reconcile after a watch listed again and may have
        missed deletions, or (at most every OVERDUE_SECONDS) a cached child whose deletion
        is overdue. A read that fails leaves the reason standing."""
        if self.store is None:
            return True
        now = self.monotonic()
        relisted = self.store.relisted_at
        last = self.memory.snapshot((namespace, name)).fresh_at
        if last is None or now - last >= self.resync:
            return True
        if relisted is not None and relisted > last:
            return True
        return overdue and now - last >= OVERDUE_SECONDS

    def _read_fresh(self, namespace: str, name: str, started: float) -> None:
        """A fresh read succeeded: the next is due a resync period later (the first one at
        a per-job offset, so that hundreds of jobs do not resync together)."""
        with self.memory.job((namespace, name)) as job:
            if job.fresh_at is not None:
                job.fresh_at = started
            else:
                offset = zlib.crc32(f"{namespace}/{name}".encode()) % 1000 / 1000
                job.fresh_at = started - offset * self.resync

    def _overdue(self, objs: list[Obj | None]) -> bool:
        """A child past its deletion time by OVERDUE_SECONDS: gone by now, or about to be, so
        a cached copy that still shows it may have missed its deletion event; the job would
        wait on it (StoppingDriver) until the safety resync."""
        now = self.clock()
        late, stuck = now - timedelta(seconds=OVERDUE_SECONDS), now - timedelta(
            seconds=STUCK_SECONDS)
        for obj in objs:
            when = parse_timestamp(((obj or {}).get("metadata") or {}).get("deletionTimestamp"))
            # One held up for long (a finalizer, a node that went away) is no missed event:
            # it is left to the safety resync instead of a read every OVERDUE_SECONDS.
            if when is not None and stuck < when < late:
                return True
        return False

    def _read(self, namespace: str, name: str) -> tuple[Obj | None, Obj | None, list[Obj]]:
        """The job, its RayCluster and its pods: from the cache, or fresh (then the cache is
        brought up to what was read; a job the API server no longer has leaves it)."""
        store = self.store
        held: set[tuple[str, str]] = set()
        if store is not None:
            body = store.rljob(namespace, name)
            cluster, pods = store.raycluster(namespace, name), store.pods(namespace, name)
            held = {(POD, p["metadata"]["name"]) for p in pods}
            if cluster is not None:
                held.add((RAYCLUSTER, cluster["metadata"]["name"]))
            if body is not None and not self._due_fresh(
                    namespace, name, overdue=self._overdue([cluster, *pods])):
                return body, cluster, pods
            # Not in the cache (yet): a job that is new or gone; the API server tells which.
        started = self.monotonic()
        body = self.kube.get_rljob(namespace, name)
        if body is None:
            if store is not None:
                store.drop_job((namespace, name))
            return None, None, []
        clusters, clusters_rv = self.kube.list_rayclusters(namespace, name)
        pods, pods_rv = self.kube.list_pods(namespace, name)
        if store is not None:
            clusters, pods = self._unlabelled(body, held, clusters, pods)
        if store is None:
            mine = names.raycluster_name(name)
            return body, next((c for c in clusters if c["metadata"]["name"] == mine), None), pods
        store.put(RLJOB, body)
        store.replace_children(RAYCLUSTER, (namespace, name), clusters, clusters_rv)
        store.replace_children(POD, (namespace, name), pods, pods_rv)
        self._read_fresh(namespace, name, started)
        return (store.rljob(namespace, name), store.raycluster(namespace, name),
                store.pods(namespace, name))

    def _unlabelled(self, body: Obj, held: set[tuple[str, str]], clusters: list[Obj],
                    pods: list[Obj]) -> tuple[list[Obj], list[Obj]]:
        """A fresh read lists children by the job label. The children the store held
        (`held`: kind and name) that the lists lack are read by name: gone (most often), or
        with their label removed by hand; one of those is still the job's if it is owned by
        it (the RayCluster and the driver by an owner reference with the job's UID, a
        compute pod by the job's RayCluster as its controller), and it stays (and is
        labelled again). Without this, a running pod would be taken for a deleted one and
        the job restarted. Only what was held is read: a job's first read, and a resync
        that finds what it held, cost no extra requests."""
        meta = body["metadata"]
        found = {RAYCLUSTER: list(clusters), POD: list(pods)}
        for kind, child in sorted(held, key=lambda k: k[0] != RAYCLUSTER):
            if any(o["metadata"]["name"] == child for o in found[kind]):
                continue
            fresh = self.kube.get_child(kind, meta["namespace"], child)
            if fresh is None:
                continue
            owners = fresh.get("metadata") or {}
            cluster = next((c for c in found[RAYCLUSTER] if c["metadata"]["name"]
                            == names.raycluster_name(meta["name"])), None)
            ours = owned_by(owners, meta["uid"]) or (
                kind == POD and cluster is not None
                and owned_by(owners, str(cluster["metadata"].get("uid"))))
            if ours:
                found[kind].append(fresh)
        return found[RAYCLUSTER], found[POD]

    def _claim_modes(self, namespace: str, job: str, claim: str) -> tuple[str, ...] | None:
        """The access modes of the job's checkpoint claim. A claim's modes cannot change, so
        ones found are remembered while the job runs; a claim deleted and made again under
        the same name may have others, and matters only to pods that start, so they are
        read again whenever the job's support objects are checked (`_support_due`: when it
        starts waiting, then ever less often while it waits). A missing claim is looked for
        at every reconcile (the job waits for it)."""
        known = self.memory.snapshot((namespace, job)).claim
        if known is not None and known.claim == claim:
            return known.modes
        modes = self.kube.claim_access_modes(namespace, claim)
        if modes is not None:
            with self.memory.job((namespace, job)) as held:
                held.claim = ClaimModes(claim, modes)
        return modes

    def forget(self, namespace: str, name: str, reads: bool = True) -> None:
        """The job was deleted: drop what is remembered of it (with hundreds of jobs made and
        deleted, anything kept per job would grow without end). `reads=False` keeps when it
        was last read fresh, for a job still there, being deleted (else each reconcile of it
        would read it fresh, as a first sight)."""
        self.metrics.set_phase((namespace, name), None)
        self.metrics.set_engines((namespace, name), None)
        self.memory.forget((namespace, name), keep_reads=not reads)
        if reads and self.workloads is not None:
            self.workloads.forget((namespace, name))

    def reconcile(self, namespace: str, name: str) -> float | Gone | None:
        """Bring one job one step closer to its desired state; returns seconds until it
        wants to be looked at again (None: the regular interval), GONE when the job no longer
        exists, or raises."""
        with self.metrics.reconcile_seconds.time():
            try:
                after = self._reconcile(namespace, name)
            except NamespaceTerminating:
                # The job goes with its namespace: nothing to make, nothing to report.
                after = None
            except Exception:
                self.metrics.reconciles.labels(result="error").inc()
                raise
            finally:
                if self.store is not None and self.store.rljob(namespace, name) is None:
                    # Deleted while this reconcile ran (or it raised, or returned early):
                    # what it remembered after the deletion's own clean-up is dropped now
                    # (else a gauge entry and per-job state per such job stay).
                    self.forget(namespace, name)
        self.metrics.reconciles.labels(result="ok").inc()
        return after

    def _reconcile(self, namespace: str, name: str) -> float | Gone | None:
        body, cluster, pods = self._read(namespace, name)
        if body is None:
            # Gone (its deletion may have fallen in a watch gap): no more reconciles.
            self.forget(namespace, name)
            return GONE
        if body["metadata"].get("deletionTimestamp"):
            # Children go with the RLJob through owner references; its Kueue Workload once
            # Kueue's finalizer is off (a foreground deletion waits for it).
            if self.workloads is not None:
                self.workloads.let_go(JobRef.of(body))
            self.forget(namespace, name, reads=False)
            return None
        job = parse_job(body)
        ref = JobRef.of(body)
        used = [str(p["spec"]["nodeName"]) for p in pods if p.get("spec", {}).get("nodeName")]
        nodes = self.nodes.get(used, hurry=any(pod_unready(p) for p in pods)) if used else []
        in_the_way = self.memory.snapshot((namespace, name)).in_the_way
        if in_the_way is not None:  # still there, still not ours?
            in_the_way = self.kube.in_the_way(in_the_way.kind, namespace, in_the_way.name,
                                              ref.uid)
            if in_the_way is None:
                with self.memory.job((namespace, name)) as held:
                    held.in_the_way = None
        repairs = label_repairs(name, ref.uid, cluster, pods)
        if repairs:
            self._relabel(body, repairs)
        now = self.clock()
        observed = observe(name, cluster, pods, nodes,
                           self.memory.hints((namespace, name)), uid=ref.uid,
                           in_the_way=in_the_way, now=now,
                           node_lost_after=self.node_lost_after)
        if job.spec is not None and job.spec.checkpoint.pvc:
            observed = replace(observed, checkpoint_modes=self._claim_modes(
                namespace, name, job.spec.checkpoint.pvc))
        if self.workloads is not None:
            # Also for a job that names no queue (any more) or whose spec is invalid: a
            # Workload it still has must give its quota back.
            observed = replace(observed, queue=self.workloads.state(ref, body, job.queue,
                                                                    job.spec))
        elif job.spec is not None and job.queue is not None:
            observed = replace(observed, queue=QueueState(job.queue, False))
        decision = decide(job, observed, now)
        if decision.hold_step is not None:
            self.kube.hold_step(namespace, name, decision.hold_step,
                                body["metadata"]["resourceVersion"])
        if needs_write(job.status, decision.status):
            fix = self.kube.apply_status(namespace, name, decision.status)
            if fix:
                log.warning("%s/%s: status fields written by someone else were replaced by "
                            "the operator's: %s", namespace, name, ", ".join(sorted(fix)))
            self.metrics.status_writes.inc()
            self._count(body, job.status, decision.status, now)
        if decision.event is not None:
            log.info("%s/%s: %s: %s", namespace, name, decision.event.reason,
                     decision.event.message)
            self.kube.post_event(body, decision.event)
        if decision.actions.workload is not None and observed.queue is not None \
                and self.workloads is not None:
            self._workload(ref, job, observed.queue, decision, now, observed.lost_nodes)
        self._engine_events(body, job.status.get("engines"))
        self.metrics.set_engines((namespace, name), job.status.get("engines"))
        if decision.restart is not None:
            self.metrics.restarts.labels(reason=decision.restart.kind).inc()
        try:
            waiting = job.spec is not None and observed.in_the_way is None \
                and decision.phase in STARTING_PHASES
            # While pods wait, what they mount is made again if it went missing (e.g. the
            # claim of a deleted job of the same name was still terminating at creation);
            # once this job has made all of it, only every SUPPORT_RECHECK_MAX_SECONDS.
            generation = body["metadata"].get("generation")
            due = self._support_due(ref, generation, waiting)
            support = Support(self.kube, ref, body, job.spec, self._pool) \
                if job.spec is not None else None
            placement = observed.queue.placement if observed.queue is not None else {}
            again = self._act(ref, body, job, decision.actions, decision.restarts, support,
                              check=due, cluster_present=observed.cluster == "present",
                              placement=placement)
            if support is not None and support.ran:
                with self.memory.job((namespace, name)) as held:
                    held.ensured = Ensured(spec_version(ref, generation), self.monotonic())
            if support is not None and support.all_made:
                self._support_made(ref, generation)
            if again:
                return 0.0
        except ObjectInTheWay as err:
            # Not adopted, not touched: the next reconcile (at once) says so in the status.
            log.warning("%s/%s: %s is in the way", namespace, name, err)
            with self.memory.job((namespace, name)) as held:
                held.in_the_way = err.found
            return 0.0
        self.metrics.set_phase((namespace, name), decision.phase)
        return decision.requeue_after

    def _workload(self, ref: JobRef, job: JobView, queue: QueueState, decision: Decision,
                  now: datetime, lost_nodes: frozenset[str]) -> None:
        """The decision's change to the job's Kueue Workload; a finished job's says how it
        ended."""
        assert self.workloads is not None and decision.actions.workload is not None
        step = WorkloadStep(decision.actions.workload)
        if step in QUOTA_BACK:
            # The pods' watch may not have told of a pod made just before its RayCluster
            # went: the quota goes back only if the API server lists none either.
            pods, _ = self.kube.list_pods(ref.namespace, ref.name)
            if any((p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
                   and (p.get("spec") or {}).get("nodeName") not in lost_nodes for p in pods):
                return
        phase = decision.phase
        ended: Obj = next((c for c in decision.status.get("conditions") or []
                      if c.get("type") == phase and c.get("status") == "True"), {})
        log.info("%s/%s: Kueue workload: %s", ref.namespace, ref.name, step.value)
        try:
            self.workloads.apply(step, queue, ref, timestamp(now), job.generation,
                                 message=str(ended.get("message") or ""),
                                 succeeded=phase == Phase.succeeded.value)
        except ApiException as err:
            # Said, and tried again at the next reconcile; the job's own actions go on.
            log.warning("%s/%s: Kueue workload %s refused: %s %s", ref.namespace, ref.name,
                        step.value, err.status, err.reason)

    def _engine_events(self, body: Obj, engines: Any) -> None:
        """An Event for each rollout engine lost or rejoined since the last reconcile."""
        key = (body["metadata"].get("namespace", ""), body["metadata"]["name"])
        report = engines if isinstance(engines, dict) else None
        with self.memory.job(key) as held:
            before, held.engines = held.engines, seen(report) if report else None
        for event in engine_events(before, report):
            log.info("%s/%s: %s: %s", key[0], key[1], event.reason, event.message)
            self.kube.post_event(body, event)

    def _relabel(self, body: Obj, repairs: list[Relabel]) -> None:
        """Labels of the job's own children, removed or changed by hand, put back; said in
        the log and an Event (who edits children by hand should learn it was undone)."""
        meta = body["metadata"]
        for fix in repairs:
            self.kube.relabel(fix.kind, meta["namespace"], fix.name, dict(fix.labels))
        what = ", ".join(f"{f.kind} {f.name} ({', '.join(sorted(f.labels))})"
                         for f in repairs)
        message = f"labels of the job's children edited by hand were put back: {what}"
        log.warning("%s/%s: %s", meta["namespace"], meta["name"], message)
        self.kube.post_event(body, Event("Warning", "ChildRepaired", message))

    def _support_due(self, ref: JobRef, generation: object, waiting: bool) -> bool:
        """Whether the objects the pods mount are checked now: at once when the job starts
        waiting or its spec changes, then after SUPPORT_RECHECK_SECONDS, twice as long each
        time, up to SUPPORT_RECHECK_MAX_SECONDS, while it waits (not on every watch event of
        its pods, each of which would cost six no-op writes: hundreds of jobs waiting on a
        busy cluster would otherwise send hundreds of no-op creates a second); after a check
        that made every one of them, the next waits the longest interval (`_support_made`).
        A check due also drops the checkpoint claim's remembered access modes, read again
        next."""
        now = self.monotonic()
        with self.memory.job((ref.namespace, ref.name)) as job:
            if not waiting:
                job.support = None
                return False
            version = spec_version(ref, generation)
            last = job.support or SupportCheck("", 0.0, 0.0)
            if last.version == version and now - last.at < last.wait:
                return False
            wait = min(2 * last.wait, SUPPORT_RECHECK_MAX_SECONDS) if last.version == version \
                else SUPPORT_RECHECK_SECONDS
            job.support = SupportCheck(version, now, wait)
            # The claim the pods mount is looked at again too (at the next reconcile).
            job.claim = None
            return True

    def _support_made(self, ref: JobRef, generation: object) -> None:
        """Every support object was just made by this job: the next check waits the longest
        interval, SUPPORT_RECHECK_MAX_SECONDS, rather than starting at the shortest (with
        hundreds of jobs waiting minutes for pods, the rechecks' no-op creates would be most
        of the operator's requests). One deleted behind the job's back while it waits is
        still made again, within that interval; a spec edit, or a wait after the job ran,
        checks at once."""
        with self.memory.job((ref.namespace, ref.name)) as job:
            job.support = SupportCheck(spec_version(ref, generation), self.monotonic(),
                                       SUPPORT_RECHECK_MAX_SECONDS)

    def _ensured_lately(self, ref: JobRef, generation: object) -> bool:
        """Whether this job's support objects were all made sure of in the last
        SUPPORT_RECHECK_SECONDS: its RayCluster or driver is then made without a round of
        creates of its own (at the end of a recovery, whose wait begins with a check, such a
        round would sit between the compute pods running and the new driver). One deleted in that
        window is made again at the next check."""
        ensured = self.memory.snapshot((ref.namespace, ref.name)).ensured
        return ensured is not None and ensured.version == spec_version(ref, generation) \
            and self.monotonic() - ensured.at < SUPPORT_RECHECK_SECONDS

    def _count(self, body: Obj, old: Obj, new: Obj, now: datetime) -> None:
        created = parse_timestamp(body["metadata"].get("creationTimestamp"))
        if created is not None and not old.get("startedAt") and new.get("startedAt"):
            self.metrics.time_to_running.observe((now - created).total_seconds())

    def _token_replaced(self, ref: JobRef, body: Obj) -> None:
        """The token Secret was deleted and made anew while the RayCluster runs with the old
        token (its pods read it at start): a driver or pod started now would carry the new one
        and be refused by the head. The RayCluster goes, and the next reconcile makes it
        again, every pod with the new token; the checkpoints are untouched."""
        message = (f"the Ray token Secret {names.ray_token_secret(ref.name, ref.uid)} was "
                   "deleted and made anew; the RayCluster is recreated so that every Ray pod "
                   "uses the new token")
        log.warning("%s/%s: %s", ref.namespace, ref.name, message)
        self.kube.post_event(body, Event("Warning", "RayTokenReplaced", message))
        self.kube.delete_pod(ref.namespace, names.driver_name(ref.name))
        self.kube.delete_raycluster(ref.namespace, names.raycluster_name(ref.name))

    def _act(self, ref: JobRef, body: Obj, job: JobView, actions: Actions, restarts: int,
             support: Support | None, check: bool, cluster_present: bool,
             placement: Mapping[str, Flavored] | None = None) -> bool:
        """Carry out `actions`: deletions first, then (when `check`) the support objects'
        check, then patches and creates. Returns whether the job is to be looked at again at
        once (its Ray token was replaced)."""
        ns = ref.namespace
        placement = placement or {}
        for pod in actions.delete_pods:
            self.kube.delete_pod(ns, pod, force=True)
        if actions.delete_driver:
            # The grace of the current spec (an edit of it applies at once, not only to the
            # next driver pod): its runtime finishes the step and saves within it.
            grace = job.spec.recovery.stop_grace_period_seconds if job.spec else None
            self.kube.delete_pod(ns, names.driver_name(ref.name), grace_s=grace)
        if actions.delete_cluster:
            self.kube.delete_raycluster(ns, names.raycluster_name(ref.name))
        if job.spec is None or support is None:
            return False
        # After the deletions: a due check does not hold up stopping a failed attempt.
        if check and support.ensure() and cluster_present and not actions.delete_cluster:
            self._token_replaced(ref, body)
            return True
        generation = body["metadata"].get("generation")
        if actions.patch_cluster:
            # Patched before its outdated pods go, so KubeRay remakes them from the new spec
            # (one made from a stale cache is outdated too, and goes at the next reconcile).
            self.kube.patch_raycluster(place_raycluster(
                builders.build_raycluster(ref, job.spec), placement))
        for pod in actions.replace_pods:
            self.kube.delete_pod(ns, pod)
        if actions.create_cluster:
            if not self._ensured_lately(ref, generation):
                support.ensure()
            self.kube.create(place_raycluster(builders.build_raycluster(ref, job.spec),
                                              placement), ref.uid)
        if actions.create_driver is not None:
            if not self._ensured_lately(ref, generation) and support.ensure():
                self._token_replaced(ref, body)
                return True
            self.kube.create(place_driver(builders.build_driver(
                ref, job.spec, restarts, list(actions.create_driver)), placement), ref.uid)
        return False
