"""The driver pod's status writer: the one process of a job that holds its Kubernetes API
token (`python -m rljob.reporting.status_writer`, a native sidecar of the driver pod).

It listens on the Unix socket RLJOB_STATUS_SOCKET names and takes the runtime's status
fields from the driver container (`status_sink.SocketSink`), checks each against the
status model, and applies them to the RLJob with the same writer thread, backoff and
latest-wins rules as a runtime that writes directly (`reporter.StatusReporter`). It parses
JSON and nothing else. Requests are served one at a time: there is one driver.

On SIGTERM (the kubelet stops a native sidecar only after the driver container has ended,
so the driver's last reports are already here) it flushes with a deadline and exits 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from rljob.reporting.reporter import FLUSH_TIMEOUT_S, StatusReporter
from rljob.reporting.status_sink import MAX_REQUEST_BYTES, ApiSink, checked_fields
from rljob_api import env

ACCEPT_TIMEOUT_S = 1.0  # how often the accept loop looks whether it was told to stop
READ_TIMEOUT_S = 5.0  # one request's whole read


def answer(reporter: StatusReporter, request: object) -> dict[str, Any]:
    """The answer to one request: `write` passes checked fields on to the reporter (it
    returns once they are applied, or at once while the API server does not answer),
    `flush` waits for the reporter's queue with the deadline asked for (at most the
    writer's own flush deadline)."""
    if not isinstance(request, dict):
        return {"ok": False, "error": "expected a JSON object"}
    op = request.get("op")
    if op == "write":
        try:
            fields = checked_fields(request.get("fields"))
        except ValueError as err:
            return {"ok": False, "error": str(err)}
        reporter.report_fields(fields)
        return {"ok": True}
    if op == "flush":
        asked = request.get("timeoutS")
        timeout = float(asked) if isinstance(asked, int | float) else FLUSH_TIMEOUT_S
        return {"ok": True, "flushed": reporter.flush(min(max(timeout, 0.0), FLUSH_TIMEOUT_S))}
    return {"ok": False, "error": f"op: {op!r} is not one of write, flush"}


def _read(conn: socket.socket) -> object:
    conn.settimeout(READ_TIMEOUT_S)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError(f"request longer than {MAX_REQUEST_BYTES} bytes")
    try:
        return json.loads(data)
    except json.JSONDecodeError as err:
        raise ValueError(f"request is not JSON ({err})") from None


def serve(path: Path, reporter: StatusReporter, stop: threading.Event) -> None:
    """Answer requests on the socket at `path` until `stop` is set."""
    path.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(8)
        server.settimeout(ACCEPT_TIMEOUT_S)
        print(f"status writer: listening on {path}", flush=True)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                try:
                    reply = answer(reporter, _read(conn))
                except (OSError, ValueError) as err:  # a bad or broken request: refused
                    reply = {"ok": False, "error": str(err)[:300]}
                # The driver may have gone mid-request; it retries if it can.
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps(reply).encode() + b"\n")


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
