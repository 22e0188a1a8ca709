"""Where every actor of a run really is, from Ray's own facts, and whether it belongs there.

On a cluster each kind of actor has a pod it is meant for: trainer ranks on trainer pods,
engines on rollout pods (both on the shared pods when colocated), the rollout worker on the
driver pod, the weight-sync store on the Ray head (behind the head Service the sidecars
dial). Placement asks for that through custom Ray resources (`rljob_api.layout`); this
module checks the outcome instead of trusting it. Each actor reports the Ray node it runs on
and its host name (in Kubernetes: the pod's name) from inside its own process, and
`ray.nodes()` tells which kind of pod each node is (the custom resource the operator gave
it). The driver prints the table at start-up, plus one line
`placement: {"ok": ..., "actors": [...]}` that a test can parse from the driver's log.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from rljob_api.layout import (
    DRIVER,
    DRIVER_RESOURCE,
    GROUPS,
    HEAD,
    HEAD_RESOURCE,
    group_resource,
)

LINE_PREFIX = "placement: "
TRAINER = "trainer"
ENGINE = "engine"
ROLLOUT_WORKER = "rollout-worker"
STORE = "weight-sync-store"
SIDECAR = "weight-sync-sidecar"


def node_groups(nodes: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Ray node id → the kind of pod it is: a worker group (`trainer`, `rollout`,
    `colocated`), `driver` or `head`; "" for a node with none of the operator's resources
    (a machine running `rljob run` by itself)."""
    out: dict[str, str] = {}
    for node in nodes:
        if not node.get("Alive", True):
            continue
        resources = node.get("Resources") or {}
        group = next((g for g in GROUPS if group_resource(g) in resources), "")
        if not group and DRIVER_RESOURCE in resources:
            group = DRIVER
        if not group and HEAD_RESOURCE in resources:
            group = HEAD
        out[str(node["NodeID"])] = group
    return out


@dataclass(frozen=True)
class Placed:
    """One actor: what it is, where Ray runs it, and where it is meant to run (None: no
    expectation, as on one machine)."""

    role: str
    index: int
    node_id: str
    host: str
    group: str
    expected: str | None

    @property
    def ok(self) -> bool:
        return self.expected is None or self.group == self.expected


def table(rows: Iterable[Placed]) -> str:
    """The placement as a text table, one actor per line."""
    header = ("actor", "ray node", "host (pod)", "pod kind", "meant for", "ok")
    lines = [header] + [
        (f"{r.role}-{r.index}", r.node_id[:12], r.host, r.group or "-", r.expected or "-",
         "yes" if r.ok else "NO")
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    body = "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
                     .rstrip() for line in lines)
    return "placement (from Ray: each actor's node and host):\n" + body


def json_line(rows: Iterable[Placed]) -> str:
    """`placement: {...}`: every actor with its node id, host, pod kind and expectation."""
    actors = [{**asdict(r), "ok": r.ok} for r in rows]
    return LINE_PREFIX + json.dumps({"ok": all(a["ok"] for a in actors), "actors": actors},
                                    separators=(",", ":"))


def parse_line(line: str) -> dict[str, Any] | None:
    """The placement a `json_line` printed, from one log line (None for other lines)."""
    if not line.startswith(LINE_PREFIX):
        return None
    data: dict[str, Any] = json.loads(line[len(LINE_PREFIX):])
    return data


def dead_hosts(placed: Iterable[Placed], nodes: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Host (on a cluster: pod) → why Ray says its node died, for the nodes this attempt's
    actors ran on that Ray no longer counts alive. Nodes of earlier attempts (a Ray head
    outlives attempts, so its node table keeps them) are not this attempt's and are left out:
    node ids are unique per raylet start."""
    hosts = {p.node_id: p.host for p in placed}
    out: dict[str, str] = {}
    for node in nodes:
        node_id = str(node.get("NodeID"))
        if node_id in hosts and not node.get("Alive", True):
            why = str(node.get("DeathReasonMessage") or node.get("DeathReason") or "")
            out[hosts[node_id]] = why or "Ray marked its node dead"
    return out
