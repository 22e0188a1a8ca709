"""`rljob run --join`: the driver as a Ray node of a multi-node cluster shaped like the
operator's pods, with Ray token authentication on.

Four Ray nodes on this machine stand in for the pods: a head with no CPUs, a "trainer" node
and a "rollout" node carrying the operator's per-group resources, and the driver's own node
started by `rljob run --join`. Every node runs in a temp dir and process group of its own,
and every process receives the same token, as the operator's Secret gives every Ray
container. The driver's log must show every actor on the node meant for it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rljob.cluster.ray_node import JoinedNode
from rljob.cluster.whereabouts import parse_line
from rljob_api.exits import FAILED as EXIT_FAILED
from rljob_api.exits import OK as EXIT_OK
from rljob_api.layout import group_resource
from tests.controlplane import free_port
from tests.polling import wait_for
from tests.processes import reap
from tests.runtime.jobs import job_file

pytestmark = pytest.mark.runtime
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


@dataclass
class PodLikeCluster:
    address: str
    env: dict[str, str]
    groups: list[tuple[int, Path]]  # (process group, temp dir) of each node

    def stop(self) -> None:
        for pgid, temp in reversed(self.groups):
            JoinedNode(self.address, temp, pgid, None).stop()  # SIGTERM, grace, SIGKILL


def _start(args: list[str], env: dict[str, str]) -> tuple[int, Path]:
    """`ray start ARGS` in a session of its own: the node's processes keep its group."""
    temp = Path(tempfile.mkdtemp(prefix="rljob-t-", dir="/tmp"))
    log = temp / "start.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*RAY, "start", *args, f"--temp-dir={temp}",
                                 "--dashboard-agent-listen-port=0", "--disable-usage-stats"],
                                env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    if proc.wait(timeout=300) != 0:
        raise RuntimeError(f"ray start {args} failed:\n{log.read_text()[-3000:]}")
    return proc.pid, temp


def _cmdlines() -> list[bytes]:
    out = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            out.append(path.read_bytes())
        except OSError:
            continue
    return out


@pytest.fixture
def pod_like_cluster() -> Iterator[PodLikeCluster]:
    token = secrets.token_hex(32)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           "RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port()
    cluster = PodLikeCluster(f"127.0.0.1:{port}", env, [])
    try:
        cluster.groups.append(_start(["--head", f"--port={port}", "--num-cpus=0",
                                      "--include-dashboard=false"], env))
        for group in ("trainer", "rollout"):
            resources = json.dumps({group_resource(group): 1})
            cluster.groups.append(_start([f"--address={cluster.address}", "--num-cpus=1",
                                          f"--resources={resources}"], env))
        yield cluster
    finally:
        cluster.stop()


def test_driver_joins_as_a_node_and_every_actor_runs_where_it_belongs(
        pod_like_cluster: PodLikeCluster, tmp_path: Path) -> None:
    job = job_file(tmp_path, {"algorithm": {"totalSteps": 2}, "checkpoint": {"interval": 2}})
    workdir = tmp_path / "w"
    out = subprocess.run(
        [sys.executable, "-m", "rljob.cli", "run", str(job), "--workdir", str(workdir),
         "--join", pod_like_cluster.address],
        env={**pod_like_cluster.env, "PYTHONPATH": str(Path(__file__).parents[2])},
        capture_output=True, text=True, timeout=600, check=False)
    log = out.stdout + out.stderr
    assert out.returncode == EXIT_OK, log[-6000:]
    (joined,) = [line for line in log.splitlines() if line.startswith("ray: joined ")]
    assert joined.startswith(f"ray: joined {pod_like_cluster.address} as node ")
    node_temp = joined.rsplit("temp dir ", 1)[1].rstrip(")")

    (placement,) = [p for line in log.splitlines() if (p := parse_line(line)) is not None]
    assert placement["ok"] is True, placement
    where = {(a["role"], a["index"]): a for a in placement["actors"]}
    assert {k: a["group"] for k, a in where.items()} == {
        ("trainer", 0): "trainer",
        ("engine", 0): "rollout",
        ("weight-sync-sidecar", 0): "rollout",  # local sidecars sit next to their engine
        ("rollout-worker", 0): "driver",
        ("weight-sync-store", 0): "head",
    }
    assert all(a["expected"] == a["group"] for a in placement["actors"])
    # Five actors on four nodes: the driver's node holds the rollout worker and nothing else.
    assert len({a["node_id"] for a in placement["actors"]}) == 4
    assert "placement (from Ray" in log and (workdir / "checkpoints" / "step_00000002").is_dir()

    # The driver's node left with the driver: no process of its temp dir is left.
    assert not [c for c in _cmdlines() if node_temp.encode() in c]
    assert not Path(node_temp).exists()


def test_a_lost_worker_node_is_named_by_the_failing_driver(
        pod_like_cluster: PodLikeCluster, tmp_path: Path) -> None:
    """The trainer's Ray node dies (every process of it killed, as when its pod's node goes):
    the driver fails retryably and names the node Ray lost, which is what lets the operator
    say NodeLost or PodDeleted rather than a bare driver failure."""
    job = job_file(tmp_path, {"algorithm": {"totalSteps": 500}, "checkpoint": {"interval": 50}})
    log_path = tmp_path / "driver.log"
    with log_path.open("wb") as log_file:
        driver = subprocess.Popen(
            [sys.executable, "-m", "rljob.cli", "run", str(job), "--workdir", str(tmp_path / "w"),
             "--join", pod_like_cluster.address],
            env={**pod_like_cluster.env, "PYTHONPATH": str(Path(__file__).parents[2])},
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: driver.poll() is not None or any(
            parse_line(line) for line in log_path.read_text().splitlines()),
            timeout=300, what="the driver's placement line")
        assert driver.poll() is None, log_path.read_text()[-4000:]
        trainer_group, _ = pod_like_cluster.groups[1]  # the node with the trainer resource
        os.killpg(trainer_group, signal.SIGKILL)
        assert driver.wait(timeout=300) == EXIT_FAILED, log_path.read_text()[-4000:]
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    log = log_path.read_text()
    (failure,) = [line for line in log.splitlines() if line.startswith("failure: ")]
    lost = f"failure: WorkerLost: Ray lost the node of {socket.gethostname()} ("
    assert failure.startswith(lost), log[-4000:]


def test_a_new_driver_stops_a_driver_left_behind_and_resumes_its_work(
        pod_like_cluster: PodLikeCluster, tmp_path: Path) -> None:
    """A driver whose pod Kubernetes force-deleted (its node lost to the API server) may
    still run, reach Ray and hold the trainers and the checkpoint store. The next driver
    stops its Ray node first, then takes the store and resumes from its last checkpoint."""
    job = job_file(tmp_path, {"algorithm": {"totalSteps": 500}, "checkpoint": {"interval": 2}})
    workdir = tmp_path / "w"
    environ = {**pod_like_cluster.env, "PYTHONPATH": str(Path(__file__).parents[2])}

    def start(attempt: int, log: Path, *args: str) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "rljob.cli", "run", str(job), "--workdir", str(workdir),
                 "--join", pod_like_cluster.address, *args],
                env={**environ, "RLJOB_RESTARTS": str(attempt)}, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)

    old_log, new_log = tmp_path / "old.log", tmp_path / "new.log"
    old = start(0, old_log)
    new: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: old.poll() is not None
                 or sorted((workdir / "checkpoints").glob("step_*")),
                 timeout=300, what="the first driver's first checkpoint",
                 describe=lambda: old_log.read_text(errors="replace")[-3000:])
        assert old.poll() is None, old_log.read_text(errors="replace")[-3000:]
        new = start(1, new_log, "--max-steps", "2")
        assert new.wait(timeout=600) == EXIT_OK, new_log.read_text(errors="replace")[-4000:]
        # The driver left behind ended with its Ray node, before the new one took over.
        assert old.wait(timeout=120) != EXIT_OK
    finally:
        reap(old)
        if new is not None:
            reap(new)
    said = new_log.read_text(errors="replace")
    assert "ray: stopped the Ray node of an earlier driver" in said, said[-3000:]
    (resumed,) = [line for line in said.splitlines() if line.startswith("resumed from ")]
    step = int(resumed.split("(step ", 1)[1].split(",", 1)[0])
    assert step >= 2 and step % 2 == 0, resumed  # a checkpoint the old driver had published
    assert (workdir / "checkpoints" / f"step_{step:08d}").is_dir()
