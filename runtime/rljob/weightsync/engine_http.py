"""The few engine endpoints the sidecar needs, over plain HTTP with explicit timeouts.

The sidecar runs blocking collectives on its main thread, so a small synchronous client
(stdlib only) fits better than the runtime's async client.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


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
        status, body = self._request("GET", "/get_weight_version", None, self.timeout_s)
        if status != 200 or not isinstance(body, dict) or "weight_version" not in body:
            raise EngineError(f"GET /get_weight_version answered {status}: {body}")
        return str(body["weight_version"])

    def _install(self, path: str, body: dict[str, Any], timeout_s: float) -> InstallResult:
        status, answer = self._request("POST", path, body, timeout_s)
        if not isinstance(answer, dict):
            return InstallResult(False, f"{path} answered {status} without a JSON object")
        success = bool(answer.get("success")) and status == 200
        return InstallResult(success, str(answer.get("message", "")))

    def update_from_tensor(
        self, entries: list[str], version: str, timeout_s: float
    ) -> InstallResult:
        body = {"serialized_named_tensors": entries, "flush_cache": True, "weight_version": version}
        return self._install("/update_weights_from_tensor", body, timeout_s)

    def update_from_disk(self, model_path: str, version: str, timeout_s: float) -> InstallResult:
        body = {"model_path": model_path, "weight_version": version}
        return self._install("/update_weights_from_disk", body, timeout_s)
