"""A node whose kubelet the test plays: kwok does not manage it, so its pods stay as the
scheduler bound them until the test reports a container state (an image that cannot be
pulled, a container that runs) the way a kubelet would.

kwok starts every pod on its nodes at once, which leaves no room for a pod that never
starts; this node does. Its Lease is renewed from a thread, as a kubelet's heartbeat, so
the node controller keeps it Ready for as long as the test runs, or until the test silences
its kubelet (`Kubelet.silence`): kwok, told to let go of a node, may still report it Ready
again a while later, so a node that must stay NotReady for a set time is a hand node.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rljob_api.status import timestamp as now
from tests.controlplane import ControlPlane, fake_node
from tests.operator_process import POOL_LABEL
from tests.polling import wait_for

HEARTBEAT_SECONDS = 5.0


def _lease(name: str) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": 40,
                     "renewTime": now().replace("Z", ".000000Z")}}


def _ready_status(gpus: int) -> dict[str, Any]:
    capacity = fake_node("x", gpus)["status"]["capacity"]
    return {"status": {"capacity": capacity, "allocatable": capacity, "conditions": [{
        "type": "Ready", "status": "True", "reason": "KubeletReady",
        "message": "the test plays this node's kubelet", "lastHeartbeatTime": now(),
        "lastTransitionTime": now()}]}}


@dataclass
class Kubelet:
    """Whether the hand-played kubelet of a node reports (renews its Lease, posts it
    Ready); switched under `lock`, so that no report lands after it is silenced."""

    cp: ControlPlane
    node: str
    gpus: int
    reporting: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self) -> None:
        with self.lock:
            if self.reporting:
                self.cp.apply(_lease(self.node))
                self.cp.kubectl("patch", "node", self.node, "--subresource=status",
                                "--type=merge", "-p", json.dumps(_ready_status(self.gpus)),
                                check=False)

    def silence(self) -> None:
        """The kubelet stops reporting, and its node reads Ready `Unknown` from now on, as
        the node controller marks a node whose kubelet went silent (the test does not wait
        for its grace period)."""
        with self.lock:
            self.reporting = False
        unknown = {"status": {"conditions": [{
            "type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
            "message": "Kubelet stopped posting node status.", "lastHeartbeatTime": now(),
            "lastTransitionTime": now()}]}}
        self.cp.kubectl("patch", "node", self.node, "--subresource=status",
                        "--type=strategic", "-p", json.dumps(unknown))

    def resume(self) -> None:
        """The kubelet reports again: its node is Ready from now on."""
        with self.lock:
            self.reporting = True
        self.report()


@contextmanager
def hand_node(cp: ControlPlane, name: str, pool: str, gpus: int,
              kubelet: Kubelet | None = None) -> Iterator[str]:
    """A Ready node labelled for `pool` with no kubelet behind it but the test's (`kubelet`,
    to silence it); removed on exit."""
    node = fake_node(name, gpus, {POOL_LABEL: pool})
    node["metadata"]["annotations"] = {}  # not kwok's: nothing starts its pods
    cp.apply(node)
    stop = threading.Event()
    kubelet = kubelet or Kubelet(cp, name, gpus)

    def beat() -> None:
        while True:
            kubelet.report()
            if stop.wait(HEARTBEAT_SECONDS):
                return

    thread = threading.Thread(target=beat, name=f"kubelet-{name}", daemon=True)
    thread.start()
    try:
        wait_for(lambda: not cp.get_json("node", name)["spec"].get("taints"), timeout=60,
                 what=f"node {name} Ready and untainted")
        yield name
    finally:
        stop.set()
        thread.join(timeout=30)
        cp.kubectl("delete", "node", name, "--wait=false", "--ignore-not-found", check=False)


def report_containers(cp: ControlPlane, ns: str, pod: str, waiting: dict[str, str] | None = None,
                      ip: str = "10.1.0.9") -> None:
    """What a kubelet reports for `pod`: every container running (the pod Ready), or, with
    `waiting` ({"reason", "message"}), every container waiting that way (the pod Pending)."""
    obj = cp.get_json("pod", pod, "-n", ns)
    running = waiting is None
    state = {"running": {"startedAt": now()}} if running else {"waiting": waiting}
    statuses = [{"name": c["name"], "image": c["image"], "imageID": "", "ready": running,
                 "restartCount": 0, "started": running, "state": state}
                for c in obj["spec"]["containers"]]
    flag = "True" if running else "False"
    conditions = [{"type": t, "status": flag, "lastTransitionTime": now()}
                  for t in ("Ready", "ContainersReady")]
    conditions += [{"type": t, "status": "True", "lastTransitionTime": now()}
                   for t in ("Initialized", "PodScheduled")]
    patch = {"status": {"phase": "Running" if running else "Pending", "podIP": ip,
                        "podIPs": [{"ip": ip}], "hostIP": "10.0.0.3", "startTime": now(),
                        "conditions": conditions, "containerStatuses": statuses}}
    cp.kubectl("patch", "pod", pod, "-n", ns, "--subresource=status", "--type=merge",
               "-p", json.dumps(patch))
