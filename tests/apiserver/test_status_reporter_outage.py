"""The runtime's status reports through an API-server outage: reporting never raises nor
blocks the loop, and once the API server is back the status shows the last state reported;
a real `rljob run`, reporting through a status writer as in a driver pod, trains through
the outage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import config

from rljob.reporting import metrics_log
from rljob.reporting.reporter import SETTLE_S, StatusReporter
from rljob.reporting.status_sink import ApiSink
from rljob_api import env
from rljob_api.status import CheckpointStatus, Progress
from rljob_api.status import timestamp as now
from tests.controlplane import REPO, ControlPlane
from tests.polling import wait_for
from tests.processes import reap
from tests.runtime import hooks_for_tests
from tests.runtime.jobs import job_file
from tests.specs import base_job

pytestmark = pytest.mark.controlplane

OUTAGE_S = 30.0  # twice the writer's longest backoff (15 s)
STEP_S = 0.5  # the pace of the simulated training loop
# A report waits for its write only while the API server answers, and at most SETTLE_S.
REPORT_BOUND_S = SETTLE_S + 0.5


@pytest.fixture(scope="module")
def plane(k8s_bins: Path) -> Iterator[ControlPlane]:
    """A control plane of this module's own: its API server goes away for half a minute, which
    must not disturb the components other tests run against the session's."""
    cp = ControlPlane(k8s_bins)
    try:
        cp.start_core()
        cp.install_crds(REPO / "crds" / "rljob.io_rljobs.yaml")
        yield cp
    finally:
        cp.stop()


class Loop:
    """A training loop's reports: progress every step, a checkpoint every 10 steps, each
    call timed."""

    def __init__(self, reporter: StatusReporter) -> None:
        self.reporter = reporter
        self.step = 0
        self.checkpoint = 0
        self.longest = 0.0

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            self.one_step()
            if time.monotonic() >= end:
                return
            time.sleep(STEP_S)  # pacing: the time a step trains, not a wait for anything

    def one_step(self) -> None:
        self.step += 1
        start = time.monotonic()
        self.reporter.progress(Progress(rollout_step=self.step, train_step=2 * self.step,
                                        total_steps=10_000, mean_reward=self.step / 1000,
                                        updated_at=now()))
        if self.step % 10 == 0:
            self.checkpoint = self.step
            self.reporter.checkpoint(CheckpointStatus(
                step=self.step, path=f"/checkpoints/job/step_{self.step:08d}",
                saved_at=now(), verified=True))
        self.longest = max(self.longest, time.monotonic() - start)


def _status(cp: ControlPlane, name: str) -> dict[str, Any]:
    status: dict[str, Any] = cp.get_json("rljob", name, "-n", "default").get("status") or {}
    return status


def test_reports_survive_half_a_minute_without_api_server(plane: ControlPlane) -> None:
    name = "outage"
    plane.apply(base_job(name), "-n", "default")
    client = config.new_client_from_config(config_file=str(plane.kubeconfig))
    reporter = StatusReporter(ApiSink(name, "default", client))
    loop = Loop(reporter)
    try:
        loop.run_for(3)
        before = wait_for(lambda: _status(plane, name).get("progress"), timeout=30,
                          what="the first reports in the status")
        assert before["rolloutStep"] == loop.step

        plane.stop_apiserver()
        loop.run_for(OUTAGE_S)
        assert loop.step > OUTAGE_S / (STEP_S + REPORT_BOUND_S)  # the loop kept its pace
        start = time.monotonic()
        assert reporter.flush(2.0) is False  # nothing can be written now ...
        assert time.monotonic() - start < 3.0  # ... and a flush gives up at its deadline
        during = loop.step

        plane.start_apiserver()
        loop.run_for(3)
        assert reporter.flush(60), f"not written after the outage: {reporter.last_error}"
        status = _status(plane, name)
    finally:
        reporter.close(5)
        client.close()
    assert loop.longest < REPORT_BOUND_S, f"a report blocked the loop for {loop.longest:.1f}s"
    assert loop.step > during
    # The last state reported, not one from before or during the outage.
    assert status["progress"]["rolloutStep"] == loop.step
    assert status["progress"]["trainStep"] == 2 * loop.step
    assert status["checkpoint"]["step"] == loop.checkpoint
    assert status["checkpoint"]["path"] == f"/checkpoints/job/step_{loop.checkpoint:08d}"


def test_a_report_after_the_writer_went_idle_is_written(plane: ControlPlane) -> None:
    """Between reports far apart (a long step) the writer thread ends; the next report must
    start another, or the status would freeze at the last step written."""
    name = "idle-writer"
    plane.apply(base_job(name), "-n", "default")
    client = config.new_client_from_config(config_file=str(plane.kubeconfig))
    reporter = StatusReporter(ApiSink(name, "default", client), idle_s=0.5)
    loop = Loop(reporter)
    try:
        loop.one_step()
        assert reporter.flush(30), reporter.last_error
        wait_for(lambda: not reporter.writing, timeout=30, what="the writer to go idle")
        loop.one_step()
        progress = wait_for(
            lambda: (p := _status(plane, name).get("progress") or {}).get("rolloutStep") == 2
            and p, timeout=30, what="the report after the idle writer in the status")
    finally:
        reporter.close(5)
        client.close()
    assert progress["trainStep"] == 4


@pytest.mark.runtime
def test_a_real_run_reports_through_its_status_writer_and_trains_through_an_outage(
        plane: ControlPlane, tmp_path: Path) -> None:
    """`rljob run` as the driver pod runs it: the runtime holds no API credential and reports
    through a status writer process (`python -m rljob.reporting.status_writer`), which alone
    holds one; a reward hook that tries to reach the API server finds nothing to do it with.
    The API server then goes away for half a minute: training goes on (metrics lines keep coming),
    and once it is back the status catches up with the latest step trained; the stop on
    SIGTERM reaches the status through the writer before the writer exits."""
    job = job_file(tmp_path, {"algorithm": {"totalSteps": 100_000},
                              "checkpoint": {"interval": 5},
                              "reward": {"function": "tests.runtime.hooks_for_tests:"
                                                     "credential_probe_reward"}},
                   name="outage-run")
    doc = yaml.safe_load(job.read_text())
    doc["metadata"]["name"] = name = "outage-run"
    job.write_text(yaml.safe_dump(doc))
    plane.kubectl("apply", "-n", "default", "-f", str(job))
    workdir, log = tmp_path / "w", tmp_path / "driver.log"
    socket_path, probe = tmp_path / "status.sock", tmp_path / "probe.json"
    identity = {env.JOB_NAME: name, env.JOB_NAMESPACE: "default",
                env.STATUS_SOCKET: str(socket_path)}
    bare = {k: v for k, v in os.environ.items()
            if not k.startswith("KUBERNETES_") and k != "KUBECONFIG"}
    # The driver container's view: no kubeconfig (a path with nothing there, so no default
    # one is read either), no in-cluster token; the writer gets the credential.
    driver_env = {**bare, **identity, env.RESTARTS: "0", "KUBECONFIG": str(tmp_path / "none"),
                  hooks_for_tests.PROBE_FILE: str(probe)}
    writer_env = {**bare, **identity, "KUBECONFIG": str(plane.kubeconfig)}

    def trained() -> int:
        return len(metrics_log.read(workdir / metrics_log.METRICS_FILE))

    def output() -> str:
        return log.read_text(errors="replace")[-3000:]

    with log.open("ab") as out:
        writer = subprocess.Popen([sys.executable, "-m", "rljob.reporting.status_writer"],
                                  env=writer_env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "rljob.cli", "run", str(job), "--workdir", str(workdir)],
            env=driver_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (_status(plane, name).get("progress") or {}).get("rolloutStep"),
                 timeout=300, what="the run's first progress in the status", describe=output)
        # The hook's attempts failed: no token file, no in-cluster config, no kubeconfig.
        found = json.loads(probe.read_text())
        assert found == {"token_file": "FileNotFoundError", "incluster": "ConfigException",
                         "kubeconfig": "ConfigException"}, found
        plane.stop_apiserver()
        before = trained()
        outage_end = time.monotonic() + OUTAGE_S
        wait_for(lambda: time.monotonic() >= outage_end or proc.poll() is not None,
                 timeout=OUTAGE_S + 30, what="the outage", interval=1.0)
        assert proc.poll() is None, output()  # still training
        during = trained()
        assert during >= before + 3, (before, during)  # it trained through the outage
        plane.start_apiserver()
        caught_up = wait_for(
            lambda: (p := _status(plane, name).get("progress") or {}).get(
                "rolloutStep", 0) >= during and p,
            timeout=120, what="the status to catch up with the steps trained", describe=output)
        assert caught_up["rolloutStep"] <= trained()
        checkpoint = _status(plane, name)["checkpoint"]
        assert checkpoint["verified"] and checkpoint["step"] >= (during // 5) * 5 - 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, output()
        # The driver flushed its last report into the writer before it exited; the writer,
        # stopped as the kubelet stops a native sidecar, flushes it and exits 0.
        writer.send_signal(signal.SIGTERM)
        assert writer.wait(timeout=60) == 0, output()
    finally:
        reap(proc)
        reap(writer)
    stopped = _status(plane, name)["stopped"]
    assert stopped["signal"] == "SIGTERM" and stopped["step"] == trained()
