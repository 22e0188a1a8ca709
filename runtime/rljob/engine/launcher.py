"""Starts one rollout engine inside a Ray actor: the built-in hf server or SGLang."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

from rljob import metrics
from rljob.engine.client import EngineClient
from rljob.engine.hf_server import HFEngine, ServerThread

STARTUP_TIMEOUT_S = 900.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def sglang_command(
    model_dir: str, host: str, port: int, dtype: str, tp: int, args: dict[str, str]
) -> list[str]:
    """`python -m sglang.launch_server` with rljob's wiring and the user's passed-through args."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir,
           "--host", host, "--port", str(port), "--tp-size", str(tp), "--dtype", dtype]
    for key, value in args.items():
        cmd.append(f"--{key}")
        if value != "true":
            cmd.append(value)
    return cmd


class EngineProcess:
    def __init__(
        self, backend: str, model_dir: str, dtype: str, device: str, weight_version: str,
        tp: int, sglang_args: dict[str, str], host: str,
    ) -> None:
        self.server: ServerThread | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        if backend == "hf":
            self.server = ServerThread(HFEngine(model_dir, dtype, device, weight_version), host)
            self.url = self.server.url
        else:
            port = _free_port(host)
            self.proc = subprocess.Popen(
                sglang_command(model_dir, host, port, dtype, tp, sglang_args), env=os.environ)
            self.url = f"http://{host}:{port}"
            asyncio.run(self._wait())
        self.metrics_port = metrics.serve()

    async def _wait(self) -> None:
        async with EngineClient(self.url) as client:
            await client.wait_healthy(STARTUP_TIMEOUT_S)

    def address(self) -> str:
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
