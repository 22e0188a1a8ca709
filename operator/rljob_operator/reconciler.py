"""One reconcile of one RLJob: read, decide (pure), write status, act.

The status is written before the actions, so a crash between the two leaves a status that
the next reconcile, recomputing from the same stored state, turns into the same actions;
actions are idempotent, and child names are fixed, so nothing is ever duplicated.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import partial

from rljob_api.spec import RLJobSpec
from rljob_api.status import Phase, parse_timestamp
from rljob_operator import builders, names
from rljob_operator.builders import JobRef, Obj
from rljob_operator.cache import POD, RAYCLUSTER, RLJOB, NodeCache, Store, pod_unready
from rljob_operator.controller import GONE, Gone
from rljob_operator.decide import (
    Actions,
    Event,
    JobView,
    decide,
    needs_write,
    parse_job,
)
from rljob_operator.kube import Kube, NamespaceTerminating, ObjectInTheWay
from rljob_operator.metrics import Metrics
from rljob_operator.observe import FailureHint, InTheWay, observe

log = logging.getLogger("rljob_operator")
MAX_HINTS_PER_JOB = 64


class FailureHints:
    """Pod failures seen on the watch stream, per job; thread-safe and bounded."""

    def __init__(self) -> None:
        self._hints: dict[tuple[str, str], dict[str, FailureHint]] = {}
        self._lock = threading.Lock()

    def record(self, namespace: str, job: str, pod: str, hint: FailureHint) -> None:
        """Remember a pod's failure; a pod seen failed again (every watch re-list repeats its
        events) keeps the time it was first seen."""
        with self._lock:
            per_job = self._hints.setdefault((namespace, job), {})
            known = per_job.get(pod)
            if known is not None and known.seen_at is not None:
                hint = replace(hint, seen_at=known.seen_at)
            per_job[pod] = hint
            while len(per_job) > MAX_HINTS_PER_JOB:
                per_job.pop(next(iter(per_job)))

    def __len__(self) -> int:
        with self._lock:
            return len(self._hints)

    def of(self, namespace: str, job: str) -> dict[str, FailureHint]:
        with self._lock:
            return dict(self._hints.get((namespace, job), {}))

    def forget(self, namespace: str, job: str) -> None:
        with self._lock:
            self._hints.pop((namespace, job), None)


class Conflicts:
    """Per job, the last object found in the way of a child's create. Kept in memory: the
    next reconcile checks it again (a restarted operator finds it on its next create)."""

    def __init__(self) -> None:
        self._found: dict[tuple[str, str], InTheWay] = {}
        self._lock = threading.Lock()

    def record(self, namespace: str, job: str, found: InTheWay) -> None:
        with self._lock:
            self._found[(namespace, job)] = found

    def of(self, namespace: str, job: str) -> InTheWay | None:
        with self._lock:
            return self._found.get((namespace, job))

    def forget(self, namespace: str, job: str) -> None:
        with self._lock:
            self._found.pop((namespace, job), None)

    def jobs(self) -> set[tuple[str, str]]:
        with self._lock:
            return set(self._found)


# Phases in which pods are waiting to start; what they mount is made again if it is missing.
WAITING_PHASES = frozenset({Phase.pending.value, Phase.initializing.value, Phase.recovering.value})
# While pods wait, what they mount is made again (if missing) at most this often per job, and
# at once when the job starts waiting; creates of what exists are no-op writes otherwise.
SUPPORT_RECHECK_SECONDS = 10.0  # the first recheck; each later one waits twice as long,
SUPPORT_RECHECK_MAX_SECONDS = 300.0  # up to this
SAFETY_RESYNC_SECONDS = 600.0
OVERDUE_SECONDS = 10.0
STUCK_SECONDS = 120.0


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _spec_version(ref: JobRef, generation: object) -> str:
    """Which job and spec a support check was for: a new job of the same name, or an edited
    spec, is checked again."""
    return f"{ref.uid}/{generation}"


class Support:
    """What the pods need before they start: RBAC, the Ray token, the checkpoint claim and
    the spec, made (if missing) at most once per reconcile, all of them before the
    RayCluster, so that a job whose child's name is taken starts no pods (and holds no
    GPUs) at all. The creates go out together: a new job's RayCluster waits for one round
    trip, not six. Each is created once (an existing one is kept as it is: the token and
    the checkpoints must survive restarts); only the spec is refreshed. `all_made` says
    whether every create made its object just now (none existed already)."""

    def __init__(self, kube: Kube, ref: JobRef, body: Obj, spec: RLJobSpec,
                 pool: ThreadPoolExecutor) -> None:
        self.kube, self.ref, self.body, self.spec, self.pool = kube, ref, body, spec, pool
        self._done = False
        self.all_made = False
        self.ran = False  # whether this object's ensure() made sure of every one

    def ensure(self) -> bool:
        """Returns whether the Ray token was made by this call (the first time, or after
        someone deleted its Secret)."""
        if self._done:
            return False
        self._done = True
        ref = self.ref
        # A fresh token only matters the first time: the create of an existing Secret is a
        # no-op, so the job keeps the token its Ray processes already use.
        token = builders.build_ray_token_secret(ref, secrets.token_hex(32))
        claim = builders.build_checkpoint_claim(ref, self.spec)
        spec = builders.build_configmap(ref, self.body.get("spec") or {})
        calls: list[Callable[[], object]] = [
            *(partial(self.kube.create, obj, ref.uid) for obj in builders.build_rbac(ref)),
            *([partial(self.kube.create, claim, ref.uid)] if claim is not None else []),
            partial(self.kube.sync_configmap, spec, ref.uid)]
        made = self.pool.submit(self.kube.create, token, ref.uid)
        # .result() raises what the call raised (ObjectInTheWay, API errors)
        others = [bool(done.result()) for done in [self.pool.submit(call) for call in calls]]
        token_made = bool(made.result())
        self.all_made = token_made and all(others)
        self.ran = True
        return token_made


class Reconciler:
    """With a `store` (the watch cache), a reconcile reads the job, its RayCluster and pods
    from it, and each job is read fresh from the API server once per `resync` seconds (at a
    per-job offset, so that hundreds of jobs do not resync together); without one, every
    reconcile reads the API server."""

    def __init__(self, kube: Kube, metrics: Metrics, hints: FailureHints,
                 clock: Callable[[], datetime] = _utcnow, store: Store | None = None,
                 nodes: NodeCache | None = None,
                 resync: float = SAFETY_RESYNC_SECONDS,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.metrics = metrics
        self.hints = hints
        self.clock = clock
        self.conflicts = Conflicts()
        self.store = store
        self.nodes = nodes or NodeCache(kube.list_nodes, ttl=0.0, min_age=0.0)
        self.resync = resync
        self.monotonic = monotonic
        self._fresh_at: dict[tuple[str, str], float] = {}
        # When a job's support objects were last made sure of: (uid and generation, when, the
        # wait before the next check).
        self._support_at: dict[tuple[str, str], tuple[str, float, float]] = {}
        # When each job's support objects were last all made sure of (uid and generation,
        # when): a RayCluster or driver made within SUPPORT_RECHECK_SECONDS of that needs no
        # round of creates of its own.
        self._ensured: dict[tuple[str, str], tuple[str, float]] = {}
        # Per job, its checkpoint claim's name and access modes once found.
        self._claims: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
        # For the support objects' creates, which go out together.
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rljob-support")
        self._lock = threading.Lock()
        if store is not None:
            kube.written = store.put
            kube.removed = store.remove
            kube.vanished = store.vanished

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
        with self._lock:
            last = self._fresh_at.get((namespace, name))
        if last is None or now - last >= self.resync:
            return True
        if relisted is not None and relisted > last:
            return True
        return overdue and now - last >= OVERDUE_SECONDS

    def _read_fresh(self, namespace: str, name: str, started: float) -> None:
        """A fresh read succeeded: the next is due a resync period later (the first one at
        a per-job offset, so that hundreds of jobs do not resync together)."""
        key = (namespace, name)
        with self._lock:
            if key in self._fresh_at:
                self._fresh_at[key] = started
            else:
                offset = zlib.crc32(f"{namespace}/{name}".encode()) % 1000 / 1000
                self._fresh_at[key] = started - offset * self.resync

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
        if store is not None:
            body = store.rljob(namespace, name)
            cluster, pods = store.raycluster(namespace, name), store.pods(namespace, name)
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
        if store is None:
            mine = names.raycluster_name(name)
            return body, next((c for c in clusters if c["metadata"]["name"] == mine), None), pods
        store.put(RLJOB, body)
        store.replace_children(RAYCLUSTER, (namespace, name), clusters, clusters_rv)
        store.replace_children(POD, (namespace, name), pods, pods_rv)
        self._read_fresh(namespace, name, started)
        return (store.rljob(namespace, name), store.raycluster(namespace, name),
                store.pods(namespace, name))

    def _claim_modes(self, namespace: str, job: str, claim: str) -> tuple[str, ...] | None:
        """The access modes of the job's checkpoint claim. A claim's modes cannot change, so
        ones found are remembered while the job runs; a claim deleted and made again under
        the same name may have others, and matters only to pods that start, so they are
        read again whenever the job's support objects are checked (`_support_due`: when it
        starts waiting, then ever less often while it waits). A missing claim is looked for
        at every reconcile (the job waits for it)."""
        key = (namespace, job)
        with self._lock:
            known = self._claims.get(key)
        if known is not None and known[0] == claim:
            return known[1]
        modes = self.kube.claim_access_modes(namespace, claim)
        if modes is not None:
            with self._lock:
                self._claims[key] = (claim, modes)
        return modes

    def remembered(self) -> int:
        """Jobs this reconciler holds state for (resync times, support checks, claims,
        conflicts): none once every job is gone."""
        with self._lock:
            keys = set(self._fresh_at) | set(self._support_at) | set(self._claims) \
                | set(self._ensured)
        return len(keys | self.conflicts.jobs())

    def forget(self, namespace: str, name: str, reads: bool = True) -> None:
        """The job was deleted: drop what is remembered of it (with hundreds of jobs made and
        deleted, anything kept per job would grow without end). `reads=False` keeps when it
        was last read fresh, for a job still there, being deleted (else each reconcile of it
        would read it fresh, as a first sight)."""
        self.metrics.set_phase((namespace, name), None)
        self.hints.forget(namespace, name)
        self.conflicts.forget(namespace, name)
        with self._lock:
            if reads:
                self._fresh_at.pop((namespace, name), None)
            self._support_at.pop((namespace, name), None)
            self._ensured.pop((namespace, name), None)
            self._claims.pop((namespace, name), None)

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
            # Children go with the RLJob through owner references; nothing to do.
            self.forget(namespace, name, reads=False)
            return None
        job = parse_job(body)
        ref = JobRef.of(body)
        used = [str(p["spec"]["nodeName"]) for p in pods if p.get("spec", {}).get("nodeName")]
        nodes = self.nodes.get(used, hurry=any(pod_unready(p) for p in pods)) if used else []
        in_the_way = self.conflicts.of(namespace, name)
        if in_the_way is not None:  # still there, still not ours?
            in_the_way = self.kube.in_the_way(in_the_way.kind, namespace, in_the_way.name,
                                              ref.uid)
            if in_the_way is None:
                self.conflicts.forget(namespace, name)
        observed = observe(name, cluster, pods, nodes,
                           self.hints.of(namespace, name), uid=ref.uid, in_the_way=in_the_way)
        if job.spec is not None and job.spec.checkpoint.pvc:
            observed = replace(observed, checkpoint_modes=self._claim_modes(
                namespace, name, job.spec.checkpoint.pvc))
        now = self.clock()
        decision = decide(job, observed, now)
        if needs_write(job.status, decision.status):
            self.kube.apply_status(namespace, name, decision.status)
            self.metrics.status_writes.inc()
            self._count(body, job.status, decision.status, now)
        if decision.event is not None:
            log.info("%s/%s: %s: %s", namespace, name, decision.event.reason,
                     decision.event.message)
            self.kube.post_event(body, decision.event)
        if decision.restart is not None:
            self.metrics.restarts.labels(reason=decision.restart.kind).inc()
        restarts = int(decision.status.get("recovery", {}).get("restarts") or 0)
        try:
            waiting = job.spec is not None and observed.in_the_way is None \
                and decision.status.get("phase") in WAITING_PHASES
            # While pods wait, what they mount is made again if it went missing (e.g. the
            # claim of a deleted job of the same name was still terminating at creation);
            # once this job has made all of it, only every SUPPORT_RECHECK_MAX_SECONDS.
            generation = body["metadata"].get("generation")
            due = self._support_due(ref, generation, waiting)
            support = Support(self.kube, ref, body, job.spec, self._pool) \
                if job.spec is not None else None
            again = self._act(ref, body, job, decision.actions, restarts, support,
                              check=due, cluster_present=observed.cluster == "present")
            if support is not None and support.ran:
                with self._lock:
                    self._ensured[(namespace, name)] = (_spec_version(ref, generation),
                                                        self.monotonic())
            if support is not None and support.all_made:
                self._support_made(ref, generation)
            if again:
                return 0.0
        except ObjectInTheWay as err:
            # Not adopted, not touched: the next reconcile (at once) says so in the status.
            log.warning("%s/%s: %s is in the way", namespace, name, err)
            self.conflicts.record(namespace, name, err.found)
            return 0.0
        self.metrics.set_phase((namespace, name), decision.status.get("phase"))
        return decision.requeue_after

    def _support_due(self, ref: JobRef, generation: object, waiting: bool) -> bool:
        """Whether the objects the pods mount are checked now: at once when the job starts
        waiting or its spec changes, then after SUPPORT_RECHECK_SECONDS, twice as long each
        time, up to SUPPORT_RECHECK_MAX_SECONDS, while it waits (not on every watch event of
        its pods, each of which would cost six no-op writes: hundreds of jobs waiting on a
        busy cluster would otherwise send hundreds of no-op creates a second); after a check
        that made every one of them, the next waits the longest interval (`_support_made`).
        A check due also drops the checkpoint claim's remembered access modes, read again
        next."""
        key = (ref.namespace, ref.name)
        now = self.monotonic()
        with self._lock:
            if not waiting:
                self._support_at.pop(key, None)
                return False
            version = _spec_version(ref, generation)
            seen, last, wait = self._support_at.get(key, ("", 0.0, 0.0))
            if seen == version and now - last < wait:
                return False
            wait = min(2 * wait, SUPPORT_RECHECK_MAX_SECONDS) if seen == version \
                else SUPPORT_RECHECK_SECONDS
            self._support_at[key] = (version, now, wait)
            # The claim the pods mount is looked at again too (at the next reconcile).
            self._claims.pop(key, None)
            return True

    def _support_made(self, ref: JobRef, generation: object) -> None:
        """Every support object was just made by this job: the next check waits the longest
        interval, SUPPORT_RECHECK_MAX_SECONDS, rather than starting at the shortest (at 500
        jobs waiting minutes for pods, the rechecks' no-op creates were two thirds of the
        operator's requests). One deleted behind the job's back while it waits is still made
        again, within that interval; a spec edit, or a wait after the job ran, checks at
        once."""
        with self._lock:
            self._support_at[(ref.namespace, ref.name)] = (
                _spec_version(ref, generation), self.monotonic(), SUPPORT_RECHECK_MAX_SECONDS)

    def _ensured_lately(self, ref: JobRef, generation: object) -> bool:
        """Whether this job's support objects were all made sure of in the last
        SUPPORT_RECHECK_SECONDS: its RayCluster or driver is then made without a round of
        creates of its own (at the end of a recovery, whose wait begins with a check, that
        round sat between the compute pods running and the new driver). One deleted in that
        window is made again at the next check."""
        with self._lock:
            seen, when = self._ensured.get((ref.namespace, ref.name), ("", 0.0))
        return seen == _spec_version(ref, generation) and \
            self.monotonic() - when < SUPPORT_RECHECK_SECONDS

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
             support: Support | None, check: bool, cluster_present: bool) -> bool:
        """Carry out `actions`: deletions first, then (when `check`) the support objects'
        check, then patches and creates. Returns whether the job is to be looked at again at
        once (its Ray token was replaced)."""
        ns = ref.namespace
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
            self.kube.patch_raycluster(builders.build_raycluster(ref, job.spec))
        for pod in actions.replace_pods:
            self.kube.delete_pod(ns, pod)
        if actions.create_cluster:
            if not self._ensured_lately(ref, generation):
                support.ensure()
            self.kube.create(builders.build_raycluster(ref, job.spec), ref.uid)
        if actions.create_driver is not None:
            if not self._ensured_lately(ref, generation) and support.ensure():
                self._token_replaced(ref, body)
                return True
            self.kube.create(builders.build_driver(ref, job.spec, restarts,
                                                   list(actions.create_driver)), ref.uid)
        return False
