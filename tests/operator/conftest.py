"""Fixtures for operator tests on the real control plane.

Each test gets its own namespace, its own pool of kwok GPU nodes (pinned through
`spec.scheduling.nodeSelector`, so failing or deleting nodes never touches other tests) and
its own operator process, which a test may kill and start again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.controlplane import ControlPlane
from tests.operator_process import NodePool, operator

__all__ = ["gpu_pool", "operator"]


@pytest.fixture
def gpu_pool(cluster: ControlPlane, namespace: str) -> Iterator[Callable[[int, int], list[str]]]:
    """Adds kwok nodes labelled for this test only; removes them afterwards."""
    pool = NodePool(cluster, namespace)
    try:
        yield pool.add
    finally:
        pool.remove()
