"""kind end-to-end helpers: prerequisites, the cluster handle, artifact collection.

Prerequisites are checked here so that a run without them skips with exactly what is
missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.controlplane import REPO

KIND_NODE_IMAGE = "kindest/node:v1.34.0"
CPU_BASE = "python:3.11.13-slim-bookworm"
CHART = REPO / "charts" / "rljob-operator"
EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"


def run(*cmd: str, timeout: float = 1800, check: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          input=input, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}{proc.stdout[-2000:]}")
    return proc


def images_to_build() -> dict[str, tuple[Path, dict[str, str]]]:
    """Tag → (Dockerfile, build args); the tags the chart and the example name."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    operator_tag = f"{values['image']['repository']}:{values['image']['tag']}"
    return {
        operator_tag: (REPO / "images" / "operator" / "Dockerfile", {}),
        spec["trainer"]["image"]: (REPO / "images" / "trainer" / "Dockerfile",
                                   {"VARIANT": "cpu"}),
        spec["rollout"]["image"]: (REPO / "images" / "rollout" / "Dockerfile",
                                   {"VARIANT": "cpu"}),
    }


def missing_prerequisites() -> list[str]:
    """Everything the suite lacks, each said so that a reader knows what to install."""
    missing: list[str] = []
    docker = shutil.which("docker")
    if docker is None:
        missing.append("the `docker` CLI is not on PATH")
    else:
        info = run(docker, "info", "--format", "{{.ServerVersion}}", timeout=30, check=False)
        if info.returncode != 0:
            first = (info.stderr.strip().splitlines() or ["no output"])[0]
            missing.append(f"no Docker engine (`docker info`: {first})")
    kind = os.environ.get("KIND") or shutil.which("kind")
    if kind is None:
        missing.append("no `kind` binary (not on PATH and $KIND is unset; "
                       "`go install sigs.k8s.io/kind@v0.30.0`)")
    if missing:
        return missing
    assert docker is not None
    absent = []
    for image in (KIND_NODE_IMAGE, CPU_BASE):
        if run(docker, "image", "inspect", image, timeout=60, check=False).returncode == 0:
            continue
        if run(docker, "pull", image, timeout=900, check=False).returncode != 0:
            absent.append(image)
    if absent:
        missing.append("base images not present and not pullable: " + ", ".join(absent))
    return missing


@dataclass
class KindCluster:
    name: str
    kubeconfig: Path
    bins: Path
    artifacts: Path

    def kubectl(self, *args: str, check: bool = True,
                input: str | None = None) -> subprocess.CompletedProcess[str]:
        return run(str(self.bins / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args,
                    timeout=300, check=check, input=input)

    def helm(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run(str(self.bins / "helm"), f"--kubeconfig={self.kubeconfig}", *args,
                    timeout=600)

    def collect(self, label: str) -> Path:
        """Everything a reader needs to see why a run failed, as files."""
        out = self.artifacts / label
        out.mkdir(parents=True, exist_ok=True)
        commands = {
            "get-all.txt": ["get", "rljobs,rayclusters,pods,jobs,events", "-A", "-o", "wide"],
            "rljobs.yaml": ["get", "rljobs", "-A", "-o", "yaml"],
            "describe-rljobs.txt": ["describe", "rljobs", "-A"],
            "describe-pods.txt": ["describe", "pods", "-A"],
            "describe-rayclusters.txt": ["describe", "rayclusters", "-A"],
        }
        for filename, args in commands.items():
            proc = self.kubectl(*args, check=False)
            (out / filename).write_text(proc.stdout + proc.stderr)
        pods = self.kubectl("get", "pods", "-A", "-o",
                            "jsonpath={range .items[*]}{.metadata.namespace} "
                            "{.metadata.name}{'\\n'}{end}", check=False).stdout
        for line in pods.splitlines():
            if not line.strip() or line.startswith("kube-system"):
                continue
            ns, pod = line.split()
            for previous in (False, True):
                proc = self.kubectl("logs", "-n", ns, pod, "--all-containers",
                                    *(["--previous"] if previous else []), check=False)
                if proc.stdout:
                    suffix = ".previous" if previous else ""
                    (out / f"logs-{ns}-{pod}{suffix}.txt").write_text(proc.stdout)
        return out


