"""`rljob run` as a user runs it: exit codes, Ctrl-C, and the other placements/backends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rljob import metrics_log
from rljob.driver import EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, RunOptions, run_job
from tests.polling import wait_for
from tests.runtime.conftest import RecordingReporter
from tests.runtime.jobs import job_file, job_spec

pytestmark = pytest.mark.runtime

RLJOB = [sys.executable, "-m", "rljob.cli"]


def test_invalid_job_prints_every_problem_and_exits_2(tmp_path: Path) -> None:
    path = job_file(tmp_path, {"algorithm": {"globalBatchSize": 7, "lr": -1}})
    out = subprocess.run([*RLJOB, "run", str(path), "--workdir", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == EXIT_INVALID
    assert "spec.algorithm.lr" in out.stderr and "globalBatchSize" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "w").exists()


def test_ctrl_c_stops_after_saving(tmp_path: Path) -> None:
    path = job_file(tmp_path, {"algorithm": {"totalSteps": 1000},
                               "checkpoint": {"interval": 1000}})
    workdir = tmp_path / "w"
    proc = subprocess.Popen([*RLJOB, "run", str(path), "--workdir", str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: len(metrics_log.read(workdir / "metrics.jsonl")) >= 2, timeout=180,
                 what="two rollout steps")
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == EXIT_INTERRUPTED, output
    steps = len(metrics_log.read(workdir / "metrics.jsonl"))
    saved = sorted((workdir / "checkpoints").glob("step_*"))
    assert [p.name for p in saved] == [f"step_{steps:08d}"]
    assert json.loads((saved[0] / "state.json").read_text())["step"] == steps
    assert "interrupted; state saved" in output


def test_colocated_ppo_with_disk_weight_sync(
    ray_local: None, tmp_path: Path, reporter: RecordingReporter
) -> None:
    spec = job_spec(tmp_path, {
        "placement": "colocated",
        "trainer": {"gpusPerReplica": 1},
        "rollout": {"gpus": 1},
        "algorithm": {"estimator": "ppo", "totalSteps": 2, "klMode": "reward", "klCoef": 0.1},
        "weightSync": {"mode": "disk"},
        "checkpoint": {"format": "hf"},
        "data": {"evalDataset": "builtin:arithmetic", "evalInterval": 2},
        "model": {"tiny": {"architecture": "llama"}},
    })
    workdir = tmp_path / "w"
    assert run_job("job", spec, RunOptions(workdir), reporter) == EXIT_OK
    rows = metrics_log.read(workdir / "metrics.jsonl")
    assert [r["weight_version"] for r in rows] == [1, 2]
    assert rows[0]["value_loss"] > 0 and "eval_reward" in rows[1]
    # versions as verified safetensors directories of this attempt, the newest two kept,
    # installed by the sidecar from disk
    (attempt,) = (workdir / "weights").iterdir()
    assert attempt.name.startswith("attempt-")
    assert sorted(p.name for p in attempt.iterdir()) == ["v00000001", "v00000002"]
    assert (attempt / "v00000002" / "model.safetensors.index.json").exists()
    synced = metrics_log.read(workdir / "weight_sync.jsonl")
    assert [(r["version"], r["acked"]) for r in synced] == [(v, ["engine-0"]) for v in range(3)]
    final = workdir / "checkpoints" / "step_00000002"
    assert (final / "critic.safetensors").exists() and (final / "hf" / "config.json").exists()


def test_reinforce_pp_with_a_custom_reward_hook(
    ray_local: None, tmp_path: Path, reporter: RecordingReporter
) -> None:
    spec = job_spec(tmp_path, {
        "algorithm": {"estimator": "reinforce++", "totalSteps": 2, "entropyCoef": 0.01,
                      "clipEpsHigh": 0.28},
        "reward": {"function": "tests.runtime.hooks_for_tests:length_reward"},
        "data": {"dataset": "builtin:reverse"},
    })
    assert run_job("job", spec, RunOptions(tmp_path / "w"), reporter) == EXIT_OK
    rows = metrics_log.read(tmp_path / "w" / "metrics.jsonl")
    assert len(rows) == 2 and all(0.0 <= r["reward"] <= 1.0 for r in rows)
    assert rows[0]["reward"] > 0  # short answers exist: the custom hook was used
