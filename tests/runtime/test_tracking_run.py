"""Trackers in a real run (tiny model, hf engine, local Ray): TensorBoard, W&B offline and
MLflow's file store hold exactly the rows of metrics.jsonl, read back with each tracker's
own reader; trackers that fail at start or while logging warn once and the run finishes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rljob.cluster.cluster import RunOptions
from rljob.driver.run import run_job
from rljob.reporting import metrics_log
from rljob_api.exits import OK as EXIT_OK
from tests import trackers
from tests.runtime.conftest import RecordingReporter
from tests.runtime.jobs import job_spec

pytestmark = pytest.mark.runtime

ALL = {"tensorboard": {"enabled": True}, "wandb": {"enabled": True, "project": "tests"},
       "mlflow": {"enabled": True}}


def test_each_tracker_holds_the_rows_of_metrics_jsonl(
    ray_local: None, tmp_path: Path, reporter: RecordingReporter,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The tracker opts into MLflow's file store itself; the variable is gone after the test.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    spec = job_spec(tmp_path, {
        "algorithm": {"totalSteps": 3},
        "reward": {"function": "tests.runtime.hooks_for_tests:nan_reward_first_step"},
        "tracking": ALL,
    })
    workdir = tmp_path / "w"
    assert run_job("tiny", spec, RunOptions(workdir), reporter) == EXIT_OK

    want = trackers.metrics_jsonl(workdir)
    # Step 1's rewards were NaN (its optimizer steps skipped): reported as NaN, not replaced.
    assert math.isnan(want["reward"][1]) and all(math.isfinite(want["reward"][s]) for s in (2, 3))
    assert {"kl", "loss", "weight_version", "step_seconds"} <= set(want)
    assert all(list(series) == [1, 2, 3] for series in want.values()), want

    # TensorBoard keeps scalars as float32.
    assert trackers.same(trackers.tensorboard(workdir / "tensorboard"), want, rel=1e-6) == []
    assert trackers.same(trackers.wandb_offline(workdir), want) == []
    series, run = trackers.mlflow((workdir / "mlruns").as_uri(), "tiny")
    assert trackers.same(series, want) == []
    assert run.info.status == "FINISHED"
    assert (run.info.run_name, run.data.tags["rljob.attempt"]) == ("tiny-attempt-0", "0")

    out = capsys.readouterr()
    assert "warning" not in out.err, out.err
    summary = out.out[out.out.rindex("done"):]
    assert f"  tensorboard  {workdir / 'tensorboard'}" in summary
    assert "  wandb        offline run " in summary and "  mlflow       run " in summary


def test_trackers_that_fail_warn_once_and_the_run_finishes(
    ray_local: None, tmp_path: Path, reporter: RecordingReporter,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """TensorBoard cannot start (its log dir lies under a file); MLflow starts, then its file
    store breaks under it before the first step is logged."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    mlruns = tmp_path / "mlruns"
    spec = job_spec(tmp_path, {
        "algorithm": {"totalSteps": 2},
        "reward": {"function": "tests.runtime.hooks_for_tests:break_mlflow_store_reward"},
        "tracking": {"tensorboard": {"enabled": True, "logDir": str(blocker / "tb")},
                     "mlflow": {"enabled": True, "trackingUri": mlruns.as_uri()}},
    })
    workdir = tmp_path / "w"
    assert run_job("tiny", spec, RunOptions(workdir), reporter) == EXIT_OK

    assert [r["step"] for r in metrics_log.read(workdir / metrics_log.METRICS_FILE)] == [1, 2]
    assert reporter.failures == [] and reporter.progresses[-1].rollout_step == 2
    err = capsys.readouterr().err
    assert err.count("spec.tracking.tensorboard") == 1, err
    assert "spec.tracking.tensorboard: could not start: " in err
    assert err.count("spec.tracking.mlflow") == 1, err
    assert "spec.tracking.mlflow: could not log step 1: " in err
    assert "training goes on without it (metrics.jsonl has every row)" in err
    assert list(mlruns.glob("*/*/meta.yaml")), "the MLflow run was created before it broke"
