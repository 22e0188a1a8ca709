"""A bare engine for the weight-sync benchmarks: named parameter tensors (no model) behind
`/update_weights_from_tensor`, the weight version, `/get_server_info` (one TP rank, and the
SGLang release whose contract the `hf` engine keeps, which the client checks) and `/health`,
served as the `hf` engine serves them (aiohttp; the install on one worker thread) and
installing with the same code (`TensorReceiver` keeps the last handles open;
`weight_swap.stage_version` checks names, shapes and dtypes, copies the flat version beside
the served tensors with its NaN/Inf check in the same pass, synchronises, and switches the
tensors to it), reporting how long each phase took. What it leaves out, having no model and
no generation: the engine's lock, its memory-released check and the look-up of its
parameters (`HFEngine.targets`) at every version.

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
from rljob.engine.sglang_release import RELEASE
from rljob.engine.weight_swap import flat_version, stage_version
from rljob.weightsync.wire import TensorReceiver


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

    def install(entries: list[str], version: str, arrived: float) -> tuple[bool, str]:
        start = time.perf_counter()
        decoded_entries = receiver.decode(entries)
        unpickled = time.perf_counter()
        named = [t for rank in decoded_entries for t in rank]
        flat = flat_version(params, named)
        if flat is None:
            return False, "the benchmark sends one flat version"
        decoded = time.perf_counter()
        version_in = stage_version(params, named, flat)
        staged = time.perf_counter()
        if version_in.problems:
            return False, "; ".join(version_in.problems[:3])
        version_in.switch()
        state["version"] = version
        done = time.perf_counter()
        # The phases in ms, for the benchmark's breakdown (staging ends in a host sync);
        # `arrived` and `installed` are this machine's monotonic clock (time.perf_counter),
        # which the sender shares, so it can time the request's way in and the answer's way
        # back.
        phases = {"the body, to the install thread": start - arrived,
                  "unpickle, a view a tensor": unpickled - start,
                  "finding the flat buffer": decoded - unpickled,
                  "copy and check": staged - decoded, "switch": done - staged}
        return True, json.dumps({"phases": {k: v * 1e3 for k, v in phases.items()},
                                 "arrived": arrived, "installed": done})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1, "version": RELEASE})

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": state["version"]})

    async def update(request: web.Request) -> web.Response:
        arrived = time.perf_counter()
        body: dict[str, Any] = await request.json()
        ok, message = await asyncio.get_running_loop().run_in_executor(
            executor, install, body["serialized_named_tensors"], str(body["weight_version"]),
            arrived)
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
