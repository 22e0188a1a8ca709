"""The few engine endpoints the sidecar needs, over plain HTTP with explicit timeouts.

The sidecar runs blocking collectives on its main thread, so a small synchronous client
(stdlib HTTP) fits better than the runtime's async client.

Endpoints are those SGLang 0.5.3 serves (the pinned version): the weight version is read from
`/get_model_info` (`/get_weight_version` is gone from later releases), the tensor-parallel
size from `/get_server_info` (its server arguments), and `/update_weights_from_tensor` gets
one `serialized_named_tensors` entry per TP rank, which SGLang indexes by rank.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch

from rljob.weightsync.tensor_payload import encode_named_tensors


class EngineError(RuntimeError):
    """The engine could not be reached or answered something unusable."""


@dataclass(frozen=True)
class InstallResult:
    success: bool
    message: str


class EngineHTTP:
    def __init__(self, base_url: str, *, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._tp_size: int | None = None

    def _request(self, method: str, path: str, body: Any, timeout_s: float) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            # SGLang answers a refused update with 400 and a JSON body; keep its message.
            raw = err.read()
            try:
                return err.code, json.loads(raw)
            except ValueError:
                return err.code, {"message": raw.decode(errors="replace")}
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise EngineError(f"{method} {self.base_url}{path}: {err}") from err

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            status, _ = self._request("GET", "/health", None, timeout_s)
        except EngineError:
            return False
        return status == 200

    def weight_version(self) -> str:
        status, body = self._request("GET", "/get_model_info", None, self.timeout_s)
        if status != 200 or not isinstance(body, dict) or "weight_version" not in body:
            raise EngineError(f"GET /get_model_info answered {status} without weight_version: "
                              f"{body}")
        return str(body["weight_version"])

    def tp_size(self) -> int:
        """The engine's tensor-parallel ranks, asked once: an engine keeps its size for life."""
        if self._tp_size is None:
            status, body = self._request("GET", "/get_server_info", None, self.timeout_s)
            size = body.get("tp_size") if isinstance(body, dict) else None
            if status != 200 or not isinstance(size, int) or size < 1:
                raise EngineError(f"GET /get_server_info answered {status} without a tp_size")
            self._tp_size = size
        return self._tp_size

    def _install(self, path: str, body: dict[str, Any], timeout_s: float) -> InstallResult:
        status, answer = self._request("POST", path, body, timeout_s)
        if not isinstance(answer, dict):
            return InstallResult(False, f"{path} answered {status} without a JSON object")
        success = bool(answer.get("success")) and status == 200
        return InstallResult(success, str(answer.get("message", "")))

    def update_from_tensor(
        self, entries: list[str], version: str, timeout_s: float
    ) -> InstallResult:
        """Install `entries` as version `version`, entry r for tensor-parallel rank r.

        SGLang's rank r loads `serialized_named_tensors[r]`, so the list needs one entry per
        rank; another count is refused here rather than becoming an index error in one of
        SGLang's ranks.
        """
        ranks = self.tp_size()
        if len(entries) != ranks:
            raise EngineError(f"{len(entries)} serialized_named_tensors entries for an engine "
                              f"of {ranks} tensor-parallel ranks; send one per rank")
        body = {"serialized_named_tensors": entries, "flush_cache": True, "weight_version": version}
        return self._install("/update_weights_from_tensor", body, timeout_s)

    def update_from_named_tensors(
        self, named: list[tuple[str, torch.Tensor]], version: str, timeout_s: float
    ) -> InstallResult:
        """Install full HF-named tensors, which every rank loads (each keeps its own shard,
        as SGLang's `load_weights` does), as one entry per rank, each a pickle of its own.

        Torch counts one shared-memory (or CUDA IPC) reference per pickle and gives one back
        per unpickling, so a single entry read by several ranks releases the memory under
        the others: the sender's reused buffers are gone for the next version.
        """
        entries = [encode_named_tensors(named) for _ in range(self.tp_size())]
        return self.update_from_tensor(entries, version, timeout_s)

    def update_from_disk(self, model_path: str, version: str, timeout_s: float) -> InstallResult:
        body = {"model_path": model_path, "weight_version": version}
        return self._install("/update_weights_from_disk", body, timeout_s)
