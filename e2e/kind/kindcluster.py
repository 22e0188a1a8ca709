"""kind end-to-end helpers: what the suite needs, the cluster handle, artifact collection.

The cluster comes from `hack/kind-up` (the same script a developer runs), so the suite tests
what users get: a kind cluster built here with nothing pulled, our images loaded, KubeRay and
our chart installed. Everything is driven through `kubectl` and `helm`, as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.controlplane import REPO

CHART = REPO / "charts" / "rljob-operator"
EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"
KIND_UP = REPO / "hack" / "kind-up"
KIND_DOWN = REPO / "hack" / "kind-down"
# The cluster the suite uses: its own by default; RLJOB_E2E_CLUSTER=rljob reuses the one
# `hack/kind-up` made (kind-up is idempotent, and a cluster that existed before the suite is
# left running).
CLUSTER_NAME = os.environ.get("RLJOB_E2E_CLUSTER", "rljob-e2e")
WORKERS = 2


def run(*cmd: str, timeout: float = 1800, check: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          input=input, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}{proc.stdout[-2000:]}")
    return proc


def missing_prerequisites() -> list[str]:
    """What stops `hack/kind-up` from building a cluster on this machine, each said so that a
    reader knows what to do. kind-up installs podman and the rest itself where it can."""
    missing: list[str] = []
    if os.geteuid() != 0:
        missing.append("hack/kind-up runs privileged podman containers and needs root")
    if shutil.which("podman") is None and shutil.which("apt-get") is None:
        missing.append("no podman, and no apt-get to install it")
    if shutil.which("go") is None:
        missing.append("no Go toolchain (kind and the Kubernetes binaries are built from "
                       "pinned Go modules)")
    return missing


@dataclass
class KindCluster:
    name: str
    kubeconfig: Path
    bins: Path
    artifacts: Path

    def kubectl(self, *args: str, check: bool = True, timeout: float = 300,
                input: str | None = None) -> subprocess.CompletedProcess[str]:
        return run(str(self.bins / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args,
                   timeout=timeout, check=check, input=input)

    def get(self, *args: str) -> Any:
        """`kubectl get ... -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def workers(self) -> list[str]:
        nodes = self.get("nodes")["items"]
        return sorted(n["metadata"]["name"] for n in nodes
                      if "node-role.kubernetes.io/control-plane" not in n["metadata"]["labels"])

    def stop_node(self, node: str) -> None:
        """Lose a node: its container stops, so its kubelet and every pod on it die at once."""
        run("podman", "stop", "--time", "0", node, timeout=120)

    def start_node(self, node: str) -> None:
        run("podman", "start", node, timeout=120)

    def cordon(self, node: str, cordoned: bool = True) -> None:
        """Keep new pods off `node` (or let them on again); pods on it stay."""
        self.kubectl("cordon" if cordoned else "uncordon", node)

    def ready(self, node: str) -> bool:
        conditions = self.get("node", node)["status"].get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def host_path(self, namespace: str, claim: str) -> Path:
        """Where the volume bound to `claim` lies on this machine: every node mounts the
        cluster's shared directory at /tmp/hostpath_pv (hack/kind-up), kind's provisioner
        makes each volume under it."""
        volume = self.get("pvc", claim, "-n", namespace)["spec"]["volumeName"]
        spec = self.get("pv", volume)["spec"]
        path = Path((spec.get("hostPath") or spec.get("local"))["path"])
        return self.kubeconfig.parent / "shared" / path.relative_to("/tmp/hostpath_pv")


    def collect(self, label: str) -> Path:
        """Everything a reader needs to see why a run failed, as files."""
        out = self.artifacts / label
        out.mkdir(parents=True, exist_ok=True)
        commands = {
            "get-all.txt": ["get", "nodes,rljobs,rayclusters,pods,pvc,pv,events", "-A", "-o",
                            "wide"],
            "rljobs.yaml": ["get", "rljobs", "-A", "-o", "yaml"],
            "describe-rljobs.txt": ["describe", "rljobs", "-A"],
            "describe-pods.txt": ["describe", "pods", "-A"],
            "describe-rayclusters.txt": ["describe", "rayclusters", "-A"],
            "describe-nodes.txt": ["describe", "nodes"],
            "events.txt": ["get", "events", "-A", "--sort-by=.lastTimestamp"],
        }
        for filename, args in commands.items():
            proc = self.kubectl(*args, check=False)
            (out / filename).write_text(proc.stdout + proc.stderr)
        pods = self.kubectl("get", "pods", "-A", "-o",
                            "jsonpath={range .items[*]}{.metadata.namespace} "
                            "{.metadata.name}{'\\n'}{end}", check=False).stdout
        for line in pods.splitlines():
            if not line.strip():
                continue
            ns, pod = line.split()
            for previous in (False, True):
                proc = self.kubectl("logs", "-n", ns, pod, "--all-containers",
                                    *(["--previous"] if previous else []), check=False)
                if proc.stdout:
                    suffix = ".previous" if previous else ""
                    (out / f"logs-{ns}-{pod}{suffix}.txt").write_text(proc.stdout)
        return out


def cluster_exists(name: str) -> bool:
    """Whether kind's node containers of cluster `name` exist (kind labels them)."""
    if shutil.which("podman") is None:
        return False
    proc = run("podman", "ps", "-aq", "--filter", f"label=io.x-k8s.kind.cluster={name}",
               timeout=60, check=False)
    return bool(proc.stdout.strip())
