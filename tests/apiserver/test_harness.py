"""The test control plane itself: binaries, fake GPU nodes, KubeRay, teardown."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.controlplane import GPU, REPO, ControlPlane
from tests.polling import wait_for

pytestmark = pytest.mark.controlplane

NAMES = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "kuberay-operator",
    "helm",
]


def test_k8s_bins_prints_a_complete_cached_directory(k8s_bins: Path) -> None:
    started = time.monotonic()
    out = subprocess.run(
        [str(REPO / "hack" / "k8s-bins")], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert time.monotonic() - started < 10, "a cached call must take seconds"
    assert Path(out) == k8s_bins and Path(out).is_absolute()
    for name in NAMES:
        assert os.access(Path(out) / name, os.X_OK), name
    assert (Path(out) / "kuberay-crds" / "ray.io_rayclusters.yaml").is_file()


def test_k8s_bins_rejects_an_incomplete_override(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(REPO / "hack" / "k8s-bins")],
        capture_output=True,
        text=True,
        env={**os.environ, "RLJOB_K8S_BIN": str(tmp_path)},
    )
    assert proc.returncode != 0
    assert "RLJOB_K8S_BIN" in proc.stderr and "kube-apiserver" in proc.stderr


def test_teardown_kills_everything_after_a_failure(k8s_bins: Path) -> None:
    cp = ControlPlane(k8s_bins)
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="boom"):
        try:
            cp.start_core()
            pids = [p.popen.pid for p in cp.processes.values()]
            raise RuntimeError("boom")
        finally:
            cp.stop()
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not cp.root.exists()


def test_fake_nodes_advertise_gpus(cluster: ControlPlane) -> None:
    nodes = [
        n
        for n in cluster.get_json("nodes")["items"]
        if n["metadata"]["annotations"].get("kwok.x-k8s.io/node") == "fake"
    ]
    assert len(nodes) >= 2
    assert all(n["status"]["allocatable"][GPU] == "8" for n in nodes)


def test_kuberay_places_gpu_workers_on_fake_nodes(cluster: ControlPlane, namespace: str) -> None:
    worker_container = {
        "name": "ray-worker",
        "image": "rayproject/ray:2.46.0",
        "resources": {"limits": {GPU: "4", "cpu": "1", "memory": "1Gi"}},
    }
    cluster.apply(
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayCluster",
            "metadata": {"name": "probe", "namespace": namespace},
            "spec": {
                "headGroupSpec": {
                    "rayStartParams": {},
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "ray-head",
                                    "image": "rayproject/ray:2.46.0",
                                    "resources": {"limits": {"cpu": "1", "memory": "1Gi"}},
                                }
                            ]
                        }
                    },
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "gpu",
                        "replicas": 2,
                        "minReplicas": 2,
                        "maxReplicas": 2,
                        "rayStartParams": {},
                        "template": {"spec": {"containers": [worker_container]}},
                    }
                ],
            },
        }
    )

    def running_workers() -> list[str] | None:
        """Nodes of the two GPU workers once both run, else None."""
        pods = cluster.get_json("pods", "-n", namespace, "-l", "ray.io/group=gpu")["items"]
        nodes = [p["spec"]["nodeName"] for p in pods if p["status"].get("phase") == "Running"]
        return nodes if len(nodes) == 2 else None

    nodes = wait_for(
        running_workers,
        timeout=90,
        what="2 GPU worker pods Running on kwok nodes",
    )
    assert all(n.startswith("gpu-node-") for n in nodes)
