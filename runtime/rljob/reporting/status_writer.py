"""The driver pod's status writer: the one process of a job that holds its Kubernetes API
token (`python -m rljob.reporting.status_writer`, a native sidecar of the driver pod).

It listens on the Unix socket RLJOB_STATUS_SOCKET names and takes the runtime's status
fields from the driver container (`status_sink.SocketSink`), checks each against the
status model, and applies them to the RLJob with the same writer thread, backoff and
latest-wins rules as a runtime that writes directly (`reporter.StatusReporter`). It parses
JSON and nothing else. Each delivery is the driver's whole set: what was delivered before
and is missing now is not applied again. Each connection is served on a thread of its own,
at most MAX_CONNECTIONS at once, so that one slow client holds up no other.

On SIGTERM (the kubelet stops a native sidecar only after the driver container has ended,
so the driver's last reports are already here) it flushes with a deadline and exits 0.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from rljob.reporting.reporter import FLUSH_TIMEOUT_S, StatusReporter
from rljob.reporting.status_sink import ApiSink, checked_fields, receive_all
from rljob_api import env

ACCEPT_TIMEOUT_S = 1.0  # how often the accept loop looks whether it was told to stop
READ_TIMEOUT_S = 5.0  # one request's whole read
MAX_CONNECTIONS = 8  # requests served at once; more are answered "busy" (and retried)


def answer(reporter: StatusReporter, request: object) -> dict[str, Any]:
    """The answer to one request. `write` hands checked fields to the reporter as the
    driver's whole set (it returns once they are applied, or at once while the API server
    does not answer); `flush` does the same with the fields it carries, if any, then waits
    for the reporter's queue: all of it within the deadline asked for (at most the
    writer's own)."""
    if not isinstance(request, dict):
        return {"ok": False, "error": "expected a JSON object"}
    op = request.get("op")
    if op not in ("write", "flush"):
        return {"ok": False, "error": f"op: {op!r} is not one of write, flush"}
    timeout = FLUSH_TIMEOUT_S
    if op == "flush" and "timeoutS" in request:
        asked = request["timeoutS"]
        if (isinstance(asked, bool) or not isinstance(asked, int | float)
                or not math.isfinite(asked) or asked < 0):
            return {"ok": False, "error": "timeoutS: expected seconds, a finite number >= 0"}
        timeout = min(float(asked), FLUSH_TIMEOUT_S)
    deadline = time.monotonic() + timeout
    if op == "write" or "fields" in request:
        try:
            fields = checked_fields(request.get("fields"))
        except ValueError as err:
            return {"ok": False, "error": str(err)}
        if not reporter.report_fields(fields, replace=True):
            return {"ok": False, "error": "the status writer is stopping"}
    if op == "write":
        return {"ok": True}
    return {"ok": True, "flushed": reporter.flush(max(0.0, deadline - time.monotonic()))}


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _read(conn: socket.socket) -> object:
    """One request: everything the client sends before it shuts its side, within
    READ_TIMEOUT_S in all (a client that trickles bytes is cut off, not waited for)."""
    try:
        data = receive_all(conn, time.monotonic() + READ_TIMEOUT_S)
    except TimeoutError:
        raise ValueError(f"request not complete within {READ_TIMEOUT_S:.0f}s") from None
    except ValueError as err:
        raise ValueError(f"request {err}") from None
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except ValueError as err:  # not JSON (NaN and Infinity included), or not UTF-8 at all
        raise ValueError(f"request is not JSON ({err})") from None


def _handle(conn: socket.socket, reporter: StatusReporter, slots: threading.Semaphore) -> None:
    with conn:
        try:
            reply = answer(reporter, _read(conn))
        except (OSError, ValueError) as err:  # a bad or broken request: refused
            reply = {"ok": False, "error": str(err)[:300]}
        except Exception as err:  # anything else it provokes (e.g. nested too deep) too
            reply = {"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}
        finally:
            slots.release()
        # The driver may have gone mid-request; it retries if it can.
        with contextlib.suppress(OSError):
            conn.settimeout(READ_TIMEOUT_S)
            conn.sendall(json.dumps(reply).encode() + b"\n")


@contextlib.contextmanager
def _removed_after(path: Path) -> Iterator[None]:
    """A socket file outlives its socket: left behind, it would tell a client that a writer
    listens where none does."""
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def serve(path: Path, reporter: StatusReporter, stop: threading.Event) -> None:
    """Answer requests on the socket at `path` until `stop` is set, each connection on a
    thread of its own (at most MAX_CONNECTIONS at once), so that one slow client holds up
    no other."""
    path.unlink(missing_ok=True)
    slots = threading.Semaphore(MAX_CONNECTIONS)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server, _removed_after(path):
        server.bind(str(path))
        server.listen(MAX_CONNECTIONS)
        server.settimeout(ACCEPT_TIMEOUT_S)
        print(f"status writer: listening on {path}", flush=True)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            if not slots.acquire(blocking=False):
                with conn, contextlib.suppress(OSError):
                    conn.sendall(b'{"ok": false, "error": "busy"}\n')
                continue
            try:
                threading.Thread(target=_handle, args=(conn, reporter, slots),
                                 name="status-request", daemon=True).start()
            except RuntimeError:  # no thread to be had: refused, the driver retries
                slots.release()
                conn.close()


def main() -> int:
    path = os.environ.get(env.STATUS_SOCKET)
    name = os.environ.get(env.JOB_NAME)
    if not path or not name:
        print(f"status writer: {env.STATUS_SOCKET} and {env.JOB_NAME} must be set",
              file=sys.stderr)
        return 2
    from kubernetes.config import ConfigException

    try:
        sink = ApiSink(name, os.environ.get(env.JOB_NAMESPACE, "default"))
    except ConfigException as err:
        print(f"status writer: no Kubernetes credentials (neither the in-cluster token nor a "
              f"kubeconfig): {err}", file=sys.stderr)
        return 2
    reporter = StatusReporter(sink)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    serve(Path(path), reporter, stop)
    reporter.close(FLUSH_TIMEOUT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
