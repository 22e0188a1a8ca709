"""Fixtures for operator tests on the real control plane.

Each test gets its own namespace, its own pool of kwok GPU nodes (pinned through
`spec.scheduling.nodeSelector`, so failing or deleting nodes never touches other tests) and
its own operator process, which a test may kill and start again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.controlplane import ControlPlane
from tests.operator.harness import POOL_LABEL, Operator, node_ready
from tests.polling import wait_for


@pytest.fixture
def operator(cluster: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[Operator]:
    op = Operator(cluster, namespace, tmp_path / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture
def gpu_pool(cluster: ControlPlane, namespace: str) -> Iterator[Callable[[int, int], list[str]]]:
    """Adds kwok nodes labelled for this test only; removes them afterwards."""
    made: list[str] = []

    def add(count: int, gpus: int) -> list[str]:
        nodes: list[str] = cluster.add_fake_nodes(count, gpus, prefix=f"{namespace}-n{len(made)}",
                                       labels={POOL_LABEL: namespace})
        made.extend(nodes)
        wait_for(lambda: all(node_ready(cluster, n) for n in nodes), timeout=60,
                 what=f"nodes {nodes} Ready")
        return nodes

    try:
        yield add
    finally:
        if made:
            cluster.kubectl("delete", "node", *made, "--wait=false", "--ignore-not-found",
                            check=False)
