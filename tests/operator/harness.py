"""The job manifests the operator tests use."""

from __future__ import annotations

from typing import Any

from tests.operator_process import POOL_LABEL


def job_manifest(name: str, pool: str, **spec: Any) -> dict[str, Any]:
    """A small disaggregated job: 1 trainer pod × 2 GPUs and 2 rollout engines × 1 GPU."""
    body: dict[str, Any] = {
        "trainer": {"backend": "megatron", "replicas": 1, "gpusPerReplica": 2},
        "rollout": {"backend": "sglang", "engines": 2, "gpusPerEngine": 1},
        "recovery": {"maxRestarts": 3, "backoffSeconds": 1, "maxBackoffSeconds": 2},
        "scheduling": {"nodeSelector": {POOL_LABEL: pool}},
        "checkpoint": {"path": "/checkpoints", "interval": 1},
    }
    body.update(spec)
    return {"apiVersion": "rljob.io/v1alpha1", "kind": "RLJob",
            "metadata": {"name": name}, "spec": body}
