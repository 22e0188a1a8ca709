"""Jobs that cannot succeed fail fast on a real control plane: a driver exiting with the
runtime's "invalid job" code is not restarted."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.controlplane import ControlPlane
from tests.operator.harness import job_manifest
from tests.operator.jobs import patch_pod_phase, pods, wait_phase
from tests.operator_process import Operator
from tests.polling import wait_for

pytestmark = pytest.mark.controlplane
Pool = Callable[[int, int], list[str]]


def test_driver_exit_2_fails_the_job_at_once_and_keeps_the_driver(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool) -> None:
    gpu_pool(1, 8)
    cluster.apply(job_manifest("doom", namespace), "-n", namespace)
    wait_phase(cluster, namespace, "doom", "Running")
    patch_pod_phase(cluster, namespace, "doom-driver", "Failed", 2)  # as the kubelet reports

    st = wait_phase(cluster, namespace, "doom", "Failed", timeout=30)
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert failed["reason"] == "InvalidSpec"
    assert "the driver exited with code 2" in failed["message"]
    assert st["recovery"]["restarts"] == 0 and st["recovery"]["lastFailure"]["pod"] == \
        "doom-driver"
    wait_for(lambda: cluster.kubectl("get", "raycluster", "doom", "-n", namespace,
                                     check=False).returncode != 0,
             timeout=30, what="RayCluster removed after the failure")
    # The failed driver is the evidence: kept, never replaced by a new attempt.
    (driver,) = pods(cluster, namespace, "doom", "driver")
    assert driver["metadata"]["annotations"]["rljob.io/restarts"] == "0"
    assert driver["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 2
    reasons = [e["reason"] for e in cluster.get_json(
        "events", "-n", namespace, "--field-selector", "involvedObject.name=doom")["items"]]
    assert "Recovering" not in reasons and "Failed" in reasons
