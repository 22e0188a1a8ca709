"""The driver pod's status writer, served on a real Unix socket and spoken to by the
driver's own client (`SocketSink`): what it applies, what it refuses, and that neither a
slow client nor a restart of the writer loses or blocks the driver's reports. The writer's
reporter applies to a sink that keeps what it is given (the API server's side is the
apiserver tier's, tests/apiserver/test_status_reporter_outage.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from rljob.reporting.reporter import StatusReporter
from rljob.reporting.status_sink import SocketSink
from rljob.reporting.status_writer import READ_TIMEOUT_S, serve
from rljob_api import env
from tests.polling import wait_for

PROGRESS = {"rolloutStep": 3, "trainStep": 6, "totalSteps": 10, "samples": 0,
            "weightVersion": 0, "skippedSteps": 0, "policyVersion": 0}
STOP = {"signal": "SIGTERM", "attempt": 0, "step": 3, "aborted": False, "exitCode": 143,
        "time": "2026-01-01T00:00:00Z"}


class KeptSink:
    """Keeps every set of fields applied; `down` makes applies fail (an outage)."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []
        self.down = False

    def write(self, fields: dict[str, Any], timeout_s: float) -> None:
        if self.down:
            raise ConnectionError("the API server does not answer")
        self.applied.append(fields)

    def flush(self, timeout_s: float) -> bool:
        return True


@contextmanager
def writer(path: Path, sink: KeptSink) -> Iterator[None]:
    reporter = StatusReporter(sink, backoff_s=(0.05, 0.2))
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(path, reporter, stop), daemon=True)
    thread.start()
    wait_for(lambda: answers(path), timeout=10, what="the writer's socket")
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
        reporter.close(1)


def answers(path: Path) -> bool:
    """Whether a writer listens at `path`: asked to flush nothing, it answers."""
    try:
        return raw(path, b'{"op": "flush", "timeoutS": 0}')["ok"] is True
    except OSError:
        return False


def raw(path: Path, data: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(path))
        conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)
        answer: dict[str, Any] = json.loads(conn.makefile().readline())
        return answer


@pytest.fixture
def path() -> Iterator[Path]:
    # AF_UNIX paths are short (108 bytes): pytest's tmp_path can be longer.
    folder = Path(f"/tmp/rljob-sw-{os.getpid()}-{time.monotonic_ns()}")
    folder.mkdir()
    yield folder / "s.sock"
    for child in folder.iterdir():
        child.unlink()
    folder.rmdir()


def test_each_delivery_is_the_drivers_whole_set(path: Path) -> None:
    sink = KeptSink()
    with writer(path, sink):
        client = SocketSink(str(path))
        client.write({"progress": PROGRESS, "stopped": STOP}, 5)
        client.write({"progress": {**PROGRESS, "rolloutStep": 4}}, 5)
        assert client.flush(5)
    assert sink.applied[0] == {"progress": PROGRESS, "stopped": STOP}
    # What the driver no longer sends (here `stopped`) is not applied again.
    assert sink.applied[-1] == {"progress": {**PROGRESS, "rolloutStep": 4}}


@pytest.mark.parametrize(("request_", "error"), [
    (b'{"op": "write", "fields": {"phase": "Succeeded"}}', "fields: phase not a runtime"),
    (b'{"op": "write", "fields": {"progress": {"rolloutStep": "x"}}}', "progress.rolloutStep"),
    (b'{"op": "delete"}', "op: 'delete' is not one of write, flush"),
    (b'{"op": "flush", "timeoutS": NaN}', "NaN is not a JSON number"),
    (b'{"op": "flush", "timeoutS": true}', "timeoutS: expected seconds"),
    (b'{"op": "write", "fields": {"progress": {"meanReward": Infinity}}}',
     "Infinity is not a JSON number"),
    (b'{"op": "write", "fields": {"progress": {"trainStep": 1' + b"0" * 30 + b'}}}',
     "progress.trainStep: 1" + "0" * 30 + " is beyond a 64-bit integer"),
    (b"[" * 5000 + b"]" * 5000, "RecursionError"),
    (b'{"op": "flush", "timeoutS": -1}', "timeoutS: expected seconds"),
    (b"\x80\x04not json", "request is not JSON"),
    (b"[1]", "expected a JSON object"),
    (b" " * (300 * 1024), "request longer than"),
])
def test_anything_but_the_runtimes_fields_is_refused_and_nothing_applied(
        path: Path, request_: bytes, error: str) -> None:
    sink = KeptSink()
    with writer(path, sink):
        answer = raw(path, request_)
        assert answer["ok"] is False and error in answer["error"], answer
        with pytest.raises(ConnectionError, match="phase not a runtime status field"):
            SocketSink(str(path)).write({"phase": "Succeeded"}, 5)
    assert sink.applied == []


def test_a_client_that_trickles_holds_up_no_other_and_is_cut_off(path: Path) -> None:
    sink = KeptSink()
    with writer(path, sink), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
        slow.connect(str(path))
        slow.sendall(b"{")  # and nothing more for now
        start = time.monotonic()
        SocketSink(str(path)).write({"progress": PROGRESS}, 5)
        assert time.monotonic() - start < READ_TIMEOUT_S / 2
        assert sink.applied == [{"progress": PROGRESS}]
        slow.settimeout(READ_TIMEOUT_S + 5)
        answer = json.loads(slow.makefile().readline())
        assert answer == {"ok": False, "error": f"request not complete within "
                                                f"{READ_TIMEOUT_S:.0f}s"}


def test_a_restarted_writer_gets_the_last_fields_again_at_the_flush(path: Path) -> None:
    """The first writer took the stop report during an outage and died before applying it;
    the driver's flush at exit hands it to the writer the kubelet started again."""
    first, second = KeptSink(), KeptSink()
    first.down = True
    client = SocketSink(str(path))
    with writer(path, first):
        client.write({"progress": PROGRESS, "stopped": STOP}, 5)
    assert first.applied == []
    with writer(path, second):
        assert client.flush(5)
    assert second.applied == [{"progress": PROGRESS, "stopped": STOP}]


def test_without_credentials_the_writer_says_so_and_exits_2(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("KUBERNETES_") and k != "KUBECONFIG"}
    environ.update({env.JOB_NAME: "j", env.STATUS_SOCKET: str(tmp_path / "s"),
                    "KUBECONFIG": str(tmp_path / "none")})
    done = subprocess.run([sys.executable, "-m", "rljob.reporting.status_writer"], env=environ,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "status writer: no Kubernetes credentials" in done.stderr
    assert "Traceback" not in done.stderr
