"""Fixtures of the kwok end-to-end suite: the harness's control plane with the KubeRay
operator and kwok (the `cluster` fixture of tests/conftest.py), the real `rljob-operator`
as a child process per test, and a pool of fake GPU nodes reserved for each test.

The control-plane fixtures are the ones the integration tests use, imported rather than
copied; pytest instantiates them once for this directory.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import api_client, cluster, control_plane, k8s_bins, namespace
from tests.controlplane import ControlPlane
from tests.operator_process import NodePool, operator

__all__ = ["api_client", "cluster", "control_plane", "k8s_bins", "namespace", "node_pool",
           "operator"]


@pytest.fixture
def node_pool(cluster: ControlPlane, namespace: str) -> Iterator[NodePool]:
    """kwok GPU nodes only this test's jobs select; deleted afterwards."""
    pool = NodePool(cluster, namespace)
    try:
        yield pool
    finally:
        pool.remove()
