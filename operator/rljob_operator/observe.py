"""Pure observation: raw API objects of one job's children into a compact view.

The decision logic (`situation`, `failures`, `status`, `phases`) only sees these views, so
it can be tested with plain values and cannot accidentally depend on a field the API server
did not send.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from rljob_api.layout import DRIVER, HEAD
from rljob_api.spec import FailureKind
from rljob_api.status import parse_timestamp, timestamp
from rljob_operator import names
from rljob_operator.kueue import QueueState

Obj = dict[str, Any]
ClusterState = Literal["absent", "present", "deleting"]  # the job's RayCluster


@dataclass(frozen=True)
class FailureHint:
    """A pod failure seen on the watch stream before the pod vanished (KubeRay deletes failed
    pods at once); only used to name the cause better than "deleted"."""

    kind: str
    message: str
    # The first container's exit code and start time when it ended: the driver's exit code
    # tells a doomed job (invalid, non-finite) from one a restart can help.
    exit_code: int | None = None
    started_at: str | None = None
    seen_at: str | None = None  # when the operator saw it (set by the watch handler)


# Container waiting reasons that block a start and do not clear by waiting: an image that
# cannot be pulled, a container that keeps crashing or cannot be created. Both image pull
# reasons read as one (the kubelet alternates between them), so the condition holds still.
STUCK_REASONS: Mapping[str, str] = {
    "ErrImagePull": "ImagePullBackOff",
    "ImagePullBackOff": "ImagePullBackOff",
    "InvalidImageName": "InvalidImageName",
    "ErrImageNeverPull": "ImagePullBackOff",
    "CrashLoopBackOff": "CrashLoopBackOff",
    "CreateContainerConfigError": "CreateContainerConfigError",
    "CreateContainerError": "CreateContainerError",
    "RunContainerError": "RunContainerError",
}


@dataclass(frozen=True)
class Stuck:
    """A container of a pod that cannot start, in the kubelet's words."""

    reason: str  # one of STUCK_REASONS' values
    container: str
    message: str


@dataclass(frozen=True)
class PodView:
    name: str
    component: str
    phase: str
    node: str | None
    deleting: bool
    ready: bool
    failure: FailureHint | None
    unschedulable: str | None
    annotations: Mapping[str, str] = field(default_factory=dict)
    stuck: Stuck | None = None
    waiting: str | None = None  # first waiting reason of a container, e.g. ContainerCreating
    uid: str | None = None

    @property
    def restarts(self) -> int | None:
        """Which attempt a driver pod belongs to (its `rljob.io/restarts` annotation)."""
        raw = self.annotations.get(names.ANNOTATION_RESTARTS)
        return int(raw) if raw is not None and raw.isdigit() else None

    @property
    def revision(self) -> str | None:
        """What the pod was built from (`rljob.io/revision`, copied from its template)."""
        return self.annotations.get(names.ANNOTATION_REVISION)

    @property
    def recorded_compute(self) -> frozenset[str]:
        """The compute pods a driver pod started with."""
        raw = self.annotations.get(names.ANNOTATION_COMPUTE_PODS, "")
        return frozenset(p for p in raw.split(",") if p)


@dataclass(frozen=True)
class NodeOutage:
    """A node the job's pods are bound to that is not Ready: gone from the node list, or
    its Ready condition False or Unknown."""

    status: str  # the Ready condition's status ("False", "Unknown"), or "gone"
    since: datetime | None  # the Ready condition's lastTransitionTime; None when gone
    # When the node counts as lost (its pods force-deleted, the attempt failed as NodeLost);
    # None: at once (a node that is gone, or whose condition carries no time).
    lost_at: datetime | None

    def describe(self, node: str) -> str:
        """The outage in words, for conditions and events."""
        if self.since is None:
            return f"node {node} was removed" if self.status == "gone" else \
                f"node {node} is not Ready ({self.status})"
        return f"node {node} is not Ready ({self.status}) since {timestamp(self.since)}"


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile knows about a job's children."""

    cluster: ClusterState
    driver: PodView | None
    compute: tuple[PodView, ...]
    # Nodes counted lost: their pods will never be finished by a kubelet (see `node_outages`).
    lost_nodes: frozenset[str]
    hints: Mapping[str, FailureHint] = field(default_factory=dict)
    in_the_way: InTheWay | None = None  # a child's name taken by an object not the job's
    cluster_revision: str | None = None  # the RayCluster's `rljob.io/revision`
    # Access modes of the user's checkpoint claim (`spec.checkpoint.pvc`); None when the job
    # brings none or it does not exist (yet: pods wait for it under the start-up deadline).
    checkpoint_modes: tuple[str, ...] | None = None
    # Every node of the job's pods that is not Ready, lost or not (yet).
    outages: Mapping[str, NodeOutage] = field(default_factory=dict)
    # The RayCluster's worker groups as they are: group → (replicas, minReplicas,
    # maxReplicas); a hand edit of them shows here, not in the revision annotation.
    cluster_groups: Mapping[str, tuple[object, object, object]] = field(default_factory=dict)
    # The job's place in Kueue; None for a job that names no queue and has no Workload
    # known to the operator.
    queue: QueueState | None = None
    # Pods wearing the job's label that have not ended, whichever RayCluster made them (a
    # deleted one's pods are not compute pods any more, but still hold what they requested),
    # but for those on lost nodes, which no kubelet runs.
    pods_left: int = 0
    # Such pods of a deleted RayCluster on lost nodes: no kubelet will finish them, so they
    # are force-deleted like the job's own stranded pods.
    stranded_orphans: tuple[str, ...] = ()

    def pending_losses(self) -> dict[str, NodeOutage]:
        """Nodes that are not Ready but do not count as lost yet: they may come back."""
        return {n: o for n, o in self.outages.items() if n not in self.lost_nodes}

    def live_compute(self) -> list[PodView]:
        """Compute pods that are neither failed, going away, nor on a lost node."""
        return [
            p for p in self.compute
            if not p.deleting and p.failure is None and p.node not in self.lost_nodes
        ]


@dataclass(frozen=True)
class InTheWay:
    """An object with a child's name that this RLJob does not own."""

    kind: str
    name: str
    owner: str  # who owns it, in words

    def describe(self, namespace: str) -> str:
        return (f"{self.kind} {namespace}/{self.name} exists and is not this RLJob's "
                f"({self.owner}); the job does not proceed until it is deleted or renamed")


def owner_words(meta: Obj) -> str:
    """Who owns an object, for a message: its controller (or first owner), else nobody."""
    refs = list(meta.get("ownerReferences") or [])
    if not refs:
        return "it has no owner"
    ref = next((r for r in refs if r.get("controller")), refs[0])
    return f"owned by {ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})"


def owned_by(meta: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in meta.get("ownerReferences") or [])


def _condition(obj: Obj, kind: str) -> Obj | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def _terminated(pod: Obj) -> Obj | None:
    """The terminated state of the pod's first (Ray or driver) container, if it ended."""
    containers = pod.get("spec", {}).get("containers") or [{}]
    first = containers[0].get("name")
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == first:
            terminated = (status.get("state") or {}).get("terminated")
            return dict(terminated) if terminated else None
    return None


def _waiting(pod: Obj) -> tuple[Stuck | None, str | None]:
    """The first container (init containers first) that cannot start, and the first waiting
    reason of any container (what a pod that is not running yet is doing)."""
    status = pod.get("status") or {}
    first: str | None = None
    for statuses in (status.get("initContainerStatuses"), status.get("containerStatuses")):
        for cs in statuses or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if not reason:
                continue
            first = first or reason
            if reason in STUCK_REASONS:
                image = f" (image {cs['image']})" if cs.get("image") else ""
                detail = f"{reason}{image}: {waiting.get('message') or reason}"
                return Stuck(STUCK_REASONS[reason], str(cs.get("name") or ""), detail), first
    return None, first


def pod_failure(pod: Obj) -> FailureHint | None:
    """Why a pod failed, if it did: evicted, failed phase, or a dead first container."""
    status = pod.get("status") or {}
    if status.get("reason") == "Evicted":
        return FailureHint(FailureKind.pod_evicted.value, status.get("message") or "evicted")
    terminated = _terminated(pod)
    if status.get("phase") == "Failed" or (terminated and terminated.get("exitCode") != 0):
        detail = status.get("message") or status.get("reason") or ""
        code = terminated.get("exitCode") if terminated else None
        if terminated:
            detail = (f"container exited with code {code} "
                      f"({terminated.get('reason') or 'Error'}) {detail}").strip()
        return FailureHint(FailureKind.pod_failed.value, detail or "pod failed",
                           exit_code=code if isinstance(code, int) else None,
                           started_at=(terminated or {}).get("startedAt"))
    return None


def pod_view(pod: Obj) -> PodView:
    meta = pod["metadata"]
    status = pod.get("status") or {}
    scheduled = _condition(pod, "PodScheduled")
    unschedulable = None
    if scheduled and scheduled.get("status") == "False":
        unschedulable = scheduled.get("message") or scheduled.get("reason") or "not scheduled"
    ready = _condition(pod, "Ready")
    stuck, waiting = _waiting(pod)
    return PodView(
        name=meta["name"],
        component=(meta.get("labels") or {}).get(names.LABEL_COMPONENT, ""),
        phase=status.get("phase") or "Pending",
        node=(pod.get("spec") or {}).get("nodeName"),
        deleting=meta.get("deletionTimestamp") is not None,
        ready=bool(ready and ready.get("status") == "True"),
        failure=pod_failure(pod),
        unschedulable=unschedulable,
        annotations=dict(meta.get("annotations") or {}),
        stuck=stuck,
        waiting=waiting,
        uid=meta.get("uid"),
    )


def node_outages(nodes: Iterable[Obj], used: Iterable[str],
                 lost_after: float) -> dict[str, NodeOutage]:
    """The nodes the job's pods are bound to that are gone or not Ready, each with when it
    counts as lost: a node that is gone at once (no kubelet is left to finish its pods), one
    that is not Ready once it has been so for `lost_after` seconds since its Ready
    condition's lastTransitionTime. A node is only marked NotReady after its kubelet has been
    silent for the node-monitor grace period, and it often comes back (a kubelet restart, a
    network or control-plane blip): force-deleting its pods at once would restart jobs whose
    processes still run. A condition without a time cannot be debounced and counts at once."""
    listed = {n["metadata"]["name"]: n for n in nodes}
    out: dict[str, NodeOutage] = {}
    for name in sorted(set(used)):
        node = listed.get(name)
        if node is None:
            out[name] = NodeOutage("gone", None, None)
            continue
        ready = _condition(node, "Ready") or {}
        status = str(ready.get("status") or "Unknown")
        if status == "True":
            continue
        since = parse_timestamp(ready.get("lastTransitionTime"))
        lost_at = since + timedelta(seconds=lost_after) if since is not None else None
        out[name] = NodeOutage(status, since, lost_at if lost_after > 0 else None)
    return out


def lost_nodes(outages: Mapping[str, NodeOutage], now: datetime | None) -> frozenset[str]:
    """The nodes of `outages` that count as lost at `now` (None: those lost at once)."""
    return frozenset(name for name, o in outages.items()
                     if o.lost_at is None or (now is not None and now >= o.lost_at))


def _controller_uid(meta: Obj) -> str | None:
    refs = meta.get("ownerReferences") or []
    ref = next((r for r in refs if r.get("controller")), None)
    return str(ref["uid"]) if ref and ref.get("uid") else None


def observe(job_name: str, raycluster: Obj | None, pods: Iterable[Obj], nodes: Iterable[Obj],
            hints: Mapping[str, FailureHint] | None = None, uid: str | None = None,
            in_the_way: InTheWay | None = None, now: datetime | None = None,
            node_lost_after: float = 0.0) -> Observed:
    """The job's children as one view. With the RLJob's `uid`, a RayCluster or driver pod of
    the child's name that the job does not own is reported as in the way (never adopted,
    patched or deleted), and pods of another RayCluster (say, of a deleted job of the same
    name) are not taken for this job's compute pods. A node that is not Ready counts as lost
    once it has been so for `node_lost_after` seconds at `now` (0: at once)."""
    if node_lost_after > 0 and now is None:
        raise ValueError("observe: node_lost_after needs the clock (now)")
    pods = list(pods)
    driver_name = names.driver_name(job_name)
    cluster_uid: str | None = None
    if raycluster is not None and uid is not None:
        meta = raycluster["metadata"]
        if not owned_by(meta, uid):
            in_the_way = in_the_way or InTheWay("RayCluster", meta["name"], owner_words(meta))
            raycluster = None
        else:
            cluster_uid = meta.get("uid")
    kept = []
    for pod in pods:
        meta = pod["metadata"]
        owner = _controller_uid(meta)
        if uid is not None and meta["name"] == driver_name:
            if not owned_by(meta, uid):
                in_the_way = in_the_way or InTheWay("Pod", driver_name, owner_words(meta))
                continue
        elif uid is not None and (owner is None or owner != cluster_uid):
            # A pod of another RayCluster, or of one that is gone (the job's was deleted and
            # its pods not collected yet), or one that only wears the job's labels (made by
            # hand, owned by nobody): never taken for this job's compute pods, so never
            # counted, replaced or deleted as one of them.
            continue
        kept.append(pod)
    live = [p for p in pods
            if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
    others = {str(p["spec"].get("nodeName")) for p in live if p.get("spec", {}).get("nodeName")}
    seen = _observe(job_name, raycluster, kept, nodes, hints, in_the_way, now,
                    node_lost_after, others)
    kept_names = {p["metadata"]["name"] for p in kept}
    lost = [p for p in live if p.get("spec", {}).get("nodeName") in seen.lost_nodes]
    return replace(seen, pods_left=len(live) - len(lost), stranded_orphans=tuple(sorted(
        p["metadata"]["name"] for p in lost if p["metadata"]["name"] not in kept_names)))


def _observe(job_name: str, raycluster: Obj | None, pods: Iterable[Obj], nodes: Iterable[Obj],
             hints: Mapping[str, FailureHint] | None, in_the_way: InTheWay | None,
             now: datetime | None, node_lost_after: float,
             other_nodes: Iterable[str] = ()) -> Observed:
    views = [pod_view(p) for p in pods]
    driver_name = names.driver_name(job_name)
    driver = next((v for v in views if v.name == driver_name), None)
    compute = tuple(sorted(
        (v for v in views if v.component in names.COMPUTE_COMPONENTS and v.name != driver_name),
        key=lambda v: v.name,
    ))
    used = {v.node for v in views if v.node} | set(other_nodes)
    cluster: ClusterState = "absent"
    revision = None
    groups: dict[str, tuple[object, object, object]] = {}
    if raycluster is not None:
        deleting = raycluster["metadata"].get("deletionTimestamp") is not None
        cluster = "deleting" if deleting else "present"
        revision = (raycluster["metadata"].get("annotations") or {}).get(
            names.ANNOTATION_REVISION)
        groups = cluster_groups(raycluster)
    outages = node_outages(nodes, used, node_lost_after)
    return Observed(
        cluster=cluster,
        driver=driver,
        compute=compute,
        lost_nodes=lost_nodes(outages, now),
        hints=dict(hints or {}),
        in_the_way=in_the_way,
        cluster_revision=revision,
        outages=outages,
        cluster_groups=groups,
    )


def cluster_groups(raycluster: Obj) -> dict[str, tuple[object, object, object]]:
    """The worker groups' sizes as the RayCluster has them (whatever their type: a hand
    edit may leave anything there)."""
    spec = raycluster.get("spec") if isinstance(raycluster.get("spec"), dict) else {}
    out: dict[str, tuple[object, object, object]] = {}
    for group in (spec or {}).get("workerGroupSpecs") or []:
        if isinstance(group, dict):
            out[str(group.get("groupName"))] = (group.get("replicas"), group.get("minReplicas"),
                                                group.get("maxReplicas"))
    return out


@dataclass(frozen=True)
class Relabel:
    """A child of the job, provably its own, whose labels were edited: the labels the
    operator finds it by are put back (a merge patch of exactly these)."""

    kind: str  # "Pod" or "RayCluster"
    name: str
    labels: Mapping[str, str]


def _component_of(meta: Obj) -> str | None:
    """A compute pod's component, from its own label or, where that was removed, from
    KubeRay's labels (which the operator's templates line up with its components)."""
    labels = meta.get("labels") or {}
    own = labels.get(names.LABEL_COMPONENT)
    if own in names.COMPUTE_COMPONENTS:
        return str(own)
    if labels.get("ray.io/node-type") == "head":
        return HEAD
    group = labels.get("ray.io/group")
    return str(group) if group in names.COMPUTE_COMPONENTS else None


def label_repairs(job_name: str, uid: str, raycluster: Obj | None,
                  pods: Iterable[Obj]) -> list[Relabel]:
    """The job's own children whose labels were edited by hand, with the labels to put
    back. Why: the operator and `kubectl get -l rljob.io/job=NAME` find children by these
    labels; one without them is missed by a fresh list (a running driver taken for a
    deleted one, a restart counted for it). Own means provably so: the RayCluster and the
    driver pod by an owner reference with the job's UID, compute pods by their controller
    being that RayCluster; a look-alike is never relabelled."""
    out: list[Relabel] = []
    cluster_uid = None
    if raycluster is not None and owned_by(raycluster["metadata"], uid):
        cluster_uid = raycluster["metadata"].get("uid")
        want = names.labels(job_name, HEAD)
        out += _relabel("RayCluster", raycluster["metadata"], want)
    driver = names.driver_name(job_name)
    for pod in pods:
        meta = pod["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        if meta["name"] == driver and owned_by(meta, uid):
            out += _relabel("Pod", meta, names.labels(job_name, DRIVER))
        elif cluster_uid is not None and _controller_uid(meta) == cluster_uid:
            component = _component_of(meta)
            want = names.labels(job_name, component or "")
            if component is None:
                del want[names.LABEL_COMPONENT]
            out += _relabel("Pod", meta, want)
    return out


def _relabel(kind: str, meta: Obj, want: Mapping[str, str]) -> list[Relabel]:
    have = meta.get("labels") or {}
    missing = {k: v for k, v in want.items() if have.get(k) != v}
    return [Relabel(kind, str(meta["name"]), missing)] if missing else []
