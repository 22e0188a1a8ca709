"""The operator's calls to Kueue's API: read a job's Workload and what its admission names
(ResourceFlavors, priority classes), and write the Workload as `admission.WorkloadStep`
says. Only used with the Kueue integration on (`--kueue`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rljob_api.spec import RLJobSpec
from rljob_api.validate import queue_name_problems
from rljob_operator import kueue
from rljob_operator.admission import WorkloadStep
from rljob_operator.builders import JobRef
from rljob_operator.cache import bounded_put, rv_int
from rljob_operator.kube import TIMEOUT, _json
from rljob_operator.kueue import Priority, QueueState, WorkloadView, parse_workload

log = logging.getLogger("rljob_operator")
Obj = dict[str, Any]
MERGE = "application/merge-patch+json"
# Priority classes and flavors change rarely; each is read at most this often (seconds).
CLASS_TTL = 30.0
# A Workload's copy from the watch is read again after this long (seconds): a deletion that
# fell in a watch gap would otherwise leave a Workload the job believes in for good.
WORKLOAD_TTL = 300.0
Key = tuple[str, str]  # (namespace, RLJob name)
STALE = float("-inf")  # the time of a copy to read again before use


class Workloads:
    def __init__(self, api_client: client.ApiClient,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.custom = client.CustomObjectsApi(api_client)
        self.scheduling = client.SchedulingV1Api(api_client)
        self.monotonic = monotonic
        self._classes: dict[tuple[str, str], tuple[float, Obj | None]] = {}
        # A copy of each job's current Workload, by the RLJob that controls it, with when it
        # came (STALE: read it again before use). A job that names no queue (any more) but
        # still has a Workload is known by its entry here.
        self._seen: dict[Key, tuple[float, Obj]] = {}
        # UIDs of Workloads deleted: a late event of one never brings it back.
        self._gone: dict[str, None] = {}
        self._lock = threading.Lock()

    # -- the watch's view ------------------------------------------------------------------

    def watched(self, key: Key, obj: Obj, deleted: bool) -> None:
        """An event of one of the job's Workloads (in the order the watch delivers them)."""
        meta = obj["metadata"]
        uid = str(meta.get("uid") or "")
        with self._lock:
            if deleted:
                bounded_put(self._gone, uid, None)
            elif uid in self._gone:
                return  # a late event of a Workload deleted since
            held = self._seen.get(key)
            if held is None or held[1]["metadata"].get("uid") == uid:
                if deleted:
                    self._seen.pop(key, None)
                elif held is None or held[0] == STALE or not _older(obj, held[1]):
                    self._seen[key] = (self.monotonic(), obj)
            elif deleted or meta.get("deletionTimestamp"):
                pass  # an earlier Workload, going: the one held stays
            elif held[1]["metadata"].get("deletionTimestamp"):
                self._seen[key] = (self.monotonic(), obj)  # made since the one that goes
            else:
                # Two live Workloads: the next read lists them and keeps one (`_read`).
                self._seen[key] = (STALE, held[1])

    def forget(self, key: Key) -> None:
        """The job is gone: nothing of its Workloads is kept."""
        with self._lock:
            self._seen.pop(key, None)

    def _stale(self, namespace: str, name: str) -> None:
        """The copy held of this Workload is read again before it is used."""
        with self._lock:
            for key, (_, obj) in list(self._seen.items()):
                if key[0] == namespace and obj["metadata"]["name"] == name:
                    self._seen[key] = (STALE, obj)

    # -- reads -----------------------------------------------------------------------------

    def _of_job(self, ref: JobRef) -> list[Obj]:
        """The job's Workloads as stored: those it controls (listed by Kueue's job-uid
        label), the live ones first, the one holding quota before the others and then the
        oldest, then those being deleted, newest first."""
        found = _json(self.custom.list_namespaced_custom_object(
            kueue.GROUP, kueue.VERSION, ref.namespace, kueue.WORKLOADS,
            label_selector=f"{kueue.LABEL_JOB_UID}={ref.uid}", _preload_content=False,
            _request_timeout=TIMEOUT))["items"]
        ours = [w for w in found if kueue.controlled_by(w, ref.uid)]

        def made(w: Obj) -> tuple[str, str]:
            return str(w["metadata"].get("creationTimestamp") or ""), w["metadata"]["name"]

        live = sorted((w for w in ours if not w["metadata"].get("deletionTimestamp")),
                      key=lambda w: (not parse_workload(w).reserved, made(w)))
        going = sorted((w for w in ours if w["metadata"].get("deletionTimestamp")), key=made,
                       reverse=True)
        return live + going

    def _read(self, ref: JobRef) -> Obj | None:
        """The job's Workload as the API server has it. Should it have two live ones (two
        operators for a moment, or a create whose answer was lost and made again), the one
        holding quota, else the oldest, stays and the others go (each only as it was
        listed: one that changed since is left for the next read)."""
        found = self._of_job(ref)
        live = [w for w in found if not w["metadata"].get("deletionTimestamp")]
        for extra in live[1:]:
            view = parse_workload(extra)
            log.warning("%s/%s: Workload %s is a second one of the job's: it goes, %s stays",
                        ref.namespace, ref.name, view.name, live[0]["metadata"]["name"])
            try:
                version = self.unhold(ref.namespace, view)
                if version is not None:
                    self._delete(ref.namespace, view, version)
            except ApiException as err:
                log.warning("%s/%s: Workload %s not deleted: %s", ref.namespace, ref.name,
                            view.name, err.reason)
        return found[0] if found else None

    def _cluster_object(self, plural: str, name: str) -> Obj | None:
        try:
            return _json(self.custom.get_cluster_custom_object(
                kueue.GROUP, kueue.VERSION, plural, name, _preload_content=False,
                _request_timeout=TIMEOUT))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def _class(self, kind: str, name: str) -> Obj | None:
        """A WorkloadPriorityClass, PriorityClass or ResourceFlavor (None: there is none),
        read at most every CLASS_TTL seconds."""
        now = self.monotonic()
        with self._lock:
            held = self._classes.get((kind, name))
        if held is not None and now - held[0] < CLASS_TTL:
            return held[1]
        if kind == "PriorityClass":
            try:
                pc = self.scheduling.read_priority_class(name, _request_timeout=TIMEOUT)
                found: Obj | None = {"value": int(pc.value or 0)}
            except ApiException as err:
                if err.status != 404:
                    raise
                found = None
        else:
            plural = kueue.WORKLOAD_PRIORITY_CLASSES if kind == "WorkloadPriorityClass" \
                else kueue.RESOURCE_FLAVORS
            found = self._cluster_object(plural, name)
        with self._lock:
            self._classes[(kind, name)] = (now, found)
        return found

    def priority(self, labels: dict[str, str], pod_priority_class: str | None
                 ) -> tuple[Priority | None, str | None]:
        """The priority Kueue's own integrations give a job: the WorkloadPriorityClass its
        `kueue.x-k8s.io/priority-class` label names, else the pods' PriorityClass; and,
        for a class that does not exist, what is missing."""
        wpc = labels.get(kueue.LABEL_PRIORITY_CLASS)
        kind, name = ("WorkloadPriorityClass", wpc) if wpc else \
            ("PriorityClass", pod_priority_class)
        if not name:
            return None, None
        found = self._class(kind, name)
        if found is None:
            return None, f"{kind} {name} does not exist"
        return Priority(kind, name, int(found.get("value") or 0)), None

    def state(self, ref: JobRef, body: Obj, queue: str | None,
              spec: RLJobSpec | None) -> QueueState | None:
        """The job's Workload as stored, the one it would queue now, and (when admitted)
        what the assigned flavors add to each pod set. None: the job names no queue and
        has no Workload."""
        key = (ref.namespace, ref.name)
        with self._lock:
            held = self._seen.get(key)
        if queue is None and held is None:
            return None
        cached = held[1] if held is not None else None
        if held is None or held[0] == STALE or self.monotonic() - held[0] > WORKLOAD_TTL \
                or not kueue.controlled_by(held[1], ref.uid):
            cached = None  # stale, old, or a Workload of an earlier job of this name
        # The watch's copy when it has a good one; else (a job seen before the watch's first
        # listing arrived, or whose Workload is not made yet) the API server's.
        stored = cached
        if stored is None:
            started = self.monotonic()
            stored = self._read(ref)
            with self._lock:
                now = self._seen.get(key)
                if now is not None and now[0] != STALE and now[0] >= started:
                    stored = now[1]  # the watch delivered it while the read ran: as new
                elif stored is None or str(stored["metadata"].get("uid")) in self._gone:
                    stored = None
                    self._seen.pop(key, None)
                else:
                    self._seen[key] = (self.monotonic(), stored)
        view = parse_workload(stored) if stored is not None else None
        if queue is None and view is None:
            return None
        want, problem = None, None
        bad_name = queue_name_problems(body.get("metadata"), body.get("spec"))
        if queue is not None and bad_name:
            problem = ("InvalidQueueName", f"{bad_name[0]}: no Workload is made for it")
        elif queue is not None and spec is not None:
            labels = dict(body["metadata"].get("labels") or {})
            priority, missing = self.priority(labels, spec.scheduling.priority_class_name)
            if missing is not None and view is not None:
                # Kept as it is: a class deleted or renamed never stops a queued job.
                priority = Priority(str((view.priority_class or {}).get("kind") or ""),
                                    str((view.priority_class or {}).get("name") or ""),
                                    int(view.priority or 0)) if view.priority_class else None
            elif missing is not None:
                problem = ("PriorityClassNotFound", f"{missing}: the job's Workload is made "
                           "once it does (Kueue needs its value)")
            want = kueue.build_workload(ref, spec, queue, priority)
        placement = {}
        if view is not None and view.admitted:
            flavors = {name: self._class("ResourceFlavor", name)
                       for names_ in view.assignments.values() for name in names_}
            gone = sorted(n for n, f in flavors.items() if f is None)
            if gone:
                problem = ("FlavorNotFound", f"ResourceFlavor {', '.join(gone)} that Kueue "
                           "assigned does not exist: the pods are not made without it")
            placement = kueue.flavored(view, {n: f or {} for n, f in flavors.items()})
        return QueueState(queue, True, view, want, placement, problem)

    # -- writes ----------------------------------------------------------------------------

    def _patch(self, namespace: str, name: str, patch: Obj, status: bool = False
               ) -> Obj | None:
        """The Workload as patched; None: not patched (gone, or changed since it was read:
        the next reconcile reads it again)."""
        call = self.custom.patch_namespaced_custom_object_status if status \
            else self.custom.patch_namespaced_custom_object
        try:
            return _json(call(kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name,
                              patch, _content_type=MERGE, _preload_content=False,
                              _request_timeout=TIMEOUT))
        except ApiException as err:
            if err.status in (404, 409):
                self._stale(namespace, name)
                return None
            raise

    def apply(self, step: WorkloadStep, state: QueueState, ref: JobRef, now: str,
              generation: int | None, message: str = "", succeeded: bool = False) -> None:
        """Carry out one step on the job's Workload."""
        want, view = state.want, state.workload
        ns = ref.namespace
        if step == WorkloadStep.create:
            assert want is not None
            try:
                made = _json(self.custom.create_namespaced_custom_object(
                    kueue.GROUP, kueue.VERSION, ns, kueue.WORKLOADS, want,
                    _preload_content=False, _request_timeout=TIMEOUT))
                self.watched((ns, ref.name), made, deleted=False)
            except ApiException as err:
                if err.status != 409:  # a generated name taken: made again next time
                    raise
            return
        assert view is not None
        if step == WorkloadStep.update:
            assert want is not None
            self._patch(ns, view.name, kueue.spec_patch(view, want))
        elif step == WorkloadStep.reprioritize:
            assert want is not None
            self._patch(ns, view.name, kueue.priority_patch(view, want))
        elif step in (WorkloadStep.activate, WorkloadStep.deactivate):
            self._patch(ns, view.name, kueue.active_patch(view, step == WorkloadStep.activate))
        elif step == WorkloadStep.release:
            self._patch(ns, view.name, kueue.release_patch(view, now, generation), status=True)
        elif step == WorkloadStep.pods_ready:
            self._patch(ns, view.name, kueue.pods_ready_patch(view, now, generation),
                        status=True)
        elif step == WorkloadStep.finish:
            self._patch(ns, view.name, kueue.finish_patch(view, succeeded, message, now,
                                                          generation), status=True)
        elif step == WorkloadStep.unhold:
            self.unhold(ns, view)
        elif step == WorkloadStep.drop and self.unhold(ns, view) is not None:
            self._delete(ns, view)

    def unhold(self, namespace: str, view: WorkloadView) -> str | None:
        """Kueue's finalizer off (the other finalizers kept); the Workload's resource version
        once it is off, None where it was not taken off."""
        if not view.held:
            return view.resource_version
        patch = {"metadata": {"resourceVersion": view.resource_version,
                              "finalizers": [f for f in view.finalizers
                                             if f != kueue.FINALIZER]}}
        done = self._patch(namespace, view.name, patch)
        return str(done["metadata"].get("resourceVersion") or "") if done is not None else None

    def let_go(self, ref: JobRef) -> None:
        """The job is being deleted: its Workloads' finalizer goes, so that garbage
        collection (foreground too, which waits for them) can take them."""
        for stored in self._of_job(ref):
            self.unhold(ref.namespace, parse_workload(stored))

    def _delete(self, namespace: str, view: WorkloadView, version: str | None = None) -> None:
        """Delete the Workload (only as it was at `version`, when given)."""
        options = client.V1DeleteOptions(preconditions=client.V1Preconditions(
            resource_version=version)) if version else None
        try:
            self.custom.delete_namespaced_custom_object(
                kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, view.name,
                body=options, _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status == 409:
                self._stale(namespace, view.name)
                return  # changed since it was read: judged again on the next read
            if err.status != 404:
                raise
        with self._lock:
            bounded_put(self._gone, view.uid, None)
            for key, (_, obj) in list(self._seen.items()):
                if key[0] == namespace and obj["metadata"].get("uid") == view.uid:
                    self._seen.pop(key, None)


def _older(a: Obj, b: Obj) -> bool:
    """Whether copy `a` of a Workload is older than copy `b` (by resource version)."""
    ra, rb = rv_int(a["metadata"].get("resourceVersion")), rv_int(
        b["metadata"].get("resourceVersion"))
    return ra is not None and rb is not None and ra < rb
