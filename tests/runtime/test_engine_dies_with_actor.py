"""An engine server dies with the Ray actor that started it, however the actor dies.

SGLang cannot run here, so the actor starts the `hf` engine as a separate server process
(`python -m rljob.engine.hf_server`, SGLang's HTTP subset) through the code `EngineProcess`
starts SGLang with: `sglang_launcher.start` (spawn tied to the actor, wait for `/health`) and
`sglang_launcher.stop`. Only the command line differs (`build_command` is SGLang's).
The actor is then killed, with `ray.kill` or SIGKILL of its pid, and the server's pid must
disappear and its port become free.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray

from rljob.engine import sglang_launcher
from rljob.engine.die_with_parent import PARENT_GONE
from rljob.model.tiny_model import write_tiny
from rljob_api.spec import TinyModel
from tests.polling import wait_for

pytestmark = [
    pytest.mark.runtime,
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="the parent-death signal and /proc are Linux's"),
]


class ServerActor:
    """Starts and stops a server process the way `EngineProcess` starts and stops SGLang."""

    def __init__(self, argv: list[str], base_url: str) -> None:
        self.proc = sglang_launcher.start(argv, base_url, startup_deadline_s=120)

    def pids(self) -> tuple[int, int]:
        """(this actor's pid, the server's pid)."""
        return os.getpid(), self.proc.pid

    def stop(self) -> None:
        sglang_launcher.stop(self.proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _state(pid: int) -> str | None:
    """The process's state letter from /proc, None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _gone(pid: int) -> bool:
    # A zombie holds no port, memory or GPU: only its exit status, until its new parent
    # (whatever reaps orphans on this machine) collects it.
    return _state(pid) in (None, "Z", "X")


def _port_free(port: int) -> bool:
    """Whether a new server could bind the port (with SO_REUSEADDR, as servers do)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _start(tmp_path: Path) -> tuple[Any, int, int, int]:
    """A ServerActor serving the tiny model; (actor, actor pid, server pid, port)."""
    model = write_tiny(tmp_path / "m", TinyModel(), "0123456789+=", 1, "float32")
    port = _free_port()
    argv = [sys.executable, "-m", "rljob.engine.hf_server", "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(port)]
    actor: Any = ray.remote(ServerActor).options(num_cpus=1).remote(
        argv, f"http://127.0.0.1:{port}")
    try:
        actor_pid, server_pid = ray.get(actor.pids.remote(), timeout=180)
        # The pid watched is the server itself (the wrapper exec'd into it), leading its own
        # session, and a child of the actor.
        assert "rljob.engine.hf_server" in _cmdline(server_pid)
        assert os.getsid(server_pid) == server_pid
        assert _parent(server_pid) == actor_pid
        assert not _port_free(port)
    except BaseException:
        ray.kill(actor)  # the module's Ray is shared: its slot goes back to the next test
        raise
    return actor, actor_pid, server_pid, port


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _killed_server_is_gone(
    tmp_path: Path, kill: Callable[[Any, int], None]
) -> None:
    actor, actor_pid, server_pid, port = _start(tmp_path)
    try:
        kill(actor, actor_pid)
        wait_for(lambda: _gone(actor_pid), timeout=60, what=f"actor process {actor_pid} to die")
        wait_for(lambda: _gone(server_pid), timeout=30,
                 what=f"server {server_pid} to die with its actor",
                 describe=lambda: f"server state {_state(server_pid)!r}")
        wait_for(lambda: _port_free(port), timeout=30, what=f"port {port} to be free")
    finally:
        if not _gone(server_pid):  # the failure above is the report; do not leak the server
            os.killpg(server_pid, signal.SIGKILL)
        ray.kill(actor)  # gone already unless the kill above failed


def test_ray_kill_of_the_actor_kills_its_server(ray_local: None, tmp_path: Path) -> None:
    _killed_server_is_gone(tmp_path, lambda actor, _pid: ray.kill(actor, no_restart=True))


def test_sigkill_of_the_actor_process_kills_its_server(
    ray_local: None, tmp_path: Path
) -> None:
    _killed_server_is_gone(tmp_path, lambda _actor, pid: os.kill(pid, signal.SIGKILL))


def test_a_clean_stop_ends_the_server_and_frees_its_port(
    ray_local: None, tmp_path: Path
) -> None:
    actor, _actor_pid, server_pid, port = _start(tmp_path)
    try:
        ray.get(actor.stop.remote(), timeout=90)
        assert _gone(server_pid)
        wait_for(lambda: _port_free(port), timeout=30, what=f"port {port} to be free")
    finally:
        if not _gone(server_pid):
            os.killpg(server_pid, signal.SIGKILL)
        ray.kill(actor)


def test_stop_reaches_the_processes_the_server_started(tmp_path: Path) -> None:
    """A server's own children (SGLang's scheduler, detokenizer, TP workers) are in its
    process group, so a stop ends them too; here a shell stands in with one child."""
    child_pid_file = tmp_path / "child.pid"
    proc = sglang_launcher.spawn(
        ["sh", "-c", f"sleep 600 & echo $! > {child_pid_file}; wait"])
    try:
        child = wait_for(lambda: child_pid_file.read_text().strip(), timeout=30,
                         what="the server's child to start")
        child_pid = int(child)
        assert os.getpgid(child_pid) == proc.pid
        sglang_launcher.stop(proc, grace_s=30)
        wait_for(lambda: _gone(child_pid), timeout=30, what=f"child {child_pid} to be stopped")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_a_server_whose_parent_is_already_gone_is_not_started() -> None:
    """The wrapper refuses to exec when its parent is not the one named (it died before the
    parent-death signal was armed, so nothing would ever kill the server)."""
    done = subprocess.run(
        [sys.executable, "-m", "rljob.engine.die_with_parent", "1", "--",
         sys.executable, "-c", "print('started')"],
        capture_output=True, timeout=60, check=False)
    assert done.returncode == PARENT_GONE
    assert b"started" not in done.stdout
