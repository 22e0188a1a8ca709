"""kind end-to-end fixtures: real containers on a throwaway kind cluster.

Needs a Docker engine, the `kind` binary and the base images (pulled when absent). Where any
is missing the whole suite skips and says exactly which. KubeRay runs out of cluster from
the pinned hack/k8s-bins binary (no operator image to pull); our operator runs in the
cluster from the chart, with the image built from this checkout. RLJOB_E2E_KEEP=1 keeps
the cluster; RLJOB_E2E_ARTIFACTS=DIR collects describe/logs of failed tests there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.kind.kindcluster import (
    CHART,
    KIND_NODE_IMAGE,
    KindCluster,
    images_to_build,
    missing_prerequisites,
    run,
)
from tests.controlplane import REPO, free_port, k8s_bin_dir
from tests.polling import wait_for


@pytest.fixture(scope="session")
def kind_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KindCluster]:
    missing = missing_prerequisites()
    if missing:
        pytest.skip("e2e/kind skipped, missing: " + "; ".join(missing))
    kind = os.environ.get("KIND") or shutil.which("kind")
    assert kind is not None
    bins = k8s_bin_dir()
    root = tmp_path_factory.mktemp("kind")
    artifacts = Path(os.environ.get("RLJOB_E2E_ARTIFACTS") or root / "artifacts")
    cluster = KindCluster(f"rljob-e2e-{uuid.uuid4().hex[:6]}", root / "kubeconfig", bins,
                          artifacts)
    run(kind, "create", "cluster", "--name", cluster.name, "--image", KIND_NODE_IMAGE,
         "--kubeconfig", str(cluster.kubeconfig), "--wait", "180s")
    try:
        yield cluster
    finally:
        if not os.environ.get("RLJOB_E2E_KEEP"):
            run(kind, "delete", "cluster", "--name", cluster.name, check=False)


@pytest.fixture(scope="session")
def images(kind_cluster: KindCluster) -> dict[str, tuple[Path, dict[str, str]]]:
    """Build the three images from this checkout and load them into the kind nodes."""
    kind = os.environ.get("KIND") or shutil.which("kind")
    assert kind is not None
    wanted = images_to_build()
    for tag, (dockerfile, build_args) in wanted.items():
        args = [a for k, v in build_args.items() for a in ("--build-arg", f"{k}={v}")]
        run("docker", "build", "-f", str(dockerfile), "-t", tag, *args, str(REPO),
             timeout=3600)
        run(kind, "load", "docker-image", tag, "--name", kind_cluster.name, timeout=900)
    return wanted


@pytest.fixture(scope="session")
def kuberay(kind_cluster: KindCluster) -> Iterator[None]:
    """KubeRay's CRDs, and its operator run out of cluster against the kind API server."""
    kind_cluster.kubectl("apply", "--server-side", "-f", str(kind_cluster.bins / "kuberay-crds"))
    log = kind_cluster.artifacts / "kuberay-operator.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(kind_cluster.bins / "kuberay-operator"), f"--kubeconfig={kind_cluster.kubeconfig}",
             "--enable-leader-election=false", f"--metrics-addr=127.0.0.1:{free_port()}",
             f"--health-probe-bind-address=127.0.0.1:{free_port()}"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "ENABLE_WEBHOOKS": "false"})
    try:
        wait_for(lambda: proc.poll() is None and "Starting workers" in log.read_text(
            errors="replace"), timeout=120, what="KubeRay operator to start its workers")
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def rljob_operator(kind_cluster: KindCluster, images: Any, kuberay: None) -> str:
    """Our chart, installed with the operator image built from this checkout."""
    namespace = "rljob-system"
    kind_cluster.helm("install", "rljob", str(CHART), "--namespace", namespace,
                      "--create-namespace", "--wait", "--timeout", "5m")
    return namespace


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the item so fixtures can tell a failed test."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def collect_on_failure(request: pytest.FixtureRequest,
                       kind_cluster: KindCluster) -> Iterator[KindCluster]:
    yield kind_cluster
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        where = kind_cluster.collect(request.node.name)
        print(f"\nkubectl describe/logs of the failed run: {where}")

