"""GPUs as Kubernetes allocates them, in kind without GPUs.

Each kind worker runs `rljob-fake-gpu`, a kubelet device plugin (hack/fake-gpu-plugin) that
advertises 8 `nvidia.com/gpu` (its `--devices`: an H100/H200 node) and, per container, gives
what NVIDIA's device plugin and container toolkit give: `NVIDIA_VISIBLE_DEVICES` with the
UUIDs of the container's GPUs and the device files `/dev/nvidia<i>` of those GPUs only. The
scheduler, the kubelet's device manager and the container runtime are the real ones. Every
fact asserted here is what a container printed about itself or what the Node and Pod status
say; the number of GPUs a worker has is read from its Node, so the test follows the
plugin's `--devices`.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from e2e.kind.kindcluster import KindCluster, run
from tests.controlplane import REPO
from tests.polling import wait_for

pytestmark = pytest.mark.e2e

NAMESPACE = "fake-gpus"
RESOURCE = "nvidia.com/gpu"
START_S = 300            # the image is on the node; 2 busy cores
# Each container says what it was given, then holds its GPUs (a finished pod frees them).
REPORT = ('echo "NVIDIA_VISIBLE_DEVICES=${NVIDIA_VISIBLE_DEVICES-<unset>}"; '
          'ls -l /dev/nvidia* 2>/dev/null; echo "reported."; exec sleep 3600')


def _image() -> str:
    """The CPU trainer image hack/kind-up loads into every worker (it has a shell and ls)."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return f"ghcr.io/rljob/trainer:{version}-cpu"


def _pod(name: str, gpus: dict[str, int], node: str | None = None) -> dict[str, Any]:
    """A pod with one container per entry of `gpus` (name -> GPUs it asks for; 0: none)."""
    containers = []
    for container, count in gpus.items():
        resources: dict[str, Any] = {"requests": {"cpu": "10m", "memory": "16Mi"}}
        if count:
            resources["limits"] = {RESOURCE: str(count)}
        containers.append({"name": container, "image": _image(), "imagePullPolicy": "Never",
                           "command": ["sh", "-c", REPORT], "resources": resources})
    spec: dict[str, Any] = {"containers": containers, "restartPolicy": "Never",
                            "terminationGracePeriodSeconds": 0}
    if node:  # through the scheduler (not spec.nodeName), so that it counts the GPUs
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}


@dataclass(frozen=True)
class Seen:
    """What one container printed about itself."""

    pod: str
    container: str
    node: str
    visible: list[str]          # NVIDIA_VISIBLE_DEVICES, split; [] when unset
    devices: dict[str, str]     # /dev/nvidia* -> its `ls -l` mode and numbers


def _parse(log: str) -> tuple[list[str], dict[str, str]] | None:
    if "reported." not in log:
        return None
    env = re.search(r"^NVIDIA_VISIBLE_DEVICES=(.*)$", log, re.M)
    assert env, log
    visible = [] if env.group(1) == "<unset>" else env.group(1).split(",")
    devices = {}
    for line in log.splitlines():
        fields = line.split()
        if fields and fields[-1].startswith("/dev/nvidia"):
            # crw-rw-rw- 1 root root 1, 3 Dec  5 04:30 /dev/nvidia0
            devices[fields[-1]] = f"{fields[0][0]} {fields[4]}{fields[5]}"
    return visible, devices


class Pods:
    def __init__(self, cluster: KindCluster) -> None:
        self.cluster = cluster

    def create(self, pod: dict[str, Any]) -> None:
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(pod))

    def get(self, name: str) -> dict[str, Any]:
        pod: dict[str, Any] = self.cluster.get("pod", name, "-n", NAMESPACE)
        return pod

    def describe(self) -> str:
        return self.cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide",
                                    check=False).stdout

    def reports(self, name: str) -> list[Seen]:
        """Each container's report, once the pod runs and every container has printed it."""
        def probe() -> list[Seen] | None:
            pod = self.get(name)
            if pod["status"].get("phase") != "Running":
                return None
            seen = []
            for c in pod["spec"]["containers"]:
                log = self.cluster.kubectl("logs", "-n", NAMESPACE, name, "-c", c["name"],
                                           check=False).stdout
                parsed = _parse(log)
                if parsed is None:
                    return None
                seen.append(Seen(name, c["name"], pod["spec"]["nodeName"], *parsed))
            return seen
        return wait_for(probe, timeout=START_S, interval=1, what=f"pod {name} to report",
                        describe=self.describe)

    def unschedulable(self, name: str) -> str:
        """The scheduler's message once it has found no node for the pod."""
        def probe() -> str | None:
            pod = self.get(name)
            for cond in pod["status"].get("conditions") or []:
                if (cond["type"] == "PodScheduled" and cond["status"] == "False"
                        and cond.get("reason") == "Unschedulable"):
                    return str(cond.get("message", ""))
            return None
        return wait_for(probe, timeout=120, interval=1, what=f"pod {name} to be Unschedulable",
                        describe=self.describe)


def _check(seen: Seen, asked: int) -> None:
    """A container sees exactly its GPUs: as many as it asked for, UUIDs of its own node,
    and the device file of each of them (a /dev/null-numbered character device)."""
    assert len(seen.visible) == asked and len(seen.devices) == asked, seen
    indices = []
    for uuid in seen.visible:
        prefix = f"GPU-{seen.node}-"
        assert uuid.startswith(prefix), seen
        indices.append(int(uuid.removeprefix(prefix)))
    assert sorted(seen.devices) == sorted(f"/dev/nvidia{i}" for i in indices), seen
    assert all(mode == "c 1,3" for mode in seen.devices.values()), seen


def _node_gpus(cluster: KindCluster) -> dict[str, tuple[str | None, str | None]]:
    """Each node's nvidia.com/gpu (capacity, allocatable)."""
    return {n["metadata"]["name"]: (n["status"].get("capacity", {}).get(RESOURCE),
                                    n["status"].get("allocatable", {}).get(RESOURCE))
            for n in cluster.get("nodes")["items"]}


def _registrations(node: str) -> int:
    """How many times the node's plugin registered with its kubelet (its journal)."""
    proc = run("podman", "exec", node, "journalctl", "-u", "rljob-fake-gpu", "-o", "cat",
               "--no-pager", timeout=60)
    return proc.stdout.count("registered ")


@pytest.fixture
def namespace(collect_on_failure: KindCluster) -> Iterator[KindCluster]:
    cluster = collect_on_failure
    cluster.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true",
                    timeout=300)
    cluster.kubectl("create", "namespace", NAMESPACE)
    yield cluster
    # Gone before the next test: its pods hold the workers' GPUs.
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=300, check=False)


@pytest.mark.timeout(3600)  # includes a cold hack/kind-up when this test runs first
def test_containers_get_their_own_fake_gpus_as_kubernetes_allocates_them(
        namespace: KindCluster) -> None:
    cluster = namespace
    workers = cluster.workers()
    assert len(workers) >= 2, workers
    a, b = workers[:2]

    # Every worker advertises the same number of GPUs (at least 4, so that the pods below
    # fit), allocatable as much as capacity; the control plane none.
    def advertised() -> int | None:
        seen = {_node_gpus(cluster)[w] for w in workers}
        if len(seen) != 1:
            return None
        ((capacity, allocatable),) = seen
        return int(capacity) if capacity and capacity == allocatable else None

    per_node = wait_for(advertised, timeout=120, interval=1,
                        what=f"every worker to advertise the same {RESOURCE} capacity, all of "
                        "it allocatable", describe=lambda: str(_node_gpus(cluster)))
    assert per_node >= 4, _node_gpus(cluster)
    assert all(gpus == (None, None) for node, gpus in _node_gpus(cluster).items()
               if node not in workers), _node_gpus(cluster)

    # Worker a filled exactly: a pod of the GPUs left after the next one, and a pod of three
    # containers asking 1, 2 and none (a sidecar that asks for none gets none). Worker b: a
    # 2-GPU pod.
    pods = Pods(cluster)
    rest = per_node - 3
    asked = {("one", "main"): rest, ("pair", "a"): 1, ("pair", "b"): 2, ("pair", "none"): 0,
             ("two", "main"): 2}
    pods.create(_pod("one", {"main": rest}, a))
    pods.create(_pod("pair", {"a": 1, "b": 2, "none": 0}, a))
    pods.create(_pod("two", {"main": 2}, b))
    seen = [s for name in ("one", "pair", "two") for s in pods.reports(name)]
    for s in seen:
        _check(s, asked[(s.pod, s.container)])
    by_node: dict[str, list[str]] = defaultdict(list)
    for s in seen:
        by_node[s.node] += s.visible
    # No two containers of a node share a GPU; every GPU of worker a is given out.
    assert all(len(ids) == len(set(ids)) for ids in by_node.values()), seen
    assert sorted(by_node[a], key=lambda u: int(u.rsplit("-", 1)[1])) == [
        f"GPU-{a}-{i}" for i in range(per_node)], seen
    assert len(by_node[b]) == 2, seen

    # More GPUs than any node has: Pending, Unschedulable. One more on the full worker a:
    # the same (the scheduler counts the GPUs held, not only the capacity).
    pods.create(_pod("too-many", {"main": per_node + 1}))
    pods.create(_pod("a-is-full", {"main": 1}, a))
    for name in ("too-many", "a-is-full"):
        message = pods.unschedulable(name)
        assert f"Insufficient {RESOURCE}" in message, (name, message)
        assert pods.get(name)["status"]["phase"] == "Pending"

    # A restarted kubelet forgets its plugins: worker b's plugin registers again, and the
    # kubelet still knows which GPUs pod `two` holds (its checkpoint), so a new 2-GPU pod on
    # b gets the other two.
    before = _registrations(b)
    run("podman", "exec", b, "systemctl", "restart", "kubelet", timeout=120)
    wait_for(lambda: _registrations(b) > before, timeout=120, interval=1,
             what=f"the plugin on {b} to register with its restarted kubelet")
    pods.create(_pod("after-restart", {"main": 2}, b))
    (after,) = pods.reports("after-restart")
    _check(after, 2)
    assert not set(after.visible) & set(by_node[b]), (after, by_node[b])
