"""Fixtures shared by every test tier.

The control plane is session-scoped and started lazily: unit tests never pay for it.
`control_plane` is etcd + kube-apiserver with the RLJob CRD (and its deprecation-warning
admission policy) installed; `cluster` adds kube-scheduler, kube-controller-manager, a volume
provisioner behind a default StorageClass, kwok with fake GPU nodes and the KubeRay operator
to the same API server. Both are torn down at session end, also after failures.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rljob.model.tiny_cache import CACHE_ENV
from rljob_api.deprecations import POLICY_FILE
from tests.controlplane import REPO, ControlPlane, k8s_bin_dir, temporary_namespace

CRD_PATH = REPO / "crds" / "rljob.io_rljobs.yaml"
# The admission policy that warns about deprecated fields, shipped beside the CRD.
POLICY_PATH = REPO / POLICY_FILE
CLUSTER_NODES = 2
GPUS_PER_NODE = 8


@pytest.fixture(scope="session", autouse=True)
def tiny_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """This session's own cache of built tiny models (`rljob.model.tiny_cache`), for every
    job it runs, in this process or a child: which job builds its model and which copies it
    depends on this session alone, not on what earlier runs left in the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("rljob-cache")))
        yield


@pytest.fixture(scope="session")
def k8s_bins() -> Path:
    try:
        return k8s_bin_dir()
    except RuntimeError as err:
        pytest.fail(str(err), pytrace=False)


@pytest.fixture(scope="session")
def control_plane(k8s_bins: Path) -> Iterator[ControlPlane]:
    cp = ControlPlane(k8s_bins)
    try:
        cp.start_core()
        cp.install_crds(CRD_PATH)
        cp.kubectl("apply", "--server-side", "-f", str(POLICY_PATH))
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    """The control plane plus scheduler, controller-manager, volume provisioner, kwok GPU
    nodes and KubeRay."""
    cp = control_plane
    if "kwok" not in cp.processes:
        cp.start_controller_manager()
        cp.start_volume_provisioner()
        cp.start_scheduler()
        cp.start_kwok(nodes=CLUSTER_NODES, gpus_per_node=GPUS_PER_NODE)
        cp.start_kuberay()
    return cp


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    with temporary_namespace(control_plane, f"t-{uuid.uuid4().hex[:8]}") as name:
        yield name


@pytest.fixture
def api_client(control_plane: ControlPlane) -> Iterator[Any]:
    """A `kubernetes` ApiClient for the test control plane (admin token, verified TLS)."""
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    try:
        yield client
    finally:
        client.close()
