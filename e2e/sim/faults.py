"""Faults injected into a kwok cluster, and where a namespace's RLJobs run.

kwok plays every kubelet, so a "dead kubelet" is a node kwok stops managing whose Ready
condition turns Unknown, exactly what the node controller would write after the grace
period; a lost machine is a deleted Node.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tests.controlplane import ControlPlane

Obj = dict[str, Any]


def live_pods(cp: ControlPlane, namespace: str) -> list[Obj]:
    """Every RLJob pod of the namespace that is not being deleted."""
    items: list[Obj] = cp.get_json("pods", "-n", namespace, "-l", "rljob.io/job")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def jobs_by_node(pods: list[Obj], spare: frozenset[str] = frozenset()) -> dict[str, set[str]]:
    """node → the jobs with at least one pod bound there, not counting pods of the
    components in `spare` (rollout pods, whose loss the runtime absorbs)."""
    placed: dict[str, set[str]] = defaultdict(set)
    for pod in pods:
        node = pod["spec"].get("nodeName")
        if node and pod["metadata"]["labels"]["rljob.io/component"] not in spare:
            placed[node].add(pod["metadata"]["labels"]["rljob.io/job"])
    return dict(placed)


def compute_pods(pods: list[Obj], job: str, components: tuple[str, ...] = (
        "head", "trainer", "rollout", "colocated")) -> list[str]:
    """Names of the job's Ray pods of `components` (by default every one: head, trainer,
    rollout), sorted for seeded choices."""
    return sorted(p["metadata"]["name"] for p in pods
                  if p["metadata"]["labels"]["rljob.io/job"] == job
                  and p["metadata"]["labels"]["rljob.io/component"] in components)
