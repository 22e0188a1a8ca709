"""kind end-to-end fixtures: real containers on a kind cluster built by `hack/kind-up`.

The session builds (or reuses, when cached) the cluster, our images, KubeRay and our chart
with the same script a developer runs, and removes the cluster with `hack/kind-down` at the
end. Where the machine cannot run it at all (no root, no Go, no way to get podman) the suite
skips and says exactly why; a kind-up that fails is a failure, with its log attached.
RLJOB_E2E_KEEP=1 keeps the cluster (one that existed before the session is always kept);
RLJOB_E2E_CLUSTER=NAME picks the cluster (default rljob-e2e); RLJOB_E2E_ARTIFACTS=DIR collects
describe/logs of failed tests there.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.kind.kindcluster import (
    CLUSTER_NAME,
    KIND_DOWN,
    KIND_UP,
    WORKERS,
    KindCluster,
    cluster_exists,
    missing_prerequisites,
)
from tests.controlplane import k8s_bin_dir

KIND_UP_TIMEOUT_S = 3600  # cold: Go builds, debootstrap, torch images, cluster creation


@pytest.fixture(scope="session")
def kind_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KindCluster]:
    missing = missing_prerequisites()
    if missing:
        pytest.skip("e2e/kind skipped: " + "; ".join(missing))
    artifacts = Path(os.environ.get("RLJOB_E2E_ARTIFACTS") or tmp_path_factory.mktemp("kind"))
    artifacts.mkdir(parents=True, exist_ok=True)
    existed = cluster_exists(CLUSTER_NAME)
    log = artifacts / "kind-up.log"
    with log.open("w") as out:
        proc = subprocess.run([str(KIND_UP), "--name", CLUSTER_NAME, "--workers", str(WORKERS)],
                              stdout=subprocess.PIPE, stderr=out, text=True,
                              timeout=KIND_UP_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-60:])
        pytest.fail(f"hack/kind-up failed ({proc.returncode}); log {log}:\n{tail}",
                    pytrace=False)
    kubeconfig = Path(proc.stdout.strip().splitlines()[-1])
    cluster = KindCluster(CLUSTER_NAME, kubeconfig, k8s_bin_dir(), artifacts)
    try:
        yield cluster
    finally:
        if not existed and not os.environ.get("RLJOB_E2E_KEEP"):
            subprocess.run([str(KIND_DOWN), "--name", CLUSTER_NAME], check=False,
                           capture_output=True, timeout=600)


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
        print(f"\nkubectl describe/logs/events of the failed run: {where}")
