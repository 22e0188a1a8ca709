"""What the operator knows of the cluster between reconciles: a store fed by its watches.

Why: a reconcile that read the RLJob, its RayCluster and its pods from the API server would
cost four requests per job per resync, whether anything changed or not, most of what hundreds
of idle jobs would cost the control plane. kopf holds a watch on each of those kinds (to
kick reconciles); the same events keep a copy of every object here, and a reconcile reads
the copy. The reconciler asks the API server on a job's first reconcile, after a relist, for
a child overdue for deletion, and on a slow per-job safety resync that replaces the copy with
a fresh read (so an event lost in a watch gap costs at most one resync period, never
correctness); the operator's own writes reach the store from their responses (`Kube`).

The store holds the newest version of each object it has seen: an event or a write's
response older than what it holds (a lagging watch delivering an update after the
operator's own write came back) does not roll it back. Resource versions are compared as
integers where both are integers (etcd's revisions, which every API server in use gives),
else the later arrival wins.

A watch that restarts after 410 Gone lists again, and a deletion in the gap has no event:
the store notices the relist (an object delivered as listed that it has heard of before, or
any object delivered as listed after that kind's watch in that namespace has delivered
events: every object of the gap may be gone, and what is listed all new) and every job is
then read fresh once, which drops what vanished in the gap.

Nodes are not watched (their status changes every few seconds on every node and the
operator needs one bit of each): `NodeCache` lists them at most once per `ttl` for all jobs
together, sooner (at most once per `min_age`) when a reconcile sees a pod that is bound but
not ready, which is how a lost node first shows on its pods. A node a job uses that the
list lacks or shows not Ready is believed only from a fresh list read from etcd.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from rljob_api import GROUP
from rljob_operator import names

Obj = dict[str, Any]
Key = tuple[str, str]  # namespace, name
RLJOB = "RLJob"
RAYCLUSTER = "RayCluster"
POD = "Pod"
MAX_TOMBSTONES = 20000


def _rv(obj: Obj) -> int | None:
    return rv_int((obj.get("metadata") or {}).get("resourceVersion"))


def _uid(obj: Obj) -> str | None:
    return (obj.get("metadata") or {}).get("uid")


def bounded_put(table: dict[Any, Any], key: Any, value: Any) -> None:
    """Remember `key` in a table of at most MAX_TOMBSTONES entries: the oldest go first."""
    table[key] = value
    while len(table) > MAX_TOMBSTONES:
        table.pop(next(iter(table)))


def rv_int(raw: object) -> int | None:
    """A resource version as an etcd revision; None where the server gives something else
    (then ordering falls back to arrival)."""
    return int(raw) if isinstance(raw, str) and raw.isdigit() else None


def slim(obj: Obj) -> Obj:
    """The object without its managedFields, which nothing here reads and which are often
    the larger half of a pod's metadata (kept for every pod of hundreds of jobs)."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or "managedFields" not in meta:
        return obj
    return {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}


def newer_or_same(new: Obj, old: Obj | None) -> bool:
    """Whether `new` may replace `old` (an update never goes back in time)."""
    if old is None:
        return True
    a, b = _rv(new), _rv(old)
    return a is None or b is None or a >= b


class Store:
    """RLJobs by (namespace, name); their RayClusters and pods by (namespace, job label).
    Thread-safe: watch events arrive on the event loop, reconciles read from worker threads.
    Readers get the stored dicts themselves and must not change them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # the reconciler's, which compares its reads with relisted_at
        self._lock = threading.Lock()
        self._jobs: dict[Key, Obj] = {}
        self._clusters: dict[Key, dict[str, Obj]] = {}
        self._pods: dict[Key, dict[str, Obj]] = {}
        # (kind, namespace, name) → the version a deletion was seen at: a write's response
        # that arrives after the watch told of the deletion (a pod deleted at once, say)
        # must not bring the object back. Bounded: the oldest go first.
        self._tombstones: dict[tuple[str, str, str], int] = {}
        # UIDs of objects kept that a watch has told of (and not of their deletion): one
        # listed again is a relist.
        self._heard: set[str] = set()
        # (kind, namespace) whose watch has delivered an event past its listing: an object
        # listed there again is a relist, whether or not it was heard of before.
        self._streaming: set[tuple[str, str]] = set()
        self.relisted_at: float | None = None  # monotonic time the last relist was noticed
        # UIDs a delete removed without showing the object: until their deletion event, an
        # event of them that does not show them terminating is a late one, never a revival.
        self._vanished: dict[str, None] = {}

    def _buried(self, kind: str, obj: Obj) -> bool:
        meta = obj["metadata"]
        if meta.get("uid") in self._vanished and not meta.get("deletionTimestamp"):
            return True
        grave = self._tombstones.get((kind, meta.get("namespace") or "", meta["name"]))
        rv = _rv(obj)
        return grave is not None and rv is not None and grave >= rv

    def _bury(self, kind: str, obj: Obj) -> None:
        """Only the version is kept (the whole object of every deleted pod would be
        megabytes per hundred jobs)."""
        rv = _rv(obj)
        if rv is not None:
            meta = obj["metadata"]
            bounded_put(self._tombstones, (kind, meta.get("namespace") or "", meta["name"]),
                         rv)

    def _children(self, kind: str) -> dict[Key, dict[str, Obj]]:
        return self._clusters if kind == RAYCLUSTER else self._pods

    @staticmethod
    def job_of(obj: Obj) -> Key | None:
        """The (namespace, RLJob name) a child belongs to: by the job label, or, where that
        was removed by hand, by its controller (an RLJob, or a RayCluster, which is named
        after its job). Without the second, a child whose label someone removed would keep
        its last labelled copy here for good, and the operator would act on what is no
        longer there. Whether the object is really the job's is for `observe` to tell (by
        owner UID): a look-alike filed under a job is never taken for one of its children."""
        meta = obj.get("metadata") or {}
        job = (meta.get("labels") or {}).get(names.LABEL_JOB)
        if not job:
            ref = next((r for r in meta.get("ownerReferences") or []
                        if r.get("controller")), None) or {}
            group = str(ref.get("apiVersion", "")).partition("/")[0]
            if (ref.get("kind"), group) in ((RLJOB, GROUP), (RAYCLUSTER, names.RAY_GROUP)):
                job = ref.get("name")
        return (meta.get("namespace") or "", str(job)) if job else None

    def watched(self, kind: str, event_type: str | None, obj: Obj) -> None:
        """One watch event. kopf delivers listed objects with no event type: at start-up
        that is every object's first event; later it means the watch listed again (after
        410 Gone) and may have missed deletions, which `relisted_at` tells the reconciler.
        A relist is told by a listed object heard of before, or by any listed object once
        the kind's watch in that namespace has delivered events (the gap may have taken
        every object heard of: a job's pods all gone with a node, and KubeRay's new ones
        listed, none heard of before)."""
        uid = _uid(obj)
        stream = (kind, (obj.get("metadata") or {}).get("namespace") or "")
        if event_type is not None:
            self._streaming.add(stream)
        if event_type == "DELETED":
            self.remove(kind, obj)
            self._heard.discard(uid)
            return
        if event_type is None and (uid in self._heard or stream in self._streaming):
            self.relisted_at = self._clock()
        if self.put(kind, obj) and uid:
            self._heard.add(uid)

    def put(self, kind: str, obj: Obj) -> bool:
        """An object as a watch event or a write's response shows it. Returns whether the
        store keeps objects of it (not one buried, or a child of a job not held): only
        those are heard of, so that the UIDs of what is dropped are not remembered."""
        obj = slim(obj)
        meta = obj["metadata"]
        with self._lock:
            if self._buried(kind, obj):
                return False
            if kind == RLJOB:
                key = (meta.get("namespace") or "", meta["name"])
                if newer_or_same(obj, self._jobs.get(key)):
                    self._jobs[key] = obj
                return True
            job = self.job_of(obj)
            if job is None or job not in self._jobs:
                # Not of a job held (gone, or not seen yet): a deleted job's children would
                # stay for good if their deletion events were missed, and a new job's are
                # read with it on its first reconcile.
                return False
            per_job = self._children(kind).setdefault(job, {})
            if newer_or_same(obj, per_job.get(meta["name"])):
                per_job[meta["name"]] = obj
            return True

    def remove(self, kind: str, obj: Obj) -> None:
        """A deletion seen on a watch: forgets the object unless a newer one (made again since,
        under the same name) is already stored."""
        meta = obj["metadata"]
        with self._lock:
            self._vanished.pop(meta.get("uid"), None)
            self._bury(kind, obj)
            if kind == RLJOB:
                key = (meta.get("namespace") or "", meta["name"])
                if newer_or_same(obj, self._jobs.get(key)):
                    self._jobs.pop(key, None)
                return
            job = self.job_of(obj)
            if job is None:
                return
            children = self._children(kind)
            per_job = children.get(job, {})
            if newer_or_same(obj, per_job.get(meta["name"])):
                per_job.pop(meta["name"], None)
                if not per_job:
                    children.pop(job, None)

    def vanished(self, kind: str, namespace: str, name: str) -> None:
        """An object deleted by a call whose answer did not show it: what the store holds
        of it is buried at the version held (a later event, newer, may still tell more)."""
        with self._lock:
            children = self._children(kind)
            for key, per_job in children.items():
                held = per_job.get(name) if key[0] == namespace else None
                if held is not None:
                    self._bury(kind, held)
                    uid = _uid(held)
                    if uid:
                        bounded_put(self._vanished, uid, None)
                        self._heard.discard(uid)
                    del per_job[name]
                    if not per_job:
                        del children[key]
                    return

    def replace_children(self, kind: str, job: Key, objs: Iterable[Obj],
                         list_rv: str | None) -> None:
        """A fresh list of one job's children of `kind` (the safety resync), taken at
        resource version `list_rv`: what the store held and the list lacks is gone, unless
        the store's copy is newer than the list (made after it); a listed object whose
        deletion the watch told of meanwhile stays gone; a newer stored copy stays."""
        at = rv_int(list_rv)
        with self._lock:
            if job not in self._jobs:
                return
            held = self._children(kind).get(job, {})
            fresh: dict[str, Obj] = {}
            for obj in map(slim, objs):
                name = obj["metadata"]["name"]
                if self._buried(kind, obj):
                    continue
                mine = held.get(name)
                fresh[name] = mine if mine is not None and not newer_or_same(obj, mine) \
                    else obj
            for name, mine in held.items():
                rv = _rv(mine)
                if name not in fresh and at is not None and rv is not None and rv > at:
                    fresh[name] = mine
            for name in held.keys() - fresh.keys():
                self._heard.discard(_uid(held[name]))
                if at is not None:
                    # A late event of what the list no longer has must not bring it back.
                    bounded_put(self._tombstones, (kind, job[0], name), at)
            if fresh:
                self._children(kind)[job] = fresh
            else:
                self._children(kind).pop(job, None)

    def drop_job(self, job: Key) -> None:
        """The job is gone from the API server (found by a fresh read): it and its children
        leave the store (their deletions may have fallen in a watch gap)."""
        with self._lock:
            gone = [self._jobs.pop(job, None), *self._clusters.pop(job, {}).values(),
                    *self._pods.pop(job, {}).values()]
            self._heard -= {_uid(obj) for obj in gone if obj is not None}

    def rljob(self, namespace: str, name: str) -> Obj | None:
        with self._lock:
            return self._jobs.get((namespace, name))

    def raycluster(self, namespace: str, job: str) -> Obj | None:
        """The job's RayCluster (named after the job)."""
        with self._lock:
            return self._clusters.get((namespace, job), {}).get(names.raycluster_name(job))

    def pods(self, namespace: str, job: str) -> list[Obj]:
        with self._lock:
            return list(self._pods.get((namespace, job), {}).values())

    def sizes(self) -> tuple[int, int, int]:
        """Objects held: RLJobs, RayClusters, pods (for tests and the benchmark's log)."""
        with self._lock:
            return (len(self._jobs), sum(len(v) for v in self._clusters.values()),
                    sum(len(v) for v in self._pods.values()))


def pod_unready(pod: Obj) -> bool:
    """A bound, running pod whose Ready condition is not True: what the node lifecycle
    controller makes of the pods of a node that stopped reporting."""
    status = pod.get("status") or {}
    if not (pod.get("spec") or {}).get("nodeName") or status.get("phase") != "Running":
        return False
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    return ready is None or ready.get("status") != "True"


def node_ready(node: Obj) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    return ready is not None and ready.get("status") == "True"


class NodeCache:
    """The node list, shared by every job's reconcile and refreshed at most once per `ttl`
    (or `min_age` when asked to hurry). A node a job uses that the list lacks or shows not
    Ready is believed only from a list read from etcd (not the API server's watch cache)
    less than `min_age` old; else the list is read so first: a node that joined, turned
    Ready or recovered after a list up to `ttl` old is not a lost one, and pods on it must
    not be force-deleted. While such a node is in use, that costs one list per `min_age`
    for all jobs together. While one reconcile reads the list, the others take the list held
    when every node they use is Ready in it, rather than waiting for a list of thousands of
    nodes; one that uses a node the held list lacks or shows not Ready waits for the read."""

    def __init__(self, lister: Callable[[bool], list[Obj]], ttl: float, min_age: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lister = lister  # called with consistent=True for a read from etcd
        self.ttl = ttl
        self.min_age = min_age
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, Obj] = {}
        self._at: float | None = None
        self._consistent = False  # whether the list held was read from etcd
        self._listing = False  # whether a reconcile is reading the list now

    def _suspicious(self, name: str) -> bool:
        node = self._nodes.get(name)
        return node is None or not node_ready(node)

    def _list(self, consistent: bool) -> None:
        at = self._clock()
        self._listing = True
        try:
            nodes = self._lister(consistent)  # a failed list leaves the one held as it was
        finally:
            self._listing = False
        self._nodes = {n["metadata"]["name"]: n for n in nodes}
        self._at, self._consistent = at, consistent

    def get(self, used: Iterable[str], hurry: bool = False) -> list[Obj]:
        """The nodes named `used` that exist (a job needs only those of its pods)."""
        wanted = set(used)
        held = self._nodes  # replaced whole by a list, never changed in place
        if self._listing and held and all(
                name in held and node_ready(held[name]) for name in wanted):
            return [held[name] for name in wanted]
        with self._lock:
            age = None if self._at is None else self._clock() - self._at
            if age is None or age >= self.ttl or (hurry and age >= self.min_age):
                self._list(consistent=False)
                age = 0.0
            if any(self._suspicious(name) for name in wanted) and not (
                    self._consistent and age is not None and age < self.min_age):
                self._list(consistent=True)
            return [self._nodes[name] for name in wanted if name in self._nodes]
