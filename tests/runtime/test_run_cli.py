"""`rljob run` as a user runs it: exit codes, Ctrl-C and SIGTERM, and the other
placements/backends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.checkpoint.store import CheckpointStore
from rljob.cluster.cluster import RunOptions
from rljob.cluster.rollout_pipeline import PENDING_FILE
from rljob.driver.run import run_job
from rljob.reporting import metrics_log, startup
from rljob_api import env
from rljob_api.exits import FAILED as EXIT_FAILED
from rljob_api.exits import INTERRUPTED as EXIT_INTERRUPTED
from rljob_api.exits import INVALID as EXIT_INVALID
from rljob_api.exits import OK as EXIT_OK
from rljob_api.exits import TERMINATED as EXIT_TERMINATED
from tests.controlplane import ControlPlane
from tests.polling import wait_for
from tests.processes import reap
from tests.runtime.conftest import RecordingReporter
from tests.runtime.hooks_for_tests import GATE_ENV
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


def test_a_workdir_that_cannot_be_written_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = job_file(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = subprocess.run([*RLJOB, "run", str(path), "--workdir", str(blocker / "w")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == EXIT_INVALID, out.stderr[-2000:]
    assert f"the workdir {blocker / 'w'} cannot be written" in out.stderr
    assert "Traceback" not in out.stderr


def _start_after_two_steps(path: Path, workdir: Path) -> subprocess.Popen[str]:
    """`rljob run` on this machine, returned once it has trained two rollout steps."""
    proc = subprocess.Popen([*RLJOB, "run", str(path), "--workdir", str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: len(metrics_log.read(workdir / "metrics.jsonl")) >= 2, timeout=180,
                 what="two rollout steps")
    except BaseException:
        reap(proc)
        raise
    return proc


def test_a_storage_failure_under_the_run_stops_it_with_the_reason(tmp_path: Path) -> None:
    """The workdir's storage fails mid-run (here: the metrics file turns into a directory):
    exit 1 with a retryable StorageError naming the file, no traceback, checkpoints intact."""
    path = job_file(tmp_path, {"algorithm": {"totalSteps": 1000},
                               "checkpoint": {"interval": 1}})
    workdir = tmp_path / "w"
    proc = _start_after_two_steps(path, workdir)
    try:
        (workdir / "metrics.jsonl").rename(workdir / "metrics.saved")
        (workdir / "metrics.jsonl").mkdir()
        output, _ = proc.communicate(timeout=120)
    finally:
        reap(proc)
    assert proc.returncode == EXIT_FAILED, output[-3000:]
    assert "failure: StorageError: a file operation in the workdir" in output
    assert str(workdir / "metrics.jsonl") in output and "Traceback" not in output
    assert sorted((workdir / "checkpoints").glob("step_*"))  # what was published stays


def test_ctrl_c_stops_after_saving(tmp_path: Path) -> None:
    path = job_file(tmp_path, {"algorithm": {"totalSteps": 1000},
                               "checkpoint": {"interval": 1000}})
    workdir = tmp_path / "w"
    proc = _start_after_two_steps(path, workdir)
    try:
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
    # Its start-up was timed from the process's start, each phase and actor, up to the first
    # rollout request (benchmarks/startup.py reads the same line).
    (line,) = [ln for ln in output.splitlines() if startup.PREFIX in ln]
    at = {m.name: m.at_s for m in startup.parse(line)}
    actors = ["trainer-0", "engine-0", "rollout-worker", "weight-sync-store",
              "weight-sync-sidecar-0"]
    assert set(at) == {"imports", "ray started", "model files", "placement group ready",
                       "first weights", startup.FIRST_ROLLOUT,
                       *(f"{a} ready" for a in actors)}, at
    # What must come before what: Ray before the placement group before every actor, every
    # actor before the first weights, those before the first request.
    assert 0 < at["imports"] < at["ray started"] < at["placement group ready"], at
    assert max(at[f"{a} ready"] for a in actors) <= at["first weights"], at
    # The store, served by the driver on one machine, opens right after the placement group
    # (within the line's hundredths of a second); every actor process comes later.
    assert at["placement group ready"] <= at["weight-sync-store ready"], at
    assert at["placement group ready"] < min(at[f"{a} ready"] for a in actors
                                             if a != "weight-sync-store"), at
    assert at["first weights"] <= at[startup.FIRST_ROLLOUT], at


class Driver:
    """`rljob run` as the driver pod runs it: job identity and attempt in the environment,
    status reported to the test control plane; its output goes to a file the test reads."""

    def __init__(self, cp: ControlPlane, namespace: str, job: Path, workdir: Path,
                 log: Path) -> None:
        self.cp, self.namespace, self.job, self.workdir, self.log = (
            cp, namespace, job, workdir, log)
        self.name = str(yaml.safe_load(job.read_text())["metadata"]["name"])
        cp.kubectl("apply", "-n", namespace, "-f", str(job))

    def start(self, attempt: int, *args: str, **extra: str) -> subprocess.Popen[bytes]:
        environ = {**os.environ, env.JOB_NAME: self.name, env.JOB_NAMESPACE: self.namespace,
                   env.RESTARTS: str(attempt), "KUBECONFIG": str(self.cp.kubeconfig), **extra}
        with self.log.open("ab") as out:
            return subprocess.Popen(
                [*RLJOB, "run", str(self.job), "--workdir", str(self.workdir), *args],
                env=environ, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def steps(self) -> int:
        return len(metrics_log.read(self.workdir / metrics_log.METRICS_FILE))

    def status(self) -> dict[str, Any]:
        obj = self.cp.get_json("rljob", self.name, "-n", self.namespace)
        return dict(obj.get("status") or {})


@pytest.mark.controlplane
def test_a_driver_whose_store_was_taken_over_stops_and_reports_nothing_more(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """The partition case through a real driver: it is frozen (SIGSTOP: alive, silent, as on
    a node cut off from the cluster), its lease expires, a new writer takes the checkpoint
    store; thawed, the old driver finds out at the end of its step and exits 1 without
    writing another metrics line, status report or failure."""
    job = job_file(tmp_path, {"algorithm": {"totalSteps": 1000},
                              "checkpoint": {"interval": 1000}})
    workdir = tmp_path / "w"
    driver = Driver(control_plane, namespace, job, workdir, tmp_path / "driver.log")
    old = driver.start(0)
    try:
        wait_for(lambda: driver.steps() >= 2, timeout=300, what="two steps trained",
                 describe=lambda: driver.output()[-3000:])
        os.kill(old.pid, signal.SIGSTOP)
        waits: list[str] = []
        new = CheckpointStore(workdir / "checkpoints", keep_last=2, writer="new-driver",
                              lease_wait_s=120)
        new.acquire(on_wait=waits.append)  # once the frozen driver's lease expired
        assert waits and "waiting" in waits[0], waits
        steps = driver.steps()
        os.kill(old.pid, signal.SIGCONT)
        assert old.wait(timeout=300) == EXIT_FAILED, driver.output()[-3000:]
    finally:
        reap(old)
    assert "CheckpointStoreLost" in driver.output() and "lost the checkpoint store" in \
        driver.output()
    assert driver.steps() == steps  # not one metrics line more
    status = driver.status()
    # What it had reported before it was frozen may still land; nothing of a later step.
    assert status["progress"]["rolloutStep"] <= steps, (status["progress"], steps)
    assert "runtimeFailure" not in status and "stopped" not in status
    new.release()


@pytest.mark.controlplane
def test_sigterm_stops_after_saving_and_the_next_run_resumes_there(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """What a pod deletion (suspend, preemption) does to the driver: SIGTERM mid-run. The
    step in progress finishes and is saved, the exit code says SIGTERM, the status says it
    stopped (not failed), and the next attempt resumes from exactly that checkpoint. Run in
    async mode, where a batch is always generating ahead: the stop does not wait for it and
    the checkpoint keeps none of it (sync mode has no such batch; the kind story suspends a
    sync job)."""
    job = job_file(tmp_path, {"algorithm": {"totalSteps": 1000},
                              "checkpoint": {"interval": 1000}, "rollout": {"mode": "async"}})
    driver = Driver(control_plane, namespace, job, tmp_path / "w", tmp_path / "driver.log")
    first = driver.start(0)
    try:
        wait_for(lambda: driver.steps() >= 2, timeout=300, what="two rollout steps",
                 describe=lambda: driver.output()[-3000:])
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=300) == EXIT_TERMINATED, driver.output()[-3000:]
    finally:
        reap(first)
    steps = driver.steps()
    saved = sorted((driver.workdir / "checkpoints").glob("step_*"))
    assert [p.name for p in saved] == [f"step_{steps:08d}"]  # interval 1000: the stop saved it
    assert "stopped by SIGTERM; state saved" in driver.output()
    status = driver.status()
    assert "runtimeFailure" not in status
    stopped = status["stopped"]
    assert (stopped["signal"], stopped["attempt"], stopped["step"], stopped["checkpointStep"],
            stopped["aborted"], stopped["exitCode"]) == ("SIGTERM", 0, steps, steps, False, 143)

    second = driver.start(1, "--max-steps", "1")
    try:
        assert second.wait(timeout=600) == EXIT_OK, driver.output()[-3000:]
    finally:
        reap(second)
    assert f"resumed from {saved[0]} (step {steps}, " in driver.output()
    rows = metrics_log.read(driver.workdir / metrics_log.METRICS_FILE)
    assert [r["step"] for r in rows] == list(range(1, steps + 2))
    status = driver.status()
    resumed = status["resumed"]
    assert (resumed["attempt"], resumed["found"], resumed["step"], resumed["path"]) == (
        1, True, steps, str(saved[0]))
    assert "stopped" not in status  # how attempt 0 ended is not carried into attempt 1
    # In async mode the stop cancelled the batch generating ahead instead of waiting for it:
    # the checkpoint keeps no batch, and its data cursor is the one from before that batch
    # (8 prompts a step of the 55-prompt task), so the resumed run generates it again.
    assert not (saved[0] / PENDING_FILE).exists()
    cursor = json.loads((saved[0] / "rollout_state.json").read_text())
    consumed = steps * 8
    assert (cursor["epoch"], cursor["index"], cursor["buffer"]) == (consumed // 55,
                                                                    consumed % 55, [])
    assert rows[-1]["staleness_max"] == 0  # generated after the resume, by current weights


@pytest.mark.controlplane
def test_a_second_sigterm_aborts_the_step_at_once(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """The first SIGTERM waits for a step that cannot finish (its rewards are held back); a
    second one ends the run at once without saving, and the status says it aborted."""
    job = job_file(tmp_path, {"algorithm": {"totalSteps": 1000},
                              "checkpoint": {"interval": 1000},
                              "reward": {"function": "tests.runtime.hooks_for_tests:gated_reward"}})
    gate = tmp_path / "gate"
    driver = Driver(control_plane, namespace, job, tmp_path / "w", tmp_path / "driver.log")
    proc = driver.start(0, **{GATE_ENV: str(gate)})
    try:
        wait_for(lambda: driver.steps() >= 1, timeout=300, what="a first rollout step",
                 describe=lambda: driver.output()[-3000:])
        gate.touch()
        wait_for(lambda: (tmp_path / "gate.BLOCKED").exists(), timeout=120,
                 what="a step held in its rewards")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "finishing this step" in driver.output(), timeout=60,
                 what="the first SIGTERM to be taken", describe=lambda: driver.output()[-2000:])
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == EXIT_TERMINATED, driver.output()[-3000:]
        took = time.monotonic() - start
    finally:
        gate.unlink(missing_ok=True)
        reap(proc)
    assert took < 60, f"the abort took {took:.0f}s"
    assert "stopped by SIGTERM at once" in driver.output()
    assert not list((driver.workdir / "checkpoints").glob("step_*"))  # nothing was saved
    stopped = driver.status()["stopped"]
    assert (stopped["signal"], stopped["aborted"], stopped["exitCode"]) == ("SIGTERM", True, 143)
    assert "checkpointStep" not in stopped  # no checkpoint to resume from


def test_colocated_ppo_with_disk_weight_sync(
    ray_local: None, tmp_path: Path, reporter: RecordingReporter
) -> None:
    spec = job_spec(tmp_path, {
        "placement": "colocated",
        "trainer": {"gpusPerReplica": 1},
        "rollout": {"engines": 1},
        "algorithm": {"estimator": "ppo", "totalSteps": 2, "klMode": "reward", "klCoef": 0.1},
        "weightSync": {"mode": "disk"},
        "checkpoint": {"format": "hf"},
        "eval": {"dataset": "builtin:arithmetic", "interval": 2},
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
