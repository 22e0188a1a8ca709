"""The SGLang backend: build the server command line, start it, wait until it serves.

Every `spec.rollout.sglangArgs` entry passes through as `--key value` (`"true"` becomes a
bare flag, `"false"` leaves the flag off). The arguments that wire the server into rljob
(host, port, model path, tensor-parallel size = gpusPerEngine, NCCL port, base GPU id, ...)
are set here; a user value for one of them is refused, as the API server already does at
admission (`rljob_api.rules.RESERVED_SGLANG_ARGS`).

Targets the HTTP API of SGLang 0.5.3, the version the rollout image pins
(`sglang.launch_server`, `/health`, `/get_model_info`, `/get_server_info`,
`/update_weights_from_tensor` with one entry per TP rank, `/update_weights_from_disk`,
`/pause_generation`, `/continue_generation`); see docs/weight-sync.md.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from rljob.engine.client import EngineClient
from rljob_api.rules import RESERVED_SGLANG_ARGS

SGLANG_VERSION = "0.5.3"
# Owned by rljob as well, though admission does not list it: the sidecar sets versions.
OWNED_SGLANG_ARGS = (*RESERVED_SGLANG_ARGS, "weight-version")


class ReservedArgumentError(ValueError):
    """A user tried to set an argument rljob owns."""


class EngineStartError(RuntimeError):
    """The server exited or did not become healthy in time."""


@dataclass(frozen=True)
class SGLangServer:
    """What rljob decides for one engine; everything else comes from sglangArgs."""

    model_path: str
    host: str
    port: int
    tp_size: int
    nccl_port: int
    base_gpu_id: int = 0
    tokenizer_path: str | None = None
    weight_version: str = "0"
    python: str = "python3"
    # Colocated with a trainer: `/release_memory_occupation` must free the GPU, which SGLang
    # does only when started with --enable-memory-saver (torch_memory_saver regions).
    memory_saver: bool = False


def _flag(key: str) -> str:
    return "--" + key.lstrip("-")


def build_command(server: SGLangServer, sglang_args: Mapping[str, str]) -> list[str]:
    """The argv of `python -m sglang.launch_server` for `server` plus the user's arguments."""
    reserved = sorted(k for k in sglang_args if k.lstrip("-") in OWNED_SGLANG_ARGS)
    if reserved:
        raise ReservedArgumentError(
            f"spec.rollout.sglangArgs sets {', '.join(reserved)}, which rljob sets itself "
            "(tensor parallel size comes from spec.rollout.gpusPerEngine); remove them"
        )
    argv = [server.python, "-m", "sglang.launch_server"]
    owned = {
        "model-path": server.model_path,
        "tokenizer-path": server.tokenizer_path or server.model_path,
        "host": server.host,
        "port": str(server.port),
        "tp-size": str(server.tp_size),
        "nccl-port": str(server.nccl_port),
        "base-gpu-id": str(server.base_gpu_id),
        "weight-version": server.weight_version,
    }
    for key, value in owned.items():
        argv += [_flag(key), value]
    if server.memory_saver:
        argv.append(_flag("enable-memory-saver"))
        sglang_args = {k: v for k, v in sglang_args.items()
                       if k.lstrip("-") != "enable-memory-saver"}
    for key, value in sglang_args.items():
        lowered = value.strip().lower()
        if lowered == "true":
            argv.append(_flag(key))
        elif lowered != "false":
            argv += [_flag(key), value]
    return argv


def wait_healthy(
    base_url: str,
    *,
    deadline_s: float,
    request_timeout_s: float = 5.0,
    interval_s: float = 1.0,
    process: subprocess.Popen[bytes] | None = None,
) -> float:
    """Poll `/health` until it answers 200; returns the seconds it took.

    Fails early, with the exit code, when the server process dies while loading.
    """
    engine = EngineClient(base_url)
    start = time.monotonic()
    while True:
        if process is not None and process.poll() is not None:
            raise EngineStartError(
                f"SGLang server at {base_url} exited with code {process.returncode} while loading"
            )
        if engine.healthy(request_timeout_s):
            return time.monotonic() - start
        if time.monotonic() - start >= deadline_s:
            raise EngineStartError(
                f"SGLang server at {base_url} not healthy after {deadline_s:.0f}s"
            )
        time.sleep(interval_s)


def launch(
    server: SGLangServer,
    sglang_args: Mapping[str, str],
    *,
    env: Mapping[str, str] | None = None,
    startup_deadline_s: float = 900.0,
) -> subprocess.Popen[bytes]:
    """Start the server and return it once healthy; kills it when it does not get there."""
    process = subprocess.Popen(
        build_command(server, sglang_args), env=dict(env) if env is not None else None
    )
    try:
        wait_healthy(
            f"http://{server.host}:{server.port}", deadline_s=startup_deadline_s, process=process
        )
    except BaseException:
        process.kill()
        process.wait(timeout=30)
        raise
    return process
