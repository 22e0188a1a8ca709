"""The one async client for rollout engines: the built-in `hf` server and SGLang alike.

Every call has an explicit deadline; an engine that answers with an HTTP error, a
malformed body or `success: false` raises `EngineError` naming the engine and the call,
so a dead or refusing engine is never mistaken for an acknowledgement.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

CONTROL_TIMEOUT_S = 30.0
GENERATE_TIMEOUT_S = 600.0


class EngineError(RuntimeError):
    """An engine call that failed; `url` and `call` say which."""

    def __init__(self, url: str, call: str, detail: str) -> None:
        self.url = url
        self.call = call
        super().__init__(f"engine {url} {call}: {detail}")


class EngineClient:
    """Talks to one engine at `url`; use as an async context manager (owns a session)."""

    def __init__(
        self,
        url: str,
        *,
        control_timeout_s: float = CONTROL_TIMEOUT_S,
        generate_timeout_s: float = GENERATE_TIMEOUT_S,
        update_timeout_s: float = 300.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.control_timeout = aiohttp.ClientTimeout(total=control_timeout_s, connect=10)
        self.generate_timeout = aiohttp.ClientTimeout(total=generate_timeout_s, connect=10)
        self.update_timeout = aiohttp.ClientTimeout(total=update_timeout_s, connect=10)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineClient:
        self._session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _call(
        self, method: str, path: str, timeout: aiohttp.ClientTimeout, body: Any = None
    ) -> Any:
        try:
            async with self.session.request(
                method, self.url + path, json=body, timeout=timeout
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EngineError(self.url, path, f"HTTP {resp.status}: {text[:500]}")
                if not text:
                    return {}
                try:
                    return await resp.json(content_type=None)
                except ValueError:
                    raise EngineError(self.url, path, f"not JSON: {text[:200]}") from None
        except (TimeoutError, aiohttp.ClientError) as err:
            raise EngineError(self.url, path, f"{type(err).__name__}: {err}") from None

    async def healthy(self) -> bool:
        try:
            async with self.session.get(self.url + "/health", timeout=self.control_timeout) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def wait_healthy(self, timeout_s: float) -> None:
        """Poll /health until 200 or the deadline; raise EngineError at the deadline."""
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while not await self.healthy():
            if time.monotonic() > deadline:
                raise EngineError(self.url, "/health", f"not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await self._call("GET", "/get_model_info", self.control_timeout)
        return info

    async def weight_version(self) -> str:
        """From `/get_model_info`, which the pinned SGLang (0.5.3) serves with the version;
        `/get_weight_version` is gone from later releases."""
        return str((await self.model_info())["weight_version"])

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> dict[str, Any]:
        """One prompt's completion in SGLang's shape, with per-token log-probs."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params,
                "return_logprob": True}
        out = await self._call("POST", "/generate", self.generate_timeout, body)
        if isinstance(out, list):
            out = out[0]
        if not isinstance(out, dict) or "output_ids" not in out or "meta_info" not in out:
            raise EngineError(self.url, "/generate", f"unexpected response {str(out)[:200]}")
        return out

    async def pause(self) -> None:
        await self._call("POST", "/pause_generation", self.control_timeout, {})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", self.control_timeout, {})

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache", self.control_timeout, {})

    async def _update(self, path: str, body: dict[str, Any]) -> None:
        out = await self._call("POST", path, self.update_timeout, body)
        if not isinstance(out, dict) or out.get("success") is not True:
            message = out.get("message") if isinstance(out, dict) else out
            raise EngineError(self.url, path, f"refused: {message}")

    async def update_weights_from_tensor(self, serialized: list[str], version: str) -> None:
        await self._update("/update_weights_from_tensor", {
            "serialized_named_tensors": serialized, "flush_cache": True,
            "weight_version": version,
        })

    async def update_weights_from_disk(self, model_path: str, version: str) -> None:
        await self._update("/update_weights_from_disk",
                           {"model_path": model_path, "weight_version": version})
