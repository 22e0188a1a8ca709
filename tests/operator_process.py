"""The operator as a child process, and pools of fake GPU nodes reserved for one test.

Shared by the operator tests, the kwok end-to-end suite and the scale benchmark: all of
them run the real `rljob-operator` against the harness's control plane.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rljob_api.status import timestamp as now
from tests.controlplane import ControlPlane, free_port
from tests.polling import wait_for

POOL_LABEL = "rljob.io/test-pool"
INTERVAL = 0.5  # the operator's resync interval in tests
# How long a node is NotReady before the operator counts it lost, in tests: short, so that a
# stopped kubelet reads NodeLost within seconds (tests of the bound itself choose theirs).
NODE_LOST_AFTER = 2.0


@dataclass
class Operator:
    """One `rljob-operator` process against the test control plane."""

    cp: ControlPlane
    namespace: str
    log: Path
    interval: float = INTERVAL
    metrics_port: int = field(default_factory=free_port)
    liveness_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    kubeconfig: Path | None = None  # default: the control plane's admin
    extra_args: tuple[str, ...] = ()
    node_lost_after: float = NODE_LOST_AFTER

    def start(self) -> None:
        kubeconfig = self.kubeconfig or self.cp.kubeconfig
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rljob_operator", "--kubeconfig", str(kubeconfig),
                 "--namespace", self.namespace, "--interval", str(self.interval),
                 "--server-timeout", "30", "--metrics-port", str(self.metrics_port),
                 "--metrics-addr", "127.0.0.1",
                 "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz",
                 "--node-lost-after", str(self.node_lost_after), *self.extra_args],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        wait_for(self.healthy, timeout=60, what="operator liveness endpoint",
                 describe=self.tail)

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"operator exited with {self.proc.returncode}")
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies under the operator."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()

    def metric(self, name: str) -> float:
        """Sum of one metric's samples (all label values)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as resp:
            text = resp.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def stop_kubelet(cp: ControlPlane, node: str) -> None:
    """The node stops reporting: kwok lets go of it and its Ready condition reads Unknown."""
    cp.kubectl("annotate", "node", node, "kwok.x-k8s.io/node-")
    unknown = {"status": {"conditions": [{
        "type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
        "message": "Kubelet stopped posting node status.", "lastHeartbeatTime": now(),
        "lastTransitionTime": now()}]}}
    cp.kubectl("patch", "node", node, "--subresource=status", "--type=strategic",
               "-p", json.dumps(unknown))


def node_ready(cp: ControlPlane, node: str) -> bool:
    obj = cp.get_json("node", node)
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in obj.get("status", {}).get("conditions", []))


@dataclass
class NodePool:
    """kwok nodes labelled `POOL_LABEL=<pool>`: jobs that select the label land only there,
    so failing or deleting these nodes never touches other tests."""

    cp: ControlPlane
    pool: str
    made: list[str] = field(default_factory=list)

    def add(self, count: int, gpus: int, labels: dict[str, str] | None = None) -> list[str]:
        """Add `count` nodes with `gpus` GPUs each and wait until they are Ready."""
        nodes = self.cp.add_fake_nodes(count, gpus, prefix=f"{self.pool}-n{len(self.made)}",
                                       labels={POOL_LABEL: self.pool, **(labels or {})})
        self.made.extend(nodes)
        wait_for(lambda: set(nodes) <= self.ready(), timeout=60, what=f"nodes {nodes} Ready")
        return nodes

    def ready(self) -> set[str]:
        """Names of this pool's nodes that are Ready now (one list call)."""
        items = self.cp.get_json("nodes", "-l", f"{POOL_LABEL}={self.pool}")["items"]
        return {n["metadata"]["name"] for n in items
                if any(c["type"] == "Ready" and c["status"] == "True"
                       for c in n.get("status", {}).get("conditions", []))}

    def remove(self) -> None:
        if self.made:
            self.cp.kubectl("delete", "node", *self.made, "--wait=false", "--ignore-not-found",
                            check=False)


@pytest.fixture
def operator(cluster: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[Operator]:
    """The operator watching this test's namespace (tests read `operator.tail()` on failure)."""
    op = Operator(cluster, namespace, tmp_path / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()
