"""The tiny CPU job on real containers: Succeeded with a reward, and a killed trainer pod
resumes from its checkpoint."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from e2e.kind.kindcluster import EXAMPLE, KindCluster
from tests.polling import wait_for

pytestmark = pytest.mark.e2e

NAMESPACE = "tiny"
JOB = "tiny-cpu"


def _status(cluster: KindCluster) -> dict[str, Any]:
    doc = json.loads(cluster.kubectl("get", "rljob", JOB, "-n", NAMESPACE, "-o", "json").stdout)
    status: dict[str, Any] = doc.get("status") or {}
    return status


def _describe(cluster: KindCluster) -> str:
    return json.dumps(_status(cluster), indent=1)[-3000:]


def test_tiny_cpu_job_succeeds_and_resumes_after_a_killed_trainer(
        collect_on_failure: KindCluster, rljob_operator: str) -> None:
    cluster = collect_on_failure
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    total, interval = spec["algorithm"]["totalSteps"], spec["checkpoint"]["interval"]
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLE))

    wait_for(lambda: _status(cluster).get("phase") == "Running", timeout=900,
             what="tiny-cpu Running", describe=lambda: _describe(cluster))
    checkpoint = wait_for(
        lambda: (_status(cluster).get("checkpoint") or {}).get("step"), timeout=1800,
        what=f"a verified checkpoint (every {interval} steps)", describe=lambda: _describe(cluster))
    assert _status(cluster)["checkpoint"]["verified"] is True

    cluster.kubectl("delete", "pod", "-n", NAMESPACE, "--wait=false",
                    "-l", f"rljob.io/job={JOB},rljob.io/component=trainer")
    recovery = wait_for(
        lambda: (r := _status(cluster).get("recovery") or {}).get("restarts", 0) >= 1
        and r.get("resumedFromStep") is not None and r,
        timeout=1200, what="a restart that resumes from the checkpoint",
        describe=lambda: _describe(cluster))
    assert recovery["resumedFromStep"] >= checkpoint, recovery
    assert recovery["lastFailure"]["reason"] in {"PodDeleted", "PodFailed"}, recovery

    wait_for(lambda: _status(cluster).get("phase") in {"Succeeded", "Failed"}, timeout=3600,
             what="tiny-cpu to finish", describe=lambda: _describe(cluster))
    status = _status(cluster)
    assert status["phase"] == "Succeeded", _describe(cluster)
    progress = status["progress"]
    assert progress["rolloutStep"] == total
    assert isinstance(progress.get("meanReward"), float | int), progress
    assert "nonFinite" not in progress, progress
    table = cluster.kubectl("get", "rljobs", "-n", NAMESPACE).stdout
    assert "Succeeded" in table and "REWARD" in table, table
