"""The runtime's status reports through an API-server outage: reporting never raises nor
blocks the loop, and once the API server is back the status shows the last state reported."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import config

from rljob.report import SETTLE_S, StatusReporter, now
from rljob_api.status import CheckpointStatus, Progress
from tests.controlplane import REPO, ControlPlane
from tests.polling import wait_for
from tests.specs import base_job

pytestmark = pytest.mark.controlplane

OUTAGE_S = 60.0
STEP_S = 0.5  # the pace of the simulated training loop
# A report waits for its write only while the API server answers, and at most SETTLE_S.
REPORT_BOUND_S = SETTLE_S + 0.5


@pytest.fixture(scope="module")
def plane(k8s_bins: Path) -> Iterator[ControlPlane]:
    """A control plane of this module's own: its API server goes away for a minute, which
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


def test_reports_survive_a_minute_without_api_server(plane: ControlPlane) -> None:
    name = "outage"
    plane.apply(base_job(name), "-n", "default")
    client = config.new_client_from_config(config_file=str(plane.kubeconfig))
    reporter = StatusReporter(name, "default", api_client=client)
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
