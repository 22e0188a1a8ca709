"""Helpers to read an RLJob and its children from the test control plane, and to play the
kubelet (pod status patches)."""

from __future__ import annotations

import json
from typing import Any

from rljob_api.status import timestamp as now
from tests.controlplane import ControlPlane
from tests.polling import wait_for

Obj = dict[str, Any]


def status(cp: ControlPlane, ns: str, name: str) -> Obj:
    return dict(cp.get_json("rljob", name, "-n", ns).get("status") or {})


def wait_phase(cp: ControlPlane, ns: str, name: str, phase: str, timeout: float = 90) -> Obj:
    """Wait for `phase`; return the status that showed it."""
    seen: list[Obj] = [{}]

    def probe() -> Obj | None:
        seen[0] = status(cp, ns, name)
        return seen[0] if seen[0].get("phase") == phase else None

    return wait_for(probe, timeout=timeout, what=f"RLJob {ns}/{name} phase {phase}",
                    describe=lambda: json.dumps(seen[0], indent=1)[-3000:])


def pods(cp: ControlPlane, ns: str, name: str, component: str | None = None) -> list[Obj]:
    selector = f"rljob.io/job={name}"
    if component:
        selector += f",rljob.io/component={component}"
    items: list[Obj] = cp.get_json("pods", "-n", ns, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def patch_pod_phase(cp: ControlPlane, ns: str, pod: str, phase: str, exit_code: int) -> None:
    """What a kubelet reports when the pod's containers end."""
    obj = cp.get_json("pod", pod, "-n", ns)
    statuses = [{
        "name": c["name"], "image": c["image"], "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": exit_code,
                                 "reason": "Completed" if exit_code == 0 else "Error",
                                 "startedAt": now(), "finishedAt": now()}},
    } for c in obj["spec"]["containers"]]
    patch = {"status": {"phase": phase, "containerStatuses": statuses}}
    cp.kubectl("patch", "pod", pod, "-n", ns, "--subresource=status", "--type=merge",
               "-p", json.dumps(patch))
