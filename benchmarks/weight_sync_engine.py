"""A bare engine for the weight-sync benchmarks: named parameter tensors (no model) behind
`/update_weights_from_tensor`, the weight version, `/get_server_info` (one TP rank) and
`/health`, installing as the `hf` engine does (`TensorReceiver` keeps the last handles open,
`update_problems` checks names, shapes, dtypes and finiteness, one multi-tensor copy, a
synchronisation) and reporting how long each phase took. HTTP/1.1, so a client keeps its
connection, as SGLang's server and the `hf` engine's allow.

Run as `python benchmarks/weight_sync_engine.py --layout FILE --device cpu|cuda:0 --port-file F`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from rljob.weightsync.tensor_payload import TensorReceiver, update_problems


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

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out as two writes: with Nagle's algorithm the second waits
        # for the client's delayed ACK (40 ms) on a kept connection.
        disable_nagle_algorithm = True

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/get_server_info":
                self._send(200, {"tp_size": 1})
            else:  # /get_model_info, and /get_weight_version of older clients
                self._send(200, {"weight_version": state["version"]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            start = time.perf_counter()
            named = [t for rank in receiver.decode(body["serialized_named_tensors"]) for t in rank]
            decoded = time.perf_counter()
            problems = update_problems(params, named)
            checked = time.perf_counter()
            if problems:
                self._send(400, {"success": False, "message": "; ".join(problems[:3])})
                return
            with torch.no_grad():
                torch._foreach_copy_([params[n] for n, _ in named], [t for _, t in named])
            if args.device != "cpu":
                torch.cuda.synchronize(args.device)
            copied = time.perf_counter()
            del named
            state["version"] = str(body["weight_version"])
            # The phases in ms, for the benchmark's breakdown (the check ends in a host sync).
            phases = {"decode": decoded - start, "check": checked - decoded,
                      "copy": copied - checked}
            message = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in phases.items())
            self._send(200, {"success": True, "message": message})

        def log_message(self, format: str, *a: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.rename(args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
