"""Where the runtime's status fields go: straight to the API server, or to the driver pod's
status writer over a Unix socket.

In a driver pod the Kubernetes API token is mounted only into the `status-writer` container
(a native sidecar), never into the `driver` container, where the driver, its Ray node, the
rollout worker and the user's reward and generate hooks run. The driver hands its fields to
the writer over a socket in a volume both containers mount; the writer checks every field
against the status model (the runtime's five fields, nothing else, each a typed value) and
applies them with the token. It never unpickles nor runs anything it receives, so code in
the driver container can at worst report wrong figures for its own job: it cannot read the
token, call the API server as the job, or reach any other object.

Without a socket (`rljob run` on a laptop or against a cluster from a workstation, the
tests' runtimes) the runtime applies directly with the credentials it has.
"""

from __future__ import annotations

import json
import math
import socket
import time
from typing import Any, Protocol, cast

from pydantic import BaseModel, ValidationError

from rljob_api import GROUP, PLURAL, VERSION
from rljob_api.status import (
    RUNTIME_CARRIED_FIELDS,
    RUNTIME_MANAGER,
    CheckpointStatus,
    EnginesStatus,
    Progress,
    ResumeReport,
    RuntimeFailure,
    RuntimeStop,
    apply_status,
)

# The runtime's status fields and the model each value must validate as; the writer takes
# these and nothing else.
FIELD_MODELS: dict[str, type[BaseModel]] = {
    "progress": Progress,
    "checkpoint": CheckpointStatus,
    "resumed": ResumeReport,
    "runtimeFailure": RuntimeFailure,
    "stopped": RuntimeStop,
    "engines": EnginesStatus,
}
MAX_REQUEST_BYTES = 256 * 1024  # a status with a full checkpoint history is under 8 KiB


def receive_all(conn: socket.socket, deadline: float) -> bytes:
    """Everything the peer sends until it shuts its side, by `deadline` (time.monotonic)
    and in at most MAX_REQUEST_BYTES: a peer that trickles bytes is cut off at the
    deadline (TimeoutError), one that sends too much refused (ValueError). Both ends of the
    socket read this way."""
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        conn.settimeout(left)
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError(f"longer than {MAX_REQUEST_BYTES} bytes")


class StatusSink(Protocol):
    """Takes the whole set of the runtime's status fields (the latest value of each)."""

    def write(self, fields: dict[str, Any], timeout_s: float) -> None:
        """Deliver `fields`; raise on any failure (the caller retries with backoff)."""

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until whatever this sink accepted is applied."""


def checked_fields(raw: object) -> dict[str, Any]:
    """`raw` as the runtime's status fields: a mapping of known field names to values that
    validate as their model, dumped back from the model (so only typed fields travel on).
    Raises ValueError naming the field otherwise."""
    if not isinstance(raw, dict):
        raise ValueError("fields: expected an object of the runtime's status fields")
    unknown = sorted(set(raw) - set(FIELD_MODELS))
    if unknown:
        raise ValueError(f"fields: {', '.join(map(str, unknown))} not a runtime status field "
                         f"(one of {', '.join(FIELD_MODELS)})")
    fields: dict[str, Any] = {}
    for name, value in raw.items():
        try:
            model = FIELD_MODELS[name].model_validate(value)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in (name, *first["loc"]))
            raise ValueError(f"{where}: {first['msg']}") from None
        dumped = model.model_dump(by_alias=True, exclude_none=True, mode="json")
        _check_numbers(name, dumped)
        fields[name] = dumped
    return fields


INT64 = 2**63 - 1  # the API server stores integers as int64


def _check_numbers(where: str, value: object) -> None:
    """Numbers the API server would refuse (so every later apply of the set would fail)
    are refused here, naming the field: NaN, infinities, integers beyond int64."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_numbers(f"{where}.{key}", item)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_numbers(f"{where}.{index}", item)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value} is not a finite number (report it in "
                         f"progress.nonFinite instead)")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64:
        raise ValueError(f"{where}: {value} is beyond a 64-bit integer")


class ApiSink:
    """Server-side applies the fields to one RLJob's status subresource. An apply removes
    the fields its manager applied before and left out now, so a restarted runtime first
    reads back what its predecessor reported and carries it."""

    def __init__(self, name: str, namespace: str, api_client: Any = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.name = name
        self.namespace = namespace
        self.api = client.CustomObjectsApi(api_client)
        self._carried: dict[str, Any] | None = None

    def __str__(self) -> str:
        return f"RLJob {self.namespace}/{self.name}"

    def write(self, fields: dict[str, Any], timeout_s: float) -> None:
        timeout = (timeout_s, timeout_s)
        if self._carried is None:
            obj = self.api.get_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, _request_timeout=timeout
            )
            current: dict[str, Any] = cast(dict[str, Any], obj).get("status") or {}
            self._carried = {k: current[k] for k in RUNTIME_CARRIED_FIELDS if k in current}
        apply_status(self.api, self.namespace, self.name, {**self._carried, **fields},
                     RUNTIME_MANAGER, timeout)

    def flush(self, timeout_s: float) -> bool:
        return True  # a write returns once the API server took it


class SocketSink:
    """Hands the fields to the pod's status writer: one JSON request per connection, one
    JSON answer. The writer answers a write once its own apply went through or, while the
    API server does not answer, at once (it keeps retrying on its own). A flush carries the
    last fields again: a writer restarted since (the kubelet restarts a native sidecar that
    died) would otherwise answer that it holds nothing, and the fields would be lost."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._last: dict[str, Any] | None = None

    def __str__(self) -> str:
        return f"the status writer at {self.path}"

    def write(self, fields: dict[str, Any], timeout_s: float) -> None:
        self._call({"op": "write", "fields": fields}, timeout_s)
        self._last = fields

    def flush(self, timeout_s: float) -> bool:
        # The writer waits for its apply a second less than the deadline: it has that second
        # to answer within the deadline.
        request: dict[str, Any] = {"op": "flush", "timeoutS": max(0.0, timeout_s - 1.0)}
        if self._last is not None:
            request["fields"] = self._last
        answer = self._call(request, max(timeout_s, 0.1))
        return bool(answer.get("flushed"))

    def _call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One request and its answer, all within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout_s)
            conn.connect(self.path)
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            conn.sendall(json.dumps(request).encode() + b"\n")
            conn.shutdown(socket.SHUT_WR)
            try:
                data = receive_all(conn, deadline)
            except TimeoutError:
                raise TimeoutError(
                    f"the status writer did not answer within {timeout_s:.0f}s") from None
            except ValueError:
                raise ConnectionError("the status writer's answer is too long") from None
        answer = json.loads(data or b"{}")
        if not isinstance(answer, dict) or not answer.get("ok"):
            error = answer.get("error") if isinstance(answer, dict) else None
            raise ConnectionError(f"the status writer refused: {error or 'no answer'}")
        return answer
