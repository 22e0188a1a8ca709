"""The driver as a node of the job's Ray cluster: `rljob run --join HOST:PORT`.

Why the driver needs a node of its own: a Ray driver works through the raylet of the host it
runs on (its object store, the leases for what it submits). A pod that runs no raylet and
calls `ray.init(address="<head>:6379")` aborts with "Failed to connect to socket at address:
.../sockets/raylet". The other ways in are worse for a training job that runs for days:
Ray Client (`ray://`) is discouraged for long ML jobs (the driver's state lives behind one
proxied connection; when it drops, the job is lost, and every object crosses that stream),
and Ray Jobs needs the dashboard plus a submitter that only relays logs, while our operator
already owns the driver's lifecycle (restarts, backoff, recovery bookkeeping).

So the driver pod starts a raylet that joins the head, with nothing the scheduler could
hand work to (no CPUs, no GPUs), only the custom resource `rljob_driver` that the actors the
driver deliberately keeps next to itself ask for, and the driver connects to it with
`ray.init(address="auto")`. The node runs in a private temp dir and a process group of its
own: connecting finds exactly this node, and stopping it at exit ends exactly its processes,
even on a machine that runs other Ray nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob_api import env
from rljob_api.layout import DRIVER_RESOURCE

START_TIMEOUT_S = 300.0  # the head may still be starting when a new driver comes up
RESOLVE_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0
LOG_TAIL_CHARS = 4000


class JoinError(RuntimeError):
    """The node could not join: the message says why (with `ray start`'s output)."""


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` of a Ray head's GCS; ValueError naming the problem otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--join must look like HOST:PORT (the Ray head's GCS), got {text!r}")
    return host, int(port)


def node_ip(environ: dict[str, str] | None = None) -> str | None:
    """The address this node announces: the pod IP (downward API) in a pod; otherwise None,
    and Ray picks the interface that reaches the head."""
    value = (environ if environ is not None else dict(os.environ)).get(env.POD_IP, "")
    return value or None


def ray_start_command(address: str, temp_dir: Path, ip: str | None) -> list[str]:
    """`ray start` for a node that takes no work but what asks for `rljob_driver`.

    Non-blocking: it returns once the node's processes run. The dashboard agent's HTTP port
    is left to the OS (nothing probes the driver's node, and a fixed port would clash with
    another node on the same host).
    """
    cmd = [
        sys.executable, "-m", "ray.scripts.scripts", "start",
        f"--address={address}",
        "--num-cpus=0",
        "--num-gpus=0",
        f"--resources={json.dumps({DRIVER_RESOURCE: 1})}",
        f"--temp-dir={temp_dir}",
        "--dashboard-agent-listen-port=0",
        "--disable-usage-stats",
    ]
    if ip:
        cmd.append(f"--node-ip-address={ip}")
    return cmd


@dataclass
class JoinedNode:
    """A running Ray node of this host; `stop()` ends every process it started."""

    address: str
    temp_dir: Path
    pgid: int
    ip: str | None

    def init_kwargs(self) -> dict[str, Any]:
        """What `ray.init` needs to connect to this node and no other one on the host."""
        kwargs: dict[str, Any] = {"address": "auto", "_temp_dir": str(self.temp_dir)}
        if self.ip:
            kwargs["_node_ip_address"] = self.ip
        return kwargs

    def stop(self) -> None:
        """SIGTERM to the node's process group (the raylet ends its workers), then SIGKILL to
        whatever is left after a grace period; the temp dir goes last."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline and group_alive(self.pgid):
                time.sleep(0.2)
            if group_alive(self.pgid):
                os.killpg(self.pgid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Zombies do not count: in a container the
    driver is PID 1, so the node's processes (orphaned when `ray start` returned) are its
    children and stay zombies until reaped, which is done here too."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    if os.getpid() == 1:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...; comm may hold spaces, so split after ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _resolve(host: str, port: int, timeout_s: float) -> str:
    """The head's IP address, once its name resolves (a Service's DNS record can lag its
    creation).

    Ray is given the address, not the name: Ray's gRPC clients resolve names with c-ares,
    which walks a pod's DNS search list slowly enough (11 s for `<svc>.<ns>.svc` in a kind
    pod, against 5 s for Ray's connection to the GCS) that a worker started on the driver's
    node never connects. The head Service is headless, so the name maps to the head pod; a
    new head pod means a new driver, which resolves again.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            return str(infos[0][4][0])
        except OSError as err:
            if time.monotonic() >= deadline:
                raise JoinError(f"cannot resolve the Ray head {host}: {err}") from None
            time.sleep(1.0)


def join(address: str, timeout_s: float = START_TIMEOUT_S) -> JoinedNode:
    """Start a Ray node on this host that joins the cluster whose GCS is at `address`.

    `ray start` runs in a new session, so every process it starts shares its process group
    (Ray detaches none of them when it is not asked to block), which is what `stop()` ends.
    """
    host, port = parse_address(address)
    head = _resolve(host, port, min(timeout_s, RESOLVE_TIMEOUT_S))
    address = f"[{head}]:{port}" if ":" in head else f"{head}:{port}"
    # Short: Ray puts unix sockets below it, and their paths are limited to 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="rljob-ray-", dir="/tmp"))
    ip = node_ip()
    log = temp_dir / "ray-start.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(ray_start_command(address, temp_dir, ip), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    node = JoinedNode(address, temp_dir, proc.pid, ip)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        node.stop()
        raise JoinError(f"`ray start --address={address}` did not finish in {timeout_s:.0f}s"
                        ) from None
    if code != 0:
        output = redacted(log.read_text(errors="replace"))[-LOG_TAIL_CHARS:]
        node.stop()
        raise JoinError(f"`ray start --address={address}` exited with {code}:\n{output}")
    return node


def redacted(text: str) -> str:
    """`text` without the cluster's Ray token or the job's peer key: `ray start`'s output
    goes into the job's status and events on failure, where neither must ever appear."""
    for name in (env.RAY_AUTH_TOKEN, env.PEER_KEY):
        secret = os.environ.get(name)
        if secret:
            text = text.replace(secret, f"<{name}>")
    return text
