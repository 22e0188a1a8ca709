"""The RLJob CRD on a real kube-apiserver: admission, defaults, status, columns, immutability."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.reporting.reporter import StatusReporter
from rljob.reporting.status_sink import ApiSink
from rljob_api.rules import ROOT_RULES
from rljob_api.status import RUNTIME_MANAGER as FIELD_MANAGER
from rljob_api.status import CheckpointStatus, Progress
from rljob_api.validate import manifest_problems
from tests.controlplane import REPO, ControlPlane
from tests.specs import BAD_SPECS, BAD_UPDATES, BadSpec, BadUpdate, base_job

pytestmark = pytest.mark.controlplane

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_crd_is_served_with_short_name(control_plane: ControlPlane) -> None:
    out = control_plane.kubectl("api-resources", "--api-group=rljob.io").stdout
    assert "rljobs" in out and "rlj" in out and "RLJob" in out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted(control_plane: ControlPlane, namespace: str, path: Path) -> None:
    out = control_plane.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path))
    assert "created (server dry run)" in out.stdout


@pytest.mark.parametrize("bad", BAD_SPECS, ids=lambda b: b.id)
def test_bad_specs_are_rejected(control_plane: ControlPlane, namespace: str, bad: BadSpec) -> None:
    doc = bad.apply_to(base_job(f"bad-{bad.id}"))
    proc = control_plane.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False
    )
    assert proc.returncode != 0, f"API server accepted {bad.id}"
    assert bad.field in proc.stderr, proc.stderr
    if bad.message:
        assert bad.message in proc.stderr, proc.stderr


@pytest.mark.parametrize(("name", "rule"), [("a" * 54, 0), ("tiny-1.5", 1), ("1tiny", 1),
                                             ("tiny-", 1)])
def test_names_kuberay_refuses_are_refused_at_admission(
    control_plane: ControlPlane, namespace: str, name: str, rule: int
) -> None:
    """A name the job's RayCluster cannot carry is refused by `kubectl apply` with the message
    `rljob validate` and the operator give, not admitted to fail later."""
    doc = base_job(name)
    proc = control_plane.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False
    )
    assert proc.returncode != 0, f"API server accepted the name {name!r}"
    message = ROOT_RULES[rule].message
    assert message in proc.stderr, proc.stderr
    assert message in [p.message for p in manifest_problems(doc)]


def test_defaults_are_filled_by_the_api_server(control_plane: ControlPlane, namespace: str) -> None:
    control_plane.apply(
        {
            "apiVersion": "rljob.io/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "defaults", "namespace": namespace},
            "spec": {},
        }
    )
    spec = control_plane.get_json("rljob", "defaults", "-n", namespace)["spec"]
    assert spec["algorithm"]["estimator"] == "grpo"
    assert spec["trainer"]["backend"] == "megatron"
    assert spec["weightSync"]["bucketSizeMb"] == 512
    assert spec["recovery"]["retryOn"][0] == "PodFailed"


def _columns(cp: ControlPlane, namespace: str, name: str) -> dict[str, str]:
    lines = cp.kubectl("get", "rljobs", "-n", namespace, name).stdout.splitlines()
    header, row = lines[0].split(), lines[1].split()
    return dict(zip(header, row, strict=True))


def test_status_subresource_and_printer_columns(
    control_plane: ControlPlane, namespace: str, api_client: Any
) -> None:
    cp = control_plane
    cp.apply(base_job("cols"), "-n", namespace)
    cp.kubectl(
        "patch",
        "rljob",
        "cols",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status": {"phase": "Running", "recovery": {"restarts": 2}}}',
    )
    reporter = StatusReporter(ApiSink("cols", namespace, api_client))
    reporter.progress(Progress(rollout_step=7, train_step=14, total_steps=60, mean_reward=0.625))
    reporter.checkpoint(
        CheckpointStatus(
            step=5, path="/checkpoints/cols/step-5", verified=True, saved_at="2026-01-01T00:00:00Z"
        )
    )
    assert reporter.flush(30)  # reports are written by the reporter's own thread
    cols = _columns(cp, namespace, "cols")
    assert cols["PHASE"] == "Running"
    assert cols["STEP"] == "7"
    assert cols["REWARD"] == "0.625"
    assert cols["CHECKPOINT"] == "5"
    assert cols["RESTARTS"] == "2"

    obj = cp.get_json("rljob", "cols", "-n", namespace, "--show-managed-fields")
    managers = {m["manager"] for m in obj["metadata"]["managedFields"]}
    assert FIELD_MANAGER in managers
    # A later progress report keeps the checkpoint the same manager applied earlier.
    reporter.progress(Progress(rollout_step=8, mean_reward=float("nan")))
    assert reporter.flush(30)
    status = cp.get_json("rljob", "cols", "-n", namespace)["status"]
    assert status["checkpoint"]["step"] == 5
    assert status["progress"]["rolloutStep"] == 8
    assert "meanReward" not in status["progress"]
    assert status["progress"]["nonFinite"] == "meanReward"
    assert status["recovery"]["restarts"] == 2  # another manager's field is untouched


def test_status_is_ignored_on_the_main_resource(
    control_plane: ControlPlane, namespace: str
) -> None:
    cp = control_plane
    cp.apply(base_job("mainres"), "-n", namespace)
    cp.kubectl(
        "patch",
        "rljob",
        "mainres",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"status": {"phase": "Succeeded"}}',
    )
    assert (
        "status" not in cp.get_json("rljob", "mainres", "-n", namespace)
        or cp.get_json("rljob", "mainres", "-n", namespace)["status"].get("phase") is None
    )


@pytest.mark.parametrize("bad", BAD_UPDATES, ids=lambda b: b.id)
def test_immutable_fields_are_refused_on_update(
    control_plane: ControlPlane, namespace: str, bad: BadUpdate
) -> None:
    """The same table as the validator's (tests/unit/test_update_rules.py): one per immutable
    field, and the API server gives exactly the rule's message."""
    cp = control_plane
    created, edited = bad.docs()
    cp.apply(created, "-n", namespace)
    proc = cp.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(edited), check=False
    )
    assert proc.returncode != 0, f"immutable change {bad.id} accepted"
    assert bad.message in proc.stderr, proc.stderr


def test_mutable_fields_can_change(control_plane: ControlPlane, namespace: str) -> None:
    cp = control_plane
    job = base_job("mutable")
    cp.apply(job, "-n", namespace)
    changed = copy.deepcopy(job)
    changed["spec"]["algorithm"]["lr"] = 1e-3
    changed["spec"]["scheduling"] = {"suspend": True}
    cp.apply(changed, "-n", namespace)
    spec = cp.get_json("rljob", "mutable", "-n", namespace)["spec"]
    assert spec["algorithm"]["lr"] == 1e-3 and spec["scheduling"]["suspend"] is True
