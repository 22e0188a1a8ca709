"""The SGLang backend: build the server command line, start it, wait until it serves.

Every `spec.rollout.sglangArgs` entry passes through as `--key value` (`"true"` becomes a
bare flag, `"false"` leaves the flag off). The arguments that wire the server into rljob
(host, port, model path, tensor-parallel size = gpusPerEngine, NCCL port, base GPU id, ...)
are set here; a user value for one of them is refused, as the API server already does at
admission (`rljob_api.rules.RESERVED_SGLANG_ARGS`).

Targets the HTTP API of SGLang 0.5.3, the version the rollout image pins (and the releases
up to `sglang_release.NEWEST_CHECKED`; a server outside them is refused at connect)
(`sglang.launch_server`, `/health`, `/get_model_info`, `/get_server_info`,
`/update_weights_from_tensor` with one entry per TP rank, `/update_weights_from_disk`,
`/pause_generation`, `/continue_generation`); see docs/weight-sync.md.

The server's lifetime is its actor's (`spawn`, `stop`). The server holds a fixed port and
GPUs, so one that outlives its actor (ray.kill, SIGKILL, the OOM killer) makes the next
attempt in the same pod fail to start. Two mechanisms, because each covers what the other
cannot:
- the parent-death signal (`rljob.engine.die_with_parent`): the kernel SIGKILLs the server
  when the actor process dies, however it dies. It reaches the server only, not the
  scheduler, detokenizer and TP worker processes SGLang starts; those arm the same signal
  against the server themselves (SGLang's `kill_itself_when_parent_died`).
- a session (and process group) of the server's own: `stop` signals the whole group, so a
  clean stop reaches every process SGLang started, whatever it does on SIGTERM.
Ray's own reaping is not used. In the Ray this project allows (2.52 to 2.60; the images pin 2.60.0)
`RAY_kill_child_processes_on_worker_exit` (on by default) runs only when the worker exits
cleanly, not on SIGKILL; `RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper`
(off by default, deprecated) and `RAY_process_group_cleanup_enabled` (off by default) work
only when set in the raylet's environment before the node starts, which the embedded
`rljob run` Ray and every KubeRay pod would each have to do; and process-group cleanup
cannot reach a server that has a session of its own, which the clean stop needs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from rljob.engine.client import EngineClient
from rljob.engine.sglang_release import RELEASE
from rljob_api.rules import RESERVED_SGLANG_ARGS

SGLANG_VERSION = RELEASE
# Owned by rljob as well, though admission does not list it: the sidecar sets versions.
OWNED_SGLANG_ARGS = (*RESERVED_SGLANG_ARGS, "weight-version")


# A clean stop waits this long for the group to exit on SIGTERM before it SIGKILLs the group.
STOP_GRACE_S = 60.0


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
    # The job's peer key (`rljob.weightsync.auth`): SGLang's --api-key, which makes every
    # route but /health and /metrics require `Authorization: Bearer <key>`. Kept out of reprs.
    api_key: str = field(default="", repr=False)


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
    if not server.api_key:
        # Without --api-key SGLang serves every route, the weight updates that unpickle their
        # bodies included, to whoever connects: an engine never starts that way.
        raise ValueError("an SGLang engine needs the job's peer key (SGLangServer.api_key)")
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
        "api-key": server.api_key,
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


def spawn(argv: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `argv` tied to this process: SIGKILLed when it dies, in a session of its own.

    The returned process's pid is `argv`'s own (the wrapper execs into it) and its process
    group id."""
    return subprocess.Popen(
        [sys.executable, "-m", "rljob.engine.die_with_parent", str(os.getpid()), "--", *argv],
        env=dict(env) if env is not None else None,
        start_new_session=True,
    )


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # no process of the group is left
        os.killpg(process.pid, sig)


def stop(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """Stop the server and every process it started: SIGTERM to its group, SIGKILL to the
    group after `grace_s`, and SIGKILL once more for any child that outlived the server."""
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait(timeout=30)
    _signal_group(process, signal.SIGKILL)


def start(
    argv: list[str],
    base_url: str,
    *,
    env: Mapping[str, str] | None = None,
    startup_deadline_s: float = 900.0,
) -> subprocess.Popen[bytes]:
    """`spawn` the server and return it once `base_url` is healthy; kills its group when it
    does not get there."""
    process = spawn(argv, env)
    try:
        wait_healthy(base_url, deadline_s=startup_deadline_s, process=process)
    except BaseException:
        stop(process, grace_s=0)
        raise
    return process


def launch(
    server: SGLangServer,
    sglang_args: Mapping[str, str],
    *,
    env: Mapping[str, str] | None = None,
    startup_deadline_s: float = 900.0,
) -> subprocess.Popen[bytes]:
    """Start the SGLang server and return it once healthy; kills it when it does not get
    there."""
    if server.memory_saver and server.python == sys.executable:
        require_memory_saver()
    process = start(build_command(server, sglang_args), f"http://{server.host}:{server.port}",
                    env=env, startup_deadline_s=startup_deadline_s)
    try:
        EngineClient(f"http://{server.host}:{server.port}",
                     api_key=server.api_key).check_version()
    except BaseException:
        stop(process, grace_s=0)
        raise
    return process


def require_memory_saver() -> None:
    """Refuse to start a colocated engine whose Python lacks torch_memory_saver. SGLang
    started with --enable-memory-saver without it dies in its scheduler processes with an
    ImportError in its log (and without the flag, `/release_memory_occupation` frees
    nothing and the trainer runs out of memory on its first step); refused here first,
    saying what is missing."""
    if importlib.util.find_spec("torch_memory_saver") is None:
        raise EngineStartError(
            "placement colocated: the engines release their GPU memory while the trainer "
            "trains, which SGLang does with torch_memory_saver, and this image has none; "
            "use an image built from images/Dockerfile (ROLE=colocated or rollout) or add "
            "the torch_memory_saver that your SGLang release pins")
