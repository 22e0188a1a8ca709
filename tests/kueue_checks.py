"""What Kueue counts of a pod, and a check that a job's real pods stay within what Kueue
admitted for them (the control-plane and kind tests share it)."""

from __future__ import annotations

from typing import Any

from kubernetes.utils import parse_quantity

from rljob_operator import kueue

Obj = dict[str, Any]


def requests(pod_spec: Obj) -> dict[str, float]:
    """A pod's requests as the scheduler and Kueue count them: its containers and native
    sidecars, or an init container with the sidecars started before it, whichever is more."""
    def of(c: Obj) -> dict[str, float]:
        asked = (c.get("resources") or {}).get("requests") or {}
        return {k: float(parse_quantity(str(v))) for k, v in asked.items()}

    def plus(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {*a, *b}}

    total: dict[str, float] = {}
    sidecars: dict[str, float] = {}
    peak: dict[str, float] = {}
    for c in pod_spec.get("initContainers") or []:
        if c.get("restartPolicy") == "Always":
            sidecars = plus(sidecars, of(c))
        else:
            here = plus(sidecars, of(c))
            peak = {k: max(peak.get(k, 0.0), here.get(k, 0.0)) for k in {*peak, *here}}
    for c in pod_spec["containers"]:
        total = plus(total, of(c))
    total = plus(total, sidecars)
    return {k: max(total.get(k, 0.0), peak.get(k, 0.0)) for k in {*total, *peak}}


def admitted_within(workload: Obj, pods: list[Obj]) -> dict[str, float]:
    """Every pod asks no more (CPU, memory, GPUs) than Kueue admitted for its pod set: what
    the real pods request, KubeRay's additions included, is what Kueue counted. Returns
    what Kueue admitted in all, by resource."""
    wl = workload
    usage = {a["name"]: a for a in wl["status"]["admission"]["podSetAssignments"]}
    counts = {s["name"]: s["count"] for s in wl["spec"]["podSets"]}
    for pod in pods:
        podset = pod["metadata"]["labels"][kueue.LABEL_PODSET]
        per_pod = {k: float(parse_quantity(str(v))) / counts[podset]
                   for k, v in usage[podset]["resourceUsage"].items()}
        for resource, asked in requests(pod["spec"]).items():
            assert asked <= per_pod.get(resource, 0.0) + 1e-9, (
                pod["metadata"]["name"], resource, asked, per_pod)
    total: dict[str, float] = {}
    for a in usage.values():
        for k, v in a["resourceUsage"].items():
            total[k] = total.get(k, 0.0) + float(parse_quantity(str(v)))
    return total
