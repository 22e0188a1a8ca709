"""Rendering the rljob-operator chart with the pinned `helm` from hack/k8s-bins."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rljob-operator"
CHART_CRD = CHART / "files" / "rljob.io_rljobs.yaml"
KUBE_VERSION = "1.34.2"
SERVICE_MONITOR_API = "monitoring.coreos.com/v1"
HELM_HOME = Path(tempfile.gettempdir()) / "rljob-test-helm-home"

Manifest = dict[str, Any]


def helm(bins: Path, *args: str, kubeconfig: Path | None = None,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run helm with a private config/cache home so tests never touch the user's repos."""
    env = {"HELM_CONFIG_HOME": str(HELM_HOME / "config"),
           "HELM_CACHE_HOME": str(HELM_HOME / "cache"),
           "HELM_DATA_HOME": str(HELM_HOME / "data"), "PATH": "/usr/bin:/bin"}
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    proc = subprocess.run([str(bins / "helm"), *args], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stderr}{proc.stdout}")
    return proc


def set_args(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def render(bins: Path, values: dict[str, str] | None = None, *, api_versions: tuple[str, ...] = (),
           namespace: str = "rljob-system", release: str = "rljob") -> list[Manifest]:
    """`helm template` with `--set` values; the manifests as dicts, empty documents dropped."""
    extra = [arg for api in api_versions for arg in ("--api-versions", api)]
    out = helm(bins, "template", release, str(CHART), "--namespace", namespace,
               "--kube-version", KUBE_VERSION, *extra, *set_args(values or {})).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def one(manifests: list[Manifest], kind: str) -> Manifest:
    found = by_kind(manifests, kind)
    assert len(found) == 1, f"expected one {kind}, got {[m['metadata']['name'] for m in found]}"
    return found[0]
