"""The operator's calls to Kueue's API: read a job's Workload and what its admission names
(ResourceFlavors, priority classes), and write the Workload as `admission.WorkloadStep`
says. Only used with the Kueue integration on (`--kueue`)."""

from __future__ import annotations

import logging
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rljob_api.spec import RLJobSpec
from rljob_operator import kueue
from rljob_operator.admission import WorkloadStep
from rljob_operator.builders import JobRef
from rljob_operator.kube import TIMEOUT, _json
from rljob_operator.kueue import Priority, QueueState, WorkloadView, parse_workload

log = logging.getLogger("rljob_operator")
Obj = dict[str, Any]
MERGE = "application/merge-patch+json"


class Workloads:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.custom = client.CustomObjectsApi(api_client)
        self.scheduling = client.SchedulingV1Api(api_client)

    def _get(self, plural: str, name: str, namespace: str | None = None) -> Obj | None:
        try:
            if namespace is None:
                return _json(self.custom.get_cluster_custom_object(
                    kueue.GROUP, kueue.VERSION, plural, name, _preload_content=False,
                    _request_timeout=TIMEOUT))
            return _json(self.custom.get_namespaced_custom_object(
                kueue.GROUP, kueue.VERSION, namespace, plural, name, _preload_content=False,
                _request_timeout=TIMEOUT))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def priority(self, labels: dict[str, str], pod_priority_class: str | None
                 ) -> Priority | None:
        """Kueue's order: the WorkloadPriorityClass the job's label names, else the pods'
        PriorityClass. One that does not exist (yet) gives no priority."""
        wpc = labels.get(kueue.LABEL_PRIORITY_CLASS)
        if wpc:
            found = self._get(kueue.WORKLOAD_PRIORITY_CLASSES, wpc)
            return Priority("WorkloadPriorityClass", wpc, int(found.get("value") or 0)) \
                if found else None
        if pod_priority_class:
            try:
                pc = self.scheduling.read_priority_class(pod_priority_class,
                                                         _request_timeout=TIMEOUT)
            except ApiException as err:
                if err.status == 404:
                    return None
                raise
            return Priority("PriorityClass", pod_priority_class, int(pc.value or 0))
        return None

    def state(self, ref: JobRef, body: Obj, queue: str, spec: RLJobSpec) -> QueueState:
        """The job's Workload as stored, the one it would queue now, and (when admitted)
        what the assigned flavors add to each pod set."""
        labels = dict(body["metadata"].get("labels") or {})
        want = kueue.build_workload(ref, spec, queue, self.priority(
            labels, spec.scheduling.priority_class_name))
        stored = self._get(kueue.WORKLOADS, kueue.workload_name(ref.name, ref.uid),
                           ref.namespace)
        view = parse_workload(stored) if stored is not None else None
        placement = {}
        if view is not None and view.admitted:
            flavors = {name: self._get(kueue.RESOURCE_FLAVORS, name) or {}
                       for names_ in view.assignments.values() for name in names_}
            placement = kueue.flavored(view, flavors)
        return QueueState(queue, True, view, want, placement)

    def _patch(self, namespace: str, name: str, patch: Obj, status: bool = False) -> None:
        call = self.custom.patch_namespaced_custom_object_status if status \
            else self.custom.patch_namespaced_custom_object
        try:
            call(kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name, patch,
                 _content_type=MERGE, _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status in (404, 409):
                return  # gone, or changed since it was read: the next reconcile reads it again
            raise

    def apply(self, step: WorkloadStep, state: QueueState, ref: JobRef, now: str,
              generation: int | None, message: str = "", succeeded: bool = False) -> None:
        """Carry out one step on the job's Workload."""
        want, view = state.want, state.workload
        assert want is not None
        ns = ref.namespace
        if step == WorkloadStep.create:
            try:
                self.custom.create_namespaced_custom_object(
                    kueue.GROUP, kueue.VERSION, ns, kueue.WORKLOADS, want,
                    _request_timeout=TIMEOUT)
            except ApiException as err:
                if err.status != 409:
                    raise
            return
        assert view is not None
        if step == WorkloadStep.update:
            self._patch(ns, view.name, kueue.spec_patch(want))
        elif step == WorkloadStep.activate:
            self._patch(ns, view.name, {"spec": {"active": not view.active}})
        elif step == WorkloadStep.release:
            self._patch(ns, view.name, kueue.release_patch(view, now, generation), status=True)
        elif step == WorkloadStep.finish:
            self._patch(ns, view.name, kueue.finish_patch(view, succeeded, message, now,
                                                          generation), status=True)
        elif step in (WorkloadStep.unhold, WorkloadStep.drop):
            self.unhold(ns, view)
            if step == WorkloadStep.drop:
                self._delete(ns, view.name)

    def unhold(self, namespace: str, view: WorkloadView) -> None:
        """Kueue's finalizer off (the other finalizers kept)."""
        if not view.held:
            return
        patch = {"metadata": {"resourceVersion": view.resource_version,
                              "finalizers": [f for f in view.finalizers
                                             if f != kueue.FINALIZER]}}
        self._patch(namespace, view.name, patch)

    def _delete(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(
                kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name,
                _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status != 404:
                raise
