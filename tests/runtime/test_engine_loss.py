"""A rollout engine lost mid-run costs no step: `rljob run` with two engines, one of whose
processes the test kills while a step generates. The runtime's own records say what
happened: each step once in metrics.jsonl, the requests sent again, the engine lost and
started again, and the replacement acknowledging the weight versions after it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest

from rljob.driver.job import WEIGHT_SYNC_LOG
from rljob.reporting import metrics_log
from tests.polling import wait_for
from tests.processes import reap
from tests.runtime.hooks_for_tests import ENGINE_LOSS_ENV
from tests.runtime.jobs import job_file

pytestmark = pytest.mark.runtime

RLJOB = [sys.executable, "-m", "rljob.cli"]
STEPS = 30  # a replacement starts in a few seconds; steps here take under one


def _serving(port: int) -> int:
    """The pid of the process listening on `port`: the engine's actor process."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return int(conn.pid)
    raise AssertionError(f"no process listens on port {port}")


def test_a_killed_engine_costs_no_step_and_rejoins_with_the_current_weights(
        tmp_path: Path) -> None:
    path = job_file(tmp_path, {
        "rollout": {"engines": 2},
        "algorithm": {"totalSteps": STEPS},
        "checkpoint": {"interval": STEPS},
        "generate": {"function": "tests.runtime.hooks_for_tests:generate_on_a_lost_engine"},
    })
    workdir, signals = tmp_path / "w", tmp_path / "signals"
    signals.mkdir()
    proc = subprocess.Popen([*RLJOB, "run", str(path), "--workdir", str(workdir)],
                            env={**os.environ, ENGINE_LOSS_ENV: str(signals)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: (signals / "engine").exists(), timeout=300,
                 what="a request of step 3 waiting on engine-1")
        url = (signals / "engine").read_text()
        port = urlparse(url).port
        assert port is not None
        killed = _serving(port)
        os.kill(killed, signal.SIGKILL)
        out, _ = proc.communicate(timeout=420)
    finally:
        reap(proc)
    assert proc.returncode == 0, out[-4000:]
    rows = metrics_log.read(workdir / metrics_log.METRICS_FILE)
    # Every step once, none redone: the run never went back to a checkpoint.
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1)), out[-4000:]
    assert "resumed from" not in out
    # The request that found engine-1 dead (and any in flight on it) went to engine-0.
    reissued = [r.get("reissued_requests", 0) for r in rows]
    assert sum(reissued[2:]) >= 1 and not any(reissued[:2]), reissued
    assert "engines: engine-1 lost" in out, out[-4000:]
    assert "engines: engine-1 rejoined, serving weight version" in out, out[-4000:]
    lost_at = out.index("engines: engine-1 lost")
    assert out.index("engines: engine-1 rejoined") > lost_at
    # The replacement is a new process, and the last version went to both engines, each
    # sidecar acknowledging it after checking its digest.
    syncs = [json.loads(line) for line in (workdir / WEIGHT_SYNC_LOG).read_text().splitlines()]
    assert syncs[-1]["version"] == int(rows[-1]["weight_version"])
    assert sorted(syncs[-1]["acked"]) == ["engine-0", "engine-1"], syncs[-1]
    assert not syncs[-1]["stale"]
    # metrics.jsonl tells the same: steps trained on one engine, then on both again.
    ready = [int(r["engines_ready"]) for r in rows]
    assert ready[:2] == [2, 2] and 1 in ready and ready[-1] == 2, ready
    assert _serving_nowhere(killed)


def _serving_nowhere(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
