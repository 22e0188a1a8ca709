"""The only engine lost: generation pauses, and the RLJob says why, until the replacement
serves the current weights; then the job goes on with no step lost or redone. A real
`rljob run` with one engine (as the README's job), in async mode, reports to a real API
server; the test kills the engine's process and reads what the runtime reported there and
in its own step log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from rljob.cluster.engine_recovery import PAUSED
from rljob.driver.job import WEIGHT_SYNC_LOG
from rljob.reporting import metrics_log
from tests.controlplane import REPO, ControlPlane
from tests.polling import wait_for
from tests.processes import reap
from tests.runtime.jobs import job_file

pytestmark = [pytest.mark.runtime, pytest.mark.controlplane]

STEPS = 20


def engine_process(run: subprocess.Popen[bytes]) -> psutil.Process | None:
    """The engine's Ray actor process among the run's descendants (Ray titles an actor's
    process after its class)."""
    for child in psutil.Process(run.pid).children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith("ray::EngineProcess"):
                return child
        except psutil.Error:
            continue
    return None


def test_the_only_engine_lost_pauses_generation_with_its_reason_and_costs_no_step(
        cluster: ControlPlane, namespace: str, tmp_path: Path) -> None:
    # Async: while the driver waits for a batch the trainer holds a newer version than the
    # engines', so a replacement cannot be sent the engines' version as in sync mode (the
    # sync path runs in test_engine_loss.py and the kind story).
    path = job_file(tmp_path, {"algorithm": {"totalSteps": STEPS},
                               "checkpoint": {"interval": STEPS},
                               "rollout": {"mode": "async", "maxStaleness": 1}})
    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["name"] = "paused"
    path.write_text(yaml.safe_dump(doc))
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))
    workdir, log = tmp_path / "w", tmp_path / "runtime.log"
    with log.open("ab") as out:
        # No operator: the runtime, told which RLJob it runs, reports to it like a driver pod.
        proc = subprocess.Popen(
            [sys.executable, "-m", "rljob.cli", "run", str(path), "--workdir", str(workdir)],
            env={**os.environ, "RLJOB_NAME": "paused", "RLJOB_NAMESPACE": namespace,
                 "RLJOB_RESTARTS": "0", "KUBECONFIG": str(cluster.kubeconfig),
                 "PYTHONPATH": str(REPO)},
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def said() -> str:
        return log.read_text(errors="replace")

    def engines() -> dict[str, Any]:
        status = cluster.get_json("rljob", "paused", "-n", namespace).get("status") or {}
        found: dict[str, Any] = status.get("engines") or {}
        return found

    try:
        rows = workdir / metrics_log.METRICS_FILE
        wait_for(lambda: len(metrics_log.read(rows)) >= 2, timeout=300,
                 what="two steps trained", describe=lambda: said()[-3000:])
        engine = wait_for(lambda: engine_process(proc), timeout=30,
                          what="the engine's actor process")
        os.kill(engine.pid, signal.SIGKILL)
        paused = wait_for(lambda: engines() if engines().get("ready") == 0 else None,
                          timeout=120, interval=0.3, what="the runtime to report no engine",
                          describe=lambda: said()[-3000:])
        assert paused["total"] == 1 and paused["summary"] == "0/1", paused
        assert paused["paused"] == PAUSED, paused
        (lost,) = paused["engines"]
        assert lost["state"] in {"Lost", "Rejoining"} and lost["reason"], lost
        proc.wait(timeout=420)
    finally:
        reap(proc)
    assert proc.returncode == 0, said()[-4000:]
    # Generation went on once the replacement served: the status says so, nothing paused.
    back = engines()
    assert (back["ready"], back["restarts"], back.get("paused")) == (1, 1, None), back
    assert back["engines"][0]["state"] == "Serving", back
    steps = [int(r["step"]) for r in metrics_log.read(rows)]
    assert steps == list(range(1, STEPS + 1)) and "resumed from" not in said(), steps
    assert "engines: engine-0 lost" in said() and "engines: engine-0 rejoined" in said()
    assert f"engines: {PAUSED}" in said()
    # Nothing generated meanwhile: the replacement got the trainer's version at once, and no
    # sample lagged the trainer by more than the bound.
    (version,) = re.findall(r"delivering the trainer's weight version (\d+)", said())
    assert f"engines: engine-0 rejoined, serving weight version {version}" in said()
    syncs = [json.loads(line) for line in (workdir / WEIGHT_SYNC_LOG).read_text().splitlines()]
    (delivery,) = [s for s in syncs if s["version"] == int(version)]
    assert delivery["acked"] == ["engine-0"] and not delivery["stale"], delivery
    rows_ = metrics_log.read(rows)
    assert all(float(r["staleness_max"]) <= 1 for r in rows_), rows_
