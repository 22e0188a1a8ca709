"""RLJob ↔ Kueue, pure: the Workload an RLJob is queued as, what a stored Workload says, and
the patches the operator sends Kueue.

The operator integrates the way Kueue's external frameworks do (AppWrapper's controller, the
jobframework reconciler): it owns one `kueue.x-k8s.io/v1beta2` Workload per queued RLJob,
creates nothing that takes quota before Kueue admits that Workload, applies the admitted
flavors to the pods, stops the job on eviction and hands the quota back once its pods are
gone. Gating the RayCluster through Kueue's own RayCluster integration would leave out the
driver pod and would admit the RayCluster as one workload of its own, while the driver,
which must start only once every compute pod runs, still took quota unqueued.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rljob_api import KIND
from rljob_api.layout import DRIVER, HEAD
from rljob_api.spec import RLJobSpec
from rljob_api.validate import QUEUE_LABEL
from rljob_operator import builders

Obj = dict[str, Any]

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API = f"{GROUP}/{VERSION}"
WORKLOADS = "workloads"
RESOURCE_FLAVORS = "resourceflavors"
WORKLOAD_PRIORITY_CLASSES = "workloadpriorityclasses"
LABEL_QUEUE = QUEUE_LABEL
LABEL_PRIORITY_CLASS = f"{GROUP}/priority-class"
LABEL_JOB_UID = f"{GROUP}/job-uid"
LABEL_PODSET = f"{GROUP}/podset"
FINALIZER = f"{GROUP}/resource-in-use"
# The operator's own: a digest of what the pod sets ask of quota, to tell that the spec
# changed what is queued; and a mark that it deactivated the Workload for spec.suspend (so
# that it reactivates only what it deactivated, never a Workload Kueue or a user did).
ANNOTATION_PODSETS = "rljob.io/podsets"
ANNOTATION_SUSPENDED = "rljob.io/deactivated-for-suspend"
# What KubeRay (v1.5, its default ENABLE_INIT_CONTAINER_INJECTION) adds to every worker pod:
# an init container that waits for the head, with these requests and limits.
KUBERAY_WAIT_GCS: Obj = {"name": "wait-gcs-ready",
                         "resources": {"requests": {"cpu": "200m", "memory": "256Mi"},
                                       "limits": {"cpu": "200m", "memory": "256Mi"}}}
# Status fields Kueue's admission owns (server-side apply, field manager "kueue-admission").
ADMISSION_MANAGER = "kueue-admission"
# Kueue's eviction reasons after which the workload is queued again at once (Requeued=True);
# after any other (a deactivation, a stopped queue) Kueue itself requeues it later, if ever.
REQUEUE_AT_ONCE = frozenset({"Preempted", "NodeFailures"})


def workload_prefix(job: str, uid: str) -> str:
    """The `generateName` of a job's Workloads: `rljob-<job>-<5 hex>-` (Kueue's shape for
    its own: kind, job name and a digest of kind, group, name and UID; the job's name cut
    to 45 characters, so that the API server, which cuts a prefix to 58, keeps the digest),
    to which the API server adds a suffix: each Workload the job gets (again after an edit
    or a deletion) has a name of its own. Kueue frees a deleted Workload's quota only when a
    read of its name finds nothing, so one made again at once under the same name would
    leave the old one's quota held in Kueue's cache."""
    digest = hashlib.sha1(f"{KIND}\nrljob.io\n{job}\n{uid}".encode()).hexdigest()[:5]
    return f"{KIND.lower()}-{job[:45]}-{digest}-"


def controlled_by(obj: Obj, job_uid: str) -> bool:
    """Whether the RLJob of `job_uid` is the Workload's controller: the one tie between a
    job and its Workloads the operator trusts (Kueue's job-uid label only narrows a list)."""
    return any(r.get("uid") == job_uid and r.get("controller")
               for r in (obj.get("metadata") or {}).get("ownerReferences") or [])


@dataclass(frozen=True)
class Priority:
    """What the workload's priority comes from (Kueue's order: the WorkloadPriorityClass of
    the job's `kueue.x-k8s.io/priority-class` label, else the pods' PriorityClass)."""

    kind: str  # WorkloadPriorityClass | PriorityClass
    name: str
    value: int

    def ref(self) -> Obj:
        group = GROUP if self.kind == "WorkloadPriorityClass" else "scheduling.k8s.io"
        return {"group": group, "kind": self.kind, "name": self.name}


def _slim_template(template: Obj, injected: list[Obj] | None = None) -> Obj:
    """A pod template as Kueue counts it: what requests quota and what picks a flavor
    (containers' resources, init containers, including those KubeRay adds (`injected`),
    node selector, tolerations, affinity, priority class); the rest of the pod (volumes,
    commands, environment) is left out, which would make every Workload several times
    larger."""
    spec = dict(template["spec"])
    if injected:
        spec["initContainers"] = [*spec.get("initContainers", []),
                                  *({**c, "image": spec["containers"][0].get("image", "")}
                                    for c in injected)]

    def container(c: Obj) -> Obj:
        out: Obj = {"name": c["name"], "image": c.get("image", "")}
        for key in ("resources", "restartPolicy"):
            if key in c:
                out[key] = c[key]
        return out

    slim: Obj = {"containers": [container(c) for c in spec["containers"]]}
    if spec.get("initContainers"):
        slim["initContainers"] = [container(c) for c in spec["initContainers"]]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName",
                "restartPolicy"):
        if key in spec:
            slim[key] = spec[key]
    labels = dict((template.get("metadata") or {}).get("labels") or {})
    return {"metadata": {"labels": labels}, "spec": slim}


def pod_sets(job: builders.JobRef, spec: RLJobSpec) -> list[Obj]:
    """Every pod the job runs, as Kueue pod sets: the Ray head, one set per worker group
    (trainer and rollout, or colocated) and the driver, each with the requests its pods
    really make (GPUs, the sidecars' memory, the status writer), built by the same
    builders that make the pods."""
    rc = builders.build_raycluster(job, spec)
    sets = [{"name": HEAD, "count": 1,
             "template": _slim_template(rc["spec"]["headGroupSpec"]["template"])}]
    for group in rc["spec"]["workerGroupSpecs"]:
        sets.append({"name": group["groupName"], "count": int(group["replicas"]),
                     "template": _slim_template(group["template"], [KUBERAY_WAIT_GCS])})
    driver = builders.build_driver(job, spec, 0, [])
    sets.append({"name": DRIVER, "count": 1, "template": _slim_template(
        {"metadata": driver["metadata"], "spec": driver["spec"]})})
    return sets


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def quota_digest(sets: list[Obj]) -> str:
    """A digest of what the pod sets ask of Kueue (counts, requests, what picks a flavor),
    not of images or labels: an edit that changes neither keeps the admission."""
    def shape(spec: Obj) -> Obj:
        return {**{k: v for k, v in spec.items() if k not in ("containers", "initContainers")},
                **{k: [{"name": c["name"], "resources": c.get("resources"),
                        "restartPolicy": c.get("restartPolicy")} for c in spec.get(k, [])]
                   for k in ("containers", "initContainers")}}

    return _digest([{"name": s["name"], "count": s["count"],
                     "spec": shape(s["template"]["spec"])} for s in sets])


def build_workload(job: builders.JobRef, spec: RLJobSpec, queue: str,
                   priority: Priority | None) -> Obj:
    """The Workload an RLJob is queued as. Owned by the job (garbage-collected with it) and
    held by Kueue's finalizer, which the operator removes once the job's pods are gone."""
    sets = pod_sets(job, spec)
    suspended = spec.scheduling.suspend
    # Made inactive when the job is created suspended: an active one could be admitted, and
    # preempt others, before the next reconcile deactivated it.
    body: Obj = {"queueName": queue, "podSets": sets, "active": not suspended}
    if priority is not None:
        body["priorityClassRef"] = priority.ref()
        body["priority"] = priority.value
    annotations = {ANNOTATION_PODSETS: quota_digest(sets)}
    if suspended:
        annotations[ANNOTATION_SUSPENDED] = "true"
    return {
        "apiVersion": API,
        "kind": "Workload",
        "metadata": {
            "generateName": workload_prefix(job.name, job.uid),
            "namespace": job.namespace,
            "labels": {LABEL_JOB_UID: job.uid},
            "annotations": annotations,
            "finalizers": [FINALIZER],
            "ownerReferences": [builders.owner_reference(job)],
        },
        "spec": body,
    }


@dataclass(frozen=True)
class Said:
    """One of Kueue's conditions on the workload: its reason and message."""

    reason: str
    message: str

    def words(self) -> str:
        return f"{self.reason}: {self.message}" if self.message else self.reason


@dataclass(frozen=True)
class Flavored:
    """What admission adds to one pod set's pods: the assigned flavors' node labels and
    tolerations."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Obj, ...] = ()


@dataclass(frozen=True)
class WorkloadView:
    """A stored Workload as far as the operator acts on it."""

    name: str
    resource_version: str
    deleting: bool
    held: bool  # carries Kueue's resource-in-use finalizer
    podsets_digest: str | None
    queue: str
    priority: int | None
    priority_class: Obj | None  # spec.priorityClassRef
    active: bool
    deactivated_by_us: bool  # for spec.suspend (ANNOTATION_SUSPENDED)
    pods_ready: bool  # PodsReady=True
    reserved: bool  # QuotaReserved=True: it holds quota
    admitted: bool  # Admitted=True
    finished: bool
    evicted: Said | None
    preempted: Said | None
    pending: Said | None  # QuotaReserved=False: why it waits
    cluster_queue: str | None
    assignments: Mapping[str, tuple[str, ...]]  # pod set → flavor names, as admitted
    conditions: tuple[Obj, ...] = ()
    finalizers: tuple[str, ...] = ()
    uid: str = ""


def _conditions(status: Obj) -> dict[str, Obj]:
    return {str(c.get("type")): c for c in status.get("conditions") or []}


def _said(cond: Obj | None, want: str = "True") -> Said | None:
    if cond is None or cond.get("status") != want:
        return None
    return Said(str(cond.get("reason") or ""), str(cond.get("message") or ""))


def parse_workload(obj: Obj) -> WorkloadView:
    meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
    conds = _conditions(status)
    admission = status.get("admission") or {}
    assignments = {
        str(a.get("name")): tuple(sorted(set((a.get("flavors") or {}).values())))
        for a in admission.get("podSetAssignments") or []}
    return WorkloadView(
        name=meta["name"],
        resource_version=str(meta.get("resourceVersion") or ""),
        deleting=bool(meta.get("deletionTimestamp")),
        held=FINALIZER in (meta.get("finalizers") or []),
        podsets_digest=(meta.get("annotations") or {}).get(ANNOTATION_PODSETS),
        queue=str(spec.get("queueName") or ""),
        priority=spec.get("priority"),
        priority_class=spec.get("priorityClassRef"),
        active=spec.get("active", True) is not False,
        deactivated_by_us=(meta.get("annotations") or {}).get(ANNOTATION_SUSPENDED) == "true",
        pods_ready=_said(conds.get("PodsReady")) is not None,
        reserved=_said(conds.get("QuotaReserved")) is not None,
        admitted=_said(conds.get("Admitted")) is not None,
        finished=_said(conds.get("Finished")) is not None,
        evicted=_said(conds.get("Evicted")),
        preempted=_said(conds.get("Preempted")),
        pending=_said(conds.get("QuotaReserved"), "False"),
        cluster_queue=admission.get("clusterQueue"),
        assignments=assignments,
        conditions=tuple(status.get("conditions") or ()),
        finalizers=tuple(meta.get("finalizers") or ()),
        uid=str(meta.get("uid") or ""),
    )


def flavored(view: WorkloadView, flavors: Mapping[str, Obj]) -> dict[str, Flavored]:
    """Pod set → what its assigned flavors add (`flavors`: ResourceFlavor name → object):
    their nodeLabels into the node selector and their tolerations, as Kueue's own
    integrations apply them."""
    out = {}
    for podset, names_ in view.assignments.items():
        selector: dict[str, str] = {}
        tolerations: list[Obj] = []
        for name in names_:
            spec = (flavors.get(name) or {}).get("spec") or {}
            selector.update(spec.get("nodeLabels") or {})
            tolerations.extend(t for t in spec.get("tolerations") or [] if t not in tolerations)
        out[podset] = Flavored(selector, tuple(tolerations))
    return out


def apply_flavors(pod_spec: Obj, flavor: Flavored | None, labels: Obj | None = None,
                  podset: str | None = None) -> None:
    """Adds a pod set's flavors to a pod spec (and its pod set's label to `labels`)."""
    if flavor is not None:
        if flavor.node_selector:
            pod_spec["nodeSelector"] = {**pod_spec.get("nodeSelector", {}),
                                        **flavor.node_selector}
        if flavor.tolerations:
            have = list(pod_spec.get("tolerations") or [])
            pod_spec["tolerations"] = have + [t for t in flavor.tolerations if t not in have]
    if labels is not None and podset is not None:
        labels[LABEL_PODSET] = podset


def place_raycluster(rc: Obj, placement: Mapping[str, Flavored]) -> Obj:
    """The RayCluster with each group's admitted flavors applied to its pods."""
    head = rc["spec"]["headGroupSpec"]["template"]
    apply_flavors(head["spec"], placement.get(HEAD), head["metadata"].setdefault("labels", {}),
                  HEAD)
    for group in rc["spec"]["workerGroupSpecs"]:
        t = group["template"]
        apply_flavors(t["spec"], placement.get(group["groupName"]),
                      t["metadata"].setdefault("labels", {}), group["groupName"])
    return rc


def place_driver(pod: Obj, placement: Mapping[str, Flavored]) -> Obj:
    apply_flavors(pod["spec"], placement.get(DRIVER), pod["metadata"].setdefault("labels", {}),
                  DRIVER)
    return pod


def _condition(type_: str, status: str, reason: str, message: str, now: str,
               generation: int | None) -> Obj:
    cond: Obj = {"type": type_, "status": status, "reason": reason,
                 "message": message[:32768], "lastTransitionTime": now}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _with(conditions: tuple[Obj, ...], *new: Obj) -> list[Obj]:
    """Conditions with `new` set; a condition whose status is unchanged keeps its time."""
    out = {str(c.get("type")): dict(c) for c in conditions}
    for cond in new:
        old = out.get(cond["type"])
        if old is not None and old.get("status") == cond["status"]:
            cond = {**cond, "lastTransitionTime": old.get("lastTransitionTime",
                                                          cond["lastTransitionTime"])}
        out[cond["type"]] = cond
    return list(out.values())


def release_patch(view: WorkloadView, now: str, generation: int | None) -> Obj:
    """The status patch that gives an evicted workload's quota back once the job's pods are
    gone (what Kueue's job reconciler does for its own integrations): no admission,
    QuotaReserved=False (Pending), Admitted=False (NoReservation), and Requeued, True when
    Kueue queues it again at once (a preemption), else False until Kueue itself does."""
    evicted = view.evicted or Said("Evicted", "")
    requeued = "True" if evicted.reason in REQUEUE_AT_ONCE else "False"
    conds = _with(
        view.conditions,
        _condition("Requeued", requeued, evicted.reason or "Evicted", evicted.message, now,
                   generation),
        # Ready no more: admitted again, the job starts anew (waitForPodsReady times it).
        _condition("PodsReady", "False", "WaitForStart", "the job is queued again", now,
                   generation),
        _condition("QuotaReserved", "False", "Pending", evicted.message, now, generation),
        _condition("Admitted", "False", "NoReservation", "The workload has no reservation",
                   now, generation),
    )
    return {"metadata": {"resourceVersion": view.resource_version},
            "status": {"admission": None, "conditions": conds}}


def finish_patch(view: WorkloadView, succeeded: bool, message: str, now: str,
                 generation: int | None) -> Obj:
    """Finished=True: Kueue frees the quota of a job that ended."""
    cond = _condition("Finished", "True", "Succeeded" if succeeded else "Failed",
                      message or ("the job succeeded" if succeeded else "the job failed"),
                      now, generation)
    return {"metadata": {"resourceVersion": view.resource_version},
            "status": {"conditions": _with(view.conditions, cond)}}


def spec_patch(view: WorkloadView, desired: Obj) -> Obj:
    """What the operator keeps in step on a workload that holds no quota: its pod sets (and
    their digest), queue and priority; refused (a conflict) if the workload changed since
    it was read, say Kueue reserved quota for it meanwhile."""
    spec = desired["spec"]
    return {"metadata": {"resourceVersion": view.resource_version, "annotations": {
                ANNOTATION_PODSETS: desired["metadata"]["annotations"][ANNOTATION_PODSETS]}},
            "spec": {"queueName": spec["queueName"], "podSets": spec["podSets"],
                     "priorityClassRef": spec.get("priorityClassRef"),
                     "priority": spec.get("priority")}}


def priority_patch(view: WorkloadView, desired: Obj) -> Obj:
    """A new priority, in place: allowed while quota is reserved, as Kueue's own
    integrations update it (its class's value changed, or the job's label)."""
    spec = desired["spec"]
    return {"metadata": {"resourceVersion": view.resource_version},
            "spec": {"priorityClassRef": spec.get("priorityClassRef"),
                     "priority": spec.get("priority")}}


def active_patch(view: WorkloadView, active: bool) -> Obj:
    """spec.active for spec.suspend, marked as the operator's doing."""
    return {"metadata": {"resourceVersion": view.resource_version, "annotations": {
                ANNOTATION_SUSPENDED: None if active else "true"}},
            "spec": {"active": active}}


def pods_ready_patch(view: WorkloadView, now: str, generation: int | None) -> Obj:
    """PodsReady=True once the job runs: what Kueue's waitForPodsReady waits for."""
    cond = _condition("PodsReady", "True", "Started",
                      "the driver and every compute pod of the job run", now, generation)
    return {"metadata": {"resourceVersion": view.resource_version},
            "status": {"conditions": _with(view.conditions, cond)}}


def shape_changed(view: WorkloadView, desired: Obj) -> bool:
    """Whether the stored workload asks Kueue for something else than the job would now:
    other pods or requests, or another queue."""
    return bool(view.podsets_digest != desired["metadata"]["annotations"][ANNOTATION_PODSETS]
                or view.queue != desired["spec"]["queueName"])


def priority_changed(view: WorkloadView, desired: Obj) -> bool:
    """Whether the job's priority changed in a way Kueue takes now: any change of a workload
    that holds no quota; while it holds quota only what its CRD rules allow (a new value, or
    another WorkloadPriorityClass); a class added, removed or of another kind waits until
    the workload holds no quota."""
    spec = desired["spec"]
    old, new = view.priority_class, spec.get("priorityClassRef")
    if (view.priority, old) == (spec.get("priority"), new):
        return False
    if not view.reserved:
        return True
    if old is None or new is None or (old.get("group"), old.get("kind")) != (
            new.get("group"), new.get("kind")):
        return False
    return old.get("kind") == "WorkloadPriorityClass" or old.get("name") == new.get("name")


@dataclass(frozen=True)
class QueueState:
    """What a reconcile knows of a queued job's place in Kueue."""

    name: str | None  # the LocalQueue; None: the job names none, but has a Workload left
    enabled: bool  # this operator manages Kueue workloads (`--kueue`)
    workload: WorkloadView | None = None
    want: Obj | None = None  # the Workload the job would queue now
    placement: Mapping[str, Flavored] = field(default_factory=dict)  # when admitted
    # What keeps the job from being queued or started: a priority class or an admitted
    # flavor that does not exist (reason, message).
    problem: tuple[str, str] | None = None
