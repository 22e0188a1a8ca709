"""A bare engine for the weight-sync benchmarks: named parameter tensors (no model) behind
`/update_weights_from_tensor`, the weight version, `/get_server_info` (one TP rank) and
`/health`, served as the `hf` engine serves them (aiohttp, the install on one worker thread)
and installing as it does (`TensorReceiver` keeps the last handles open, `update_problems`
checks names, shapes, dtypes and finiteness, `copy_into`, a synchronisation), reporting how
long each phase took.

Run as `python benchmarks/weight_sync_engine.py --layout FILE --device cpu|cuda:0 --port-file F`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from rljob.engine.tensor_payload import TensorReceiver, copy_into, update_problems


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", type=Path, required=True, help="JSON {name: [dtype, shape]}")
    p.add_argument("--device", default="cpu")
    p.add_argument("--port-file", type=Path, required=True)
    args = p.parse_args()
    layout = json.loads(args.layout.read_text())
    params = {
        n: torch.zeros(shape, dtype=getattr(torch, dt), device=args.device)
        for n, (dt, shape) in layout.items()
    }
    state = {"version": "0"}
    receiver = TensorReceiver()
    executor = ThreadPoolExecutor(max_workers=1)

    def install(entries: list[str], version: str) -> tuple[bool, str]:
        start = time.perf_counter()
        named = [t for rank in receiver.decode(entries) for t in rank]
        decoded = time.perf_counter()
        problems = update_problems(params, named)
        checked = time.perf_counter()
        if problems:
            return False, "; ".join(problems[:3])
        with torch.no_grad():
            copy_into([params[n] for n, _ in named], [t for _, t in named])
        if args.device != "cpu":
            torch.cuda.synchronize(args.device)
        copied = time.perf_counter()
        state["version"] = version
        # The phases in ms, for the benchmark's breakdown (the check ends in a host sync).
        phases = {"decode": decoded - start, "check": checked - decoded, "copy": copied - checked}
        return True, ", ".join(f"{k} {v * 1e3:.3f}" for k, v in phases.items())

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1})

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": state["version"]})

    async def update(request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        ok, message = await asyncio.get_running_loop().run_in_executor(
            executor, install, body["serialized_named_tensors"], str(body["weight_version"]))
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    app = web.Application(client_max_size=1 << 30)
    app.add_routes([
        web.get("/health", health),
        web.get("/get_server_info", server_info),
        web.get("/get_model_info", model_info),
        web.post("/update_weights_from_tensor", update),
    ])

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(runner.addresses[0][1]))
        tmp.rename(args.port_file)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
