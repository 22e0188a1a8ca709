"""`rljob.reporting.tracking` without a run: ±Inf and NaN reach every tracker as they are, a resumed
attempt's TensorBoard steps replace the earlier attempt's, and a tracker whose package is
missing is a warning (in `rljob validate` and at start) naming the field and the extra."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.cli import main as cli
from rljob.reporting.tracking import Trackers, missing_packages
from rljob_api.spec import RLJobSpec, TrackingSpec
from tests import trackers
from tests.controlplane import REPO

pytestmark = pytest.mark.unit

ALL = TrackingSpec.model_validate({
    "tensorboard": {"enabled": True}, "wandb": {"enabled": True, "project": "tests"},
    "mlflow": {"enabled": True},
})
ROWS: list[dict[str, Any]] = [
    {"step": 1, "reward": 0.25, "kl": math.nan, "loss": math.inf, "grad_norm": -math.inf,
     "weight_version": 1, "note": "not a number: not tracked"},
    {"step": 2, "reward": 0.5, "kl": 1e-3, "loss": 0.75, "grad_norm": 2.5, "weight_version": 2},
]
WANT: trackers.Series = {
    "reward": {1: 0.25, 2: 0.5}, "kl": {1: math.nan, 2: 1e-3}, "loss": {1: math.inf, 2: 0.75},
    "grad_norm": {1: -math.inf, 2: 2.5}, "weight_version": {1: 1.0, 2: 2.0},
}


def test_non_finite_values_reach_each_tracker_as_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # the tracker sets it; undone after
    started = Trackers.start(ALL, "job", tmp_path, first_step=0, attempt=0, config={"a": 1})
    assert sorted(started.active) == ["mlflow", "tensorboard", "wandb"], started.outcome
    for row in ROWS:
        started.log(row)
    started.close(0)
    assert started.active == {}
    assert trackers.same(trackers.tensorboard(tmp_path / "tensorboard"), WANT, rel=1e-6) == []
    assert trackers.same(trackers.wandb_offline(tmp_path), WANT) == []
    series, run = trackers.mlflow((tmp_path / "mlruns").as_uri(), "job")
    assert trackers.same(series, WANT) == []
    assert run.info.status == "FINISHED"


def test_a_resumed_attempt_replaces_the_tensorboard_steps_after_its_checkpoint(
    tmp_path: Path,
) -> None:
    spec = TrackingSpec.model_validate({"tensorboard": {"enabled": True}})
    first = Trackers.start(spec, "job", tmp_path, first_step=0, attempt=0, config={})
    for step in (1, 2, 3):
        first.log({"step": step, "reward": float(step)})
    first.close(1)
    # The next attempt resumed from the checkpoint of step 1 and redoes steps 2 and 3.
    again = Trackers.start(spec, "job", tmp_path, first_step=1, attempt=1, config={})
    for step in (2, 3):
        again.log({"step": step, "reward": 10.0 * step})
    again.close(0)
    assert trackers.tensorboard(tmp_path / "tensorboard") == {
        "reward": {1: 1.0, 2: 20.0, 3: 30.0}}


def test_a_missing_tracker_package_is_a_warning_with_the_field_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what Python does for a package it lacks
    fix = "spec.tracking.wandb.enabled: the `wandb` package is not installed; " \
        "pip install 'rljob[tracking-wandb]'"
    (warning,) = missing_packages(ALL)
    assert warning.startswith(fix)

    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu-tracking.yaml").read_text())
    assert RLJobSpec.model_validate(doc["spec"]).tracking.wandb.enabled
    assert cli.main(["validate", str(REPO / "examples" / "tiny-cpu-tracking.yaml")]) == 0
    out = capsys.readouterr()
    assert "valid RLJob" in out.out and f"warning: {fix}" in out.err

    spec = TrackingSpec.model_validate({"tensorboard": {"enabled": True},
                                        "wandb": {"enabled": True}})
    started = Trackers.start(spec, "job", tmp_path, first_step=0, attempt=0, config={})
    assert list(started.active) == ["tensorboard"]
    assert started.outcome["wandb"] == "not installed (pip install 'rljob[tracking-wandb]')"
    started.log({"step": 1, "reward": 1.0})
    started.close(0)
    err = capsys.readouterr().err
    assert err.count("spec.tracking.wandb") == 1 and f"rljob run: warning: {fix}" in err


OFFLINE_RUN = """
import atexit, json, socket, sys
from pathlib import Path
looked_up = []
real = socket.getaddrinfo
def recording(host, *args, **kwargs):
    looked_up.append(str(host))
    return real(host, *args, **kwargs)
socket.getaddrinfo = recording
# Registered first, so it runs last: after W&B's own exit hooks.
atexit.register(lambda: print("LOOKED UP " + json.dumps(looked_up)))
from rljob.reporting.tracking import Trackers
from rljob_api.spec import TrackingSpec
spec = TrackingSpec.model_validate({"wandb": {"enabled": True, "project": "tests"}})
started = Trackers.start(spec, "job", Path(sys.argv[1]), first_step=0, attempt=0, config={})
assert list(started.active) == ["wandb"], started.outcome
started.log({"step": 2, "reward": 0.5})
started.close(0)
"""


def test_an_offline_wandb_run_looks_up_no_host(tmp_path: Path) -> None:
    """`mode: offline` works where nothing can be reached: the driver's process resolves no
    host name but its own, up to its exit (W&B's telemetry, left to the process-wide mode,
    posts to W&B's servers from an offline run when the process exits)."""
    import json
    import os
    import socket
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    out = subprocess.run([sys.executable, "-c", OFFLINE_RUN, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("LOOKED UP "))
    local = {"localhost", "127.0.0.1", "::1", "None", socket.gethostname()}
    assert [h for h in json.loads(line.removeprefix("LOOKED UP ")) if h not in local] == []
    assert trackers.same(trackers.wandb_offline(tmp_path), {"reward": {2: 0.5}}) == []


def test_an_online_wandb_run_without_a_key_fails_its_start_and_not_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no key W&B would ask for one on the terminal and hold the run there; the tracker
    fails its start instead, naming what to set, and the other trackers go on."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login either
    spec = TrackingSpec.model_validate({
        "wandb": {"enabled": True, "project": "tests", "mode": "online"},
        "tensorboard": {"enabled": True}})
    started = Trackers.start(spec, "job", tmp_path, first_step=0, attempt=0, config={})
    assert sorted(started.active) == ["tensorboard"]
    assert "WANDB_API_KEY" in started.outcome["wandb"]
    assert "spec.tracking.envSecret" in capsys.readouterr().err
    started.close(0)
