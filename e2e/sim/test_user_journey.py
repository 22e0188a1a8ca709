"""A user's whole journey with one RLJob, on a real control plane with kwok GPU nodes.

Everything the user does or looks at goes through `kubectl`: apply the example job, watch
`kubectl get rljobs`, kill a trainer pod, read `kubectl describe`, delete the job. Two
things play the parts no user plays: the runtime's own `StatusReporter` reports progress
and checkpoints (as the driver does inside its pod), so the columns have something to show,
and a pod-status patch ends the driver (as the kubelet does when the container exits).
Where a restart resumed from is a fact only a real runtime can report (kwok runs no
containers), so this journey asserts the operator's part of a recovery: phase, restarts,
the failure it saw, a new driver. Run with `-s` for the transcript.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.sim.kubectl_view import RLJobsView
from rljob.reporting.reporter import StatusReporter
from rljob.reporting.status_sink import ApiSink
from rljob_api.status import CheckpointStatus, Progress
from rljob_api.status import timestamp as now
from tests.controlplane import REPO, ControlPlane
from tests.operator.jobs import patch_pod_phase
from tests.operator_process import POOL_LABEL, NodePool, Operator
from tests.polling import wait_for

pytestmark = pytest.mark.e2e

EXAMPLE = REPO / "examples" / "qwen-7b-megatron-sglang.yaml"
GPU_PRODUCT = {"nvidia.com/gpu.product": "NVIDIA-H200"}
Row = dict[str, str]


def tiny_gpu_variant(namespace: str) -> dict[str, Any]:
    """The production example, shrunk to 4 GPUs and 20 steps.

    What changes and why: 2 trainer GPUs and 2 one-GPU engines instead of 8 + 8 (two fake
    nodes); no model, data or checkpoint PVCs of the user's (they do not exist here; the
    operator creates the job's checkpoint claim and the harness provisions it); small
    CPU/memory requests (kwok nodes advertise 64 CPUs / 512 GiB); a 3 s
    restart backoff so the test is short yet Recovering lasts long enough to be seen; and
    this test's node pool added to the example's node selector.
    """
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["trainer"].update(gpusPerReplica=2, resources={"requests": {"cpu": "4",
                                                                     "memory": "32Gi"}})
    spec["rollout"].update(engines=2, gpusPerEngine=1)
    for section in ("model", "data", "checkpoint"):
        spec[section].pop("pvc", None)
    spec["algorithm"]["totalSteps"] = 20
    spec["recovery"].update(backoffSeconds=3, maxBackoffSeconds=3)
    spec["scheduling"]["nodeSelector"][POOL_LABEL] = namespace
    return doc


def gpu_nodes_like_production(cp: ControlPlane, pool: NodePool) -> None:
    """What a cluster admin provides: H200 nodes tainted for GPU work, and the PriorityClass
    the example names."""
    for node in pool.add(2, 8, labels=GPU_PRODUCT):
        cp.kubectl("taint", "nodes", node, "nvidia.com/gpu=present:NoSchedule", "--overwrite")
    cp.apply({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
              "metadata": {"name": "training"}, "value": 1000,
              "description": "RL training jobs"})


def run_steps(reporter: StatusReporter, steps: range, total: int,
              checkpoint_every: int) -> None:
    """The runtime's reports for `steps`: progress every step, a verified checkpoint at the
    interval (reward rises, as it does when the policy learns)."""
    for step in steps:
        reporter.progress(Progress(rollout_step=step, train_step=step, total_steps=total,
                                   samples=step * 512, mean_reward=step / 20,
                                   updated_at=now()))
        if step % checkpoint_every == 0:
            reporter.checkpoint(CheckpointStatus(
                step=step, path=f"/checkpoints/qwen-7b-grpo/step-{step}", saved_at=now(),
                verified=True))


def test_apply_watch_kill_recover_succeed_delete(
        cluster: ControlPlane, namespace: str, operator: Operator, node_pool: NodePool,
        api_client: Any, tmp_path: Path) -> None:
    gpu_nodes_like_production(cluster, node_pool)
    job = tiny_gpu_variant(namespace)
    name = job["metadata"]["name"]
    manifest = tmp_path / "rljob.yaml"
    manifest.write_text(yaml.safe_dump(job))
    view = RLJobsView(cluster, namespace)

    def kubectl(*args: str) -> str:
        out: str = cluster.kubectl(*args, "-n", namespace).stdout
        return out

    def until(what: str, ok: Callable[[Row], bool], timeout: float = 90) -> Row:
        def probe() -> Row | None:
            row = view.row(name)
            return row if ok(row) else None

        return wait_for(probe, timeout=timeout, what=f"kubectl get rljobs: {what}",
                        describe=lambda: f"{view.get()}\noperator log:\n{operator.tail(30)}")

    # Create → Running.
    assert kubectl("apply", "-f", str(manifest)).strip() == f"rljob.rljob.io/{name} created"
    until("PHASE Running", lambda r: r["PHASE"] == "Running")
    placed = json.loads(kubectl("get", "pods", "-l", f"rljob.io/job={name}", "-o", "json"))
    assert {p["metadata"]["labels"]["rljob.io/component"] for p in placed["items"]} == {
        "head", "trainer", "rollout", "driver"}
    assert {p["spec"]["nodeName"] for p in placed["items"]} <= set(node_pool.made)

    # The runtime's reports (no runtime runs on kwok nodes: its own reporter stands in, so
    # the view reads as a user's would; nothing below asserts a value written here).
    reporter = StatusReporter(ApiSink(name, namespace, api_client))
    run_steps(reporter, range(1, 13), total=20, checkpoint_every=10)
    assert reporter.flush(30)
    row = until("PHASE Running", lambda r: r["PHASE"] == "Running")
    assert row["RESTARTS"] == "0"

    # A trainer pod dies → Recovering → Running again from the checkpoint.
    trainer = kubectl("get", "pods", "-l", f"rljob.io/job={name},rljob.io/component=trainer",
                      "-o", "name").split()
    assert len(trainer) == 1
    kubectl("delete", trainer[0], "--wait=false")
    until("PHASE Recovering, RESTARTS 1",
          lambda r: (r["PHASE"], r["RESTARTS"]) == ("Recovering", "1"), timeout=30)
    until("PHASE Running, RESTARTS 1",
          lambda r: (r["PHASE"], r["RESTARTS"]) == ("Running", "1"))
    # No runtime of the new attempt reported what it loaded, so no step is claimed.
    resumed = kubectl("get", "rljob", name, "-o", "jsonpath={.status.recovery.resumedFromStep}")
    assert resumed == ""
    new_trainer = kubectl("get", "pods", "-l",
                          f"rljob.io/job={name},rljob.io/component=trainer", "-o", "name")
    assert new_trainer.split() and new_trainer.split() != trainer
    driver = json.loads(kubectl("get", "pod", f"{name}-driver", "-o", "json"))
    assert driver["metadata"]["annotations"]["rljob.io/restarts"] == "1"

    # The resumed runtime trains to the end; the driver exits 0 → Succeeded.
    run_steps(reporter, range(11, 21), total=20, checkpoint_every=10)
    assert reporter.flush(30)
    patch_pod_phase(cluster, namespace, f"{name}-driver", "Succeeded", 0)
    row = until("PHASE Succeeded", lambda r: r["PHASE"] == "Succeeded")
    assert row["RESTARTS"] == "1"

    def left() -> list[str]:
        return kubectl("get", "raycluster,pods", "-l", f"rljob.io/job={name}",
                       "-o", "name").split()

    wait_for(lambda: left() == [f"pod/{name}-driver"], timeout=60,
             what="compute torn down, the driver pod kept for its logs",
             describe=lambda: " ".join(left()))

    described = kubectl("describe", "rljob", name)
    for pattern in (r"Phase:\s+Succeeded", r"Reason:\s+PodDeleted",
                    re.escape(trainer[0].removeprefix("pod/"))):
        assert re.search(pattern, described), f"{pattern!r} not in describe:\n{described}"
    events = [line.split()[1] for line in described.rsplit("Events:", 1)[1].splitlines()[3:]
              if line.strip()]
    assert {"Initializing", "Running", "Recovering", "Resumed", "Succeeded"} <= set(events), \
        described

    # Deleting the job removes every child through owner references.
    rbac = "rbac.authorization.k8s.io"
    support = [f"configmap/{name}-spec", f"serviceaccount/{name}-runtime",
               f"role.{rbac}/{name}-status-writer", f"rolebinding.{rbac}/{name}-status-writer"]
    assert kubectl("get", *support, "-o", "name").split() == support
    assert kubectl("delete", "rljob", name).startswith(f'rljob.rljob.io "{name}" deleted')
    print(view.get() or "(kubectl get rljobs: no resources)\n", flush=True)

    def children() -> list[str]:
        found = kubectl("get", "raycluster,pods,configmaps,serviceaccounts,roles,rolebindings",
                        "-l", f"rljob.io/job={name}", "-o", "name").split()
        return found + kubectl("get", *support, "--ignore-not-found", "-o", "name").split()

    wait_for(lambda: children() == [], timeout=60, what="every child garbage-collected",
             describe=lambda: " ".join(children()))
