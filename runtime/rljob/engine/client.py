"""The one client for rollout engines: the built-in `hf` server and SGLang alike.

Every call has an explicit deadline; an engine that answers with an HTTP error, a malformed
body or `success: false` raises `EngineError` (or returns a failed `InstallResult` for a
weight install) naming the engine and the call, so a dead or refusing engine is never
mistaken for an acknowledgement.

Endpoints are those SGLang 0.5.3 serves (the pinned release) and every supported release
after it (`rljob.engine.sglang_release`): the weight version is read from `/get_model_info`
(`/get_weight_version` is gone from later releases), the release and the tensor-parallel
size from `/get_server_info` (its server arguments), and `/update_weights_from_tensor` gets
one `serialized_named_tensors` entry per TP rank, which SGLang indexes by rank. The request
bodies are built by the module's `*_body` functions, which the tests hand to SGLang's own
request types and deserializers (tests/unit/test_sglang_contract.py).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from rljob.engine.sglang_release import unsupported
from rljob.weightsync.auth import bearer, peer_key

if TYPE_CHECKING:
    import torch

CONTROL_TIMEOUT_S = 30.0
GENERATE_TIMEOUT_S = 600.0


class EngineError(RuntimeError):
    """An engine call that failed; `url` and `call` say which. `answered`: the engine sent
    an answer (an HTTP status, a body) rather than the connection failing or timing out."""

    def __init__(self, url: str, call: str, detail: str, answered: bool = False) -> None:
        self.url = url
        self.call = call
        self.answered = answered
        super().__init__(f"engine {url} {call}: {detail}")


# A kept connection idle longer than this is replaced rather than reused: servers close idle
# ones (uvicorn, which serves SGLang, after 5 s), and a request on a connection the server is
# closing fails without saying whether it was served.
REUSE_IDLE_S = 2.0


@dataclass(frozen=True)
class InstallResult:
    success: bool
    message: str


def generate_body(input_ids: list[int] | list[list[int]],
                  sampling_params: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    """The body of `POST /generate`: one prompt (a list of ids, one sampling_params) or
    several (a list of lists, a list of sampling_params), with per-token log-probs."""
    return {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True}


def generate_answers(answer: Any, rows: int) -> list[dict[str, Any]]:
    """The completions of a `/generate` of `rows` prompts, in the order sent; ValueError
    naming what is wrong otherwise.

    A prompt SGLang aborts before its prefill (`abort_all` while it waited in the
    scheduler's queue) is answered without `output_ids` or log-probs, only finish_reason
    `abort` (0.5.3's `TokenizerManager._handle_abort_req`): it is taken as an abort with no
    tokens, as the hf engine answers one, so a batch cut at a step boundary keeps the rows
    that did run."""
    outs = answer if isinstance(answer, list) else [answer]
    if len(outs) != rows:
        raise ValueError(f"{len(outs)} answers to {rows} prompt(s): {str(answer)[:200]}")
    taken = []
    for out in outs:
        if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
            raise ValueError(f"unexpected response {str(out)[:200]}")
        if "output_ids" not in out and (
                (out["meta_info"].get("finish_reason") or {}).get("type") == "abort"):
            out = {**out, "output_ids": [],
                   "meta_info": {**out["meta_info"], "output_token_logprobs": []}}
        meta = out.get("meta_info") or {}
        ids, logprobs = out.get("output_ids"), meta.get("output_token_logprobs")
        if (not isinstance(ids, list) or not isinstance(logprobs, list)
                or len(logprobs) != len(ids)
                or not isinstance(meta.get("finish_reason"), dict | None)):
            raise ValueError(f"unexpected response {str(out)[:200]}")
        taken.append(out)
    return taken


def rank_tensors_body(
    named_by_rank: Sequence[Sequence[tuple[str, torch.Tensor]]], version: str
) -> dict[str, Any]:
    """The `/update_weights_from_tensor` body that installs full HF-named tensors in an
    engine of `len(named_by_rank)` tensor-parallel ranks, SGLang's rank r loading entry r
    (built from `named_by_rank[r]`, on rank r's GPU when a sidecar staged it there).

    One rank is sent the version as one flattened bucket when the tensors are views of one
    buffer in one dtype (the sidecar's staging): one handle to share and open instead of
    one a tensor. Several ranks get the named list, each entry a pickle of its own: SGLang's
    flattened path leaves the tensor on the GPU it arrived on, where its named path moves
    each one to the rank's device; and torch counts one shared-memory (or CUDA IPC)
    reference per pickle and gives one back per unpickling, so a single entry read by
    several ranks releases the memory under the others.
    """
    # Imported here: the rollout worker and the driver speak to engines without torch, which
    # costs every process that imports it seconds of start-up.
    from rljob.weightsync.wire import (
        FLATTENED,
        encode_flattened,
        encode_named_tensors,
        flat_span,
    )

    flat = flat_span(named_by_rank[0]) if len(named_by_rank) == 1 else None
    if flat is not None:
        return tensor_entries_body([encode_flattened(named_by_rank[0], flat)], version,
                                   FLATTENED)
    return tensor_entries_body([encode_named_tensors(named) for named in named_by_rank],
                               version)


def tensor_entries_body(
    entries: Sequence[str], version: str, load_format: str | None = None
) -> dict[str, Any]:
    """SGLang's `UpdateWeightsFromTensorReqInput` as JSON: entry r for rank r."""
    body: dict[str, Any] = {"serialized_named_tensors": list(entries), "flush_cache": True,
                            "weight_version": version}
    if load_format is not None:
        body["load_format"] = load_format
    return body


class EngineClient:
    """Talks to one engine at `url`: the built-in `hf` server and SGLang alike.

    Control and weight calls block, over a kept connection (HTTP/1.1 keep-alive), one per
    calling thread: the sidecar runs blocking collectives on its main thread and asks from
    its health handler too, and a fresh connection per request costs a TCP handshake and, on
    our servers, a thread, as much as the rest of a 1 GB handoff. `generate` is async, over
    an aiohttp session opened on first use (`aclose` closes it): a rollout keeps hundreds of
    generations in flight on one event loop. The session belongs to that loop, so a client
    serves one `asyncio.run`; a hook on the event loop calls the blocking methods through
    `asyncio.to_thread`, or it stalls every generation in flight.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = CONTROL_TIMEOUT_S,
        generate_timeout_s: float = GENERATE_TIMEOUT_S,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the key the engine requires (default: the job's `peer_key()`), sent
        as `Authorization: Bearer` with every request."""
        self.base_url = base_url.rstrip("/")
        self._auth = bearer(peer_key() if api_key is None else api_key)
        parsed = urllib.parse.urlsplit(self.base_url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"engine URL must be http://HOST:PORT, got {base_url!r}")
        self._host, self._port = parsed.hostname, parsed.port or 80
        self._prefix = parsed.path
        self.timeout_s = timeout_s
        self._server_info: dict[str, Any] | None = None
        self._local = threading.local()
        self._generate_timeout = aiohttp.ClientTimeout(total=generate_timeout_s, connect=10)
        self._session: aiohttp.ClientSession | None = None
        # A lost engine's client: its generations fail at once, so a hook holding it never
        # reaches a replacement at the same address before that has the current weights.
        self.retired = False

    def close(self) -> None:
        """Close the calling thread's kept connection."""
        self._close()

    async def aclose(self) -> None:
        """Close the generation session (and the calling thread's kept connection)."""
        self._close()
        # Taken first: a call made while it closes opens a session of its own.
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _open_session(self) -> aiohttp.ClientSession:
        """The generation session, opened on first use and again after `aclose` (one closed
        under calls in flight fails those calls, never a later one)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._auth)
        return self._session

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _connection(self, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        idle = time.monotonic() - getattr(self._local, "used", 0.0)
        if conn is not None and idle < REUSE_IDLE_S:
            conn.timeout = timeout_s
            if conn.sock is not None:
                conn.sock.settimeout(timeout_s)
            return conn, True
        self._close()
        conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        conn.connect()
        if conn.sock is not None:
            # A request written in pieces must not wait for the server's delayed ACK.
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._local.conn = conn
        return conn, False

    def _close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def _exchange(
        self, method: str, path: str, data: bytes | None, timeout_s: float
    ) -> tuple[int, bytes]:
        headers = {**self._auth, **({"Content-Type": "application/json"} if data is not None
                                    else {})}
        for attempt in (0, 1):
            conn, reused = self._connection(timeout_s)
            try:
                conn.request(method, self._prefix + path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._close()
                # A kept connection the server had closed: a GET is asked again on a new
                # one; a POST is not (it may have been served), the caller sees the error.
                if reused and method == "GET" and attempt == 0:
                    continue
                raise
            except BaseException:
                self._close()
                raise
            if resp.will_close:
                self._close()
            else:
                self._local.used = time.monotonic()
            return resp.status, raw
        raise AssertionError("unreachable")

    def _request(self, method: str, path: str, body: Any, timeout_s: float) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        try:
            status, raw = self._exchange(method, path, data, timeout_s)
        except (OSError, http.client.HTTPException) as err:
            raise EngineError(self.base_url, f"{method} {path}", str(err)) from err
        try:
            return status, json.loads(raw or b"null")
        except ValueError as err:
            if status >= 400:
                # SGLang answers a refused update with 400 and a JSON body; keep any text.
                return status, {"message": raw.decode(errors="replace")}
            raise EngineError(self.base_url, f"{method} {path}", str(err)) from err

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            status, _ = self._request("GET", "/health", None, timeout_s)
        except EngineError:
            return False
        return status == 200

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll /health until 200 or the deadline; raise EngineError at the deadline."""
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while not self.healthy():
            if time.monotonic() > deadline:
                raise EngineError(self.base_url, "GET /health",
                                  f"not healthy after {timeout_s:.0f}s")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def model_info(self) -> dict[str, Any]:
        """`/get_model_info`: the pinned SGLang (0.5.3) serves the weight version there;
        `/get_weight_version` is gone from later releases."""
        status, body = self._request("GET", "/get_model_info", None, self.timeout_s)
        if status != 200 or not isinstance(body, dict) or "weight_version" not in body:
            raise EngineError(self.base_url, "GET /get_model_info",
                              f"answered {status} without weight_version: {body}")
        return body

    def weight_version(self) -> str:
        return str(self.model_info()["weight_version"])

    def pause_generation(self) -> None:
        """`/pause_generation`: SGLang aborts every request it holds (each answers with the
        tokens it got, finish_reason `abort`) and holds new ones until
        `continue_generation`."""
        self._control("/pause_generation")

    def continue_generation(self) -> None:
        self._control("/continue_generation")

    def _control(self, path: str) -> None:
        status, body = self._request("POST", path, {}, self.timeout_s)
        if status != 200:
            raise EngineError(self.base_url, f"POST {path}", f"answered {status}: {body}")

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> dict[str, Any]:
        """One prompt's completion in SGLang's shape, with per-token log-probs."""
        (out,) = await self._generate(generate_body(input_ids, sampling_params), 1)
        return out

    async def generate_many(
        self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Several prompts' completions in one request (SGLang's batch form of /generate,
        one sampling_params per prompt), answered in the order sent once all are done."""
        if len(input_ids) != len(sampling_params) or not input_ids:
            raise ValueError("generate_many takes one sampling_params per prompt, and a prompt")
        return await self._generate(generate_body(input_ids, sampling_params), len(input_ids))

    async def _generate(self, body: dict[str, Any], rows: int) -> list[dict[str, Any]]:
        call = "POST /generate"
        if self.retired:
            raise EngineError(self.base_url, call, "the engine was lost (this client retired)")
        session = self._open_session()
        try:
            async with session.post(self.base_url + "/generate", json=body,
                                          timeout=self._generate_timeout) as resp:
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError) as err:
            raise EngineError(self.base_url, call, f"{type(err).__name__}: {err}") from None
        except asyncio.CancelledError:
            # Closing a lost engine's session cancels the requests still waiting for one of
            # its connections; only the task's own cancellation is passed on as such.
            task = asyncio.current_task()
            if self.retired and task is not None and not task.cancelling():
                raise EngineError(self.base_url, call,
                                  "the engine was lost (its session closed)") from None
            raise
        if resp.status != 200:
            raise EngineError(self.base_url, call, f"HTTP {resp.status}: {text[:500]}",
                              answered=True)
        try:
            return generate_answers(json.loads(text), rows)
        except ValueError as err:
            raise EngineError(self.base_url, call, str(err), answered=True) from None

    async def abort_all(self) -> None:
        """Abort every request the engine holds, running or queued: SGLang's
        `/abort_request` with `abort_all` (0.5.3 answers 200 with no body). Each aborted
        `/generate` still answers, with the tokens it got and finish_reason `abort`;
        requests sent after this one run normally. Async, on the generation session: it
        is sent from the event loop whose generations it stops."""
        call = "POST /abort_request"
        session = self._open_session()
        try:
            async with session.post(
                    self.base_url + "/abort_request", json={"rid": "", "abort_all": True},
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError) as err:
            raise EngineError(self.base_url, call, f"{type(err).__name__}: {err}") from None
        if resp.status != 200:
            raise EngineError(self.base_url, call, f"HTTP {resp.status}: {text[:500]}")

    def server_info(self) -> dict[str, Any]:
        """`/get_server_info` (SGLang's server arguments and its `version`), asked once: an
        engine keeps them for life. Refuses a release outside the supported range
        (`rljob.engine.sglang_release`), naming it and the range."""
        if self._server_info is None:
            status, body = self._request("GET", "/get_server_info", None, self.timeout_s)
            if status != 200 or not isinstance(body, dict):
                raise EngineError(self.base_url, "GET /get_server_info",
                                  f"answered {status}: {str(body)[:200]}")
            why = unsupported(body.get("version"))
            if why:
                raise EngineError(self.base_url, "GET /get_server_info", why)
            self._server_info = body
        return self._server_info

    def check_version(self) -> str:
        """The engine's SGLang release, once it is known to be supported (EngineError
        otherwise): what the runtime asks when it connects to an engine."""
        return str(self.server_info()["version"])

    def tp_size(self) -> int:
        """The engine's tensor-parallel ranks (from `server_info`)."""
        size = self.server_info().get("tp_size")
        if not isinstance(size, int) or size < 1:
            raise EngineError(self.base_url, "GET /get_server_info",
                              f"answered without a tp_size: {size!r}")
        return size

    def _install(self, path: str, body: dict[str, Any], timeout_s: float) -> InstallResult:
        status, answer = self._request("POST", path, body, timeout_s)
        if not isinstance(answer, dict):
            return InstallResult(False, f"{path} answered {status} without a JSON object")
        success = bool(answer.get("success")) and status == 200
        return InstallResult(success, str(answer.get("message", "")))

    def update_from_tensor(
        self, entries: list[str], version: str, timeout_s: float, load_format: str | None = None
    ) -> InstallResult:
        """Install `entries` as version `version`, entry r for tensor-parallel rank r.

        SGLang's rank r loads `serialized_named_tensors[r]`, so the list needs one entry per
        rank; another count is refused here rather than becoming an index error in one of
        SGLang's ranks.
        """
        ranks = self.tp_size()
        if len(entries) != ranks:
            raise EngineError(self.base_url, "POST /update_weights_from_tensor",
                              f"{len(entries)} serialized_named_tensors entries for an engine "
                              f"of {ranks} tensor-parallel ranks; send one per rank")
        return self._install("/update_weights_from_tensor",
                             tensor_entries_body(entries, version, load_format), timeout_s)

    def update_from_rank_tensors(
        self, named_by_rank: Sequence[Sequence[tuple[str, torch.Tensor]]], version: str,
        timeout_s: float,
    ) -> InstallResult:
        """Install full HF-named tensors, rank r loading `named_by_rank[r]` (each keeps its
        own shard, as SGLang's `load_weights` does): `rank_tensors_body` says how they
        travel. A sidecar gives each rank the version on that rank's GPU
        (`rljob.engine.rank_devices`)."""
        ranks = self.tp_size()
        if len(named_by_rank) != ranks:
            raise ValueError(f"{len(named_by_rank)} rank entries for an engine of {ranks} "
                             "tensor-parallel ranks")
        body = rank_tensors_body(named_by_rank, version)
        return self._install("/update_weights_from_tensor", body, timeout_s)

    def release_memory(self, timeout_s: float) -> None:
        """Free the engine's GPU memory while a colocated trainer trains: SGLang's
        `/release_memory_occupation` with no tags, which the release reads as its default
        set: weights and KV cache in 0.5.3 (it has no tag for CUDA graphs, which stay), and
        CUDA graphs too in releases that have the tag (0.5.23). Send it while the engine is
        idle: 0.5.23 refuses it otherwise."""
        self._occupation("/release_memory_occupation", timeout_s)

    def resume_memory(self, timeout_s: float) -> None:
        """Take the memory back (`/resume_memory_occupation`, the same default tags).
        SGLang keeps no copy of released weights unless started with a CPU backup: a
        version must be installed before it generates again."""
        self._occupation("/resume_memory_occupation", timeout_s)

    def _occupation(self, path: str, timeout_s: float) -> None:
        status, body = self._request("POST", path, {}, timeout_s)
        # SGLang answers 200 with `null` (its handler returns nothing); a refusal is an
        # error status.
        if status != 200 or (isinstance(body, dict) and body.get("success") is False):
            raise EngineError(self.base_url, f"POST {path}", f"answered {status}: {body}")

    def update_from_disk(self, model_path: str, version: str, timeout_s: float) -> InstallResult:
        body = {"model_path": model_path, "weight_version": version}
        return self._install("/update_weights_from_disk", body, timeout_s)
