"""A small rollout engine for the weight-sync tests: a real transformers model behind the
engine HTTP contract's weight endpoints (install from tensors or disk, report the version,
generate greedily with that version, read parameters back by name).

Installs are atomic: the whole update is checked (names, shapes, dtypes, finite values)
before any parameter changes, and generation holds the same lock as the swap.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from rljob.weightsync.tensor_payload import decode_named_tensors, update_problems
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 48


def tiny_model(seed: int) -> Qwen2ForCausalLM:
    """The test architecture; different seeds give different (random) weights."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).eval()


class Engine:
    def __init__(self, seed: int) -> None:
        self.model = tiny_model(seed)
        self.params = dict(self.model.named_parameters())
        self.version = "0"
        self.lock = threading.Lock()

    def install(self, named: list[tuple[str, torch.Tensor]], version: str) -> tuple[bool, str]:
        problems = update_problems(self.params, named)
        if problems:
            return False, "; ".join(problems[:5])
        with self.lock, torch.no_grad():
            for name, tensor in named:
                self.params[name].copy_(tensor)
            self.version = version
        return True, f"installed version {version}"

    def generate(self, input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        with self.lock, torch.no_grad():
            ids = list(input_ids)
            logprobs = []
            for _ in range(max_new_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                lp = torch.log_softmax(logits.float(), -1)
                token = int(lp.argmax())
                logprobs.append([float(lp[token]), token, None])
                ids.append(token)
            version = self.version
        out = ids[len(input_ids) :]
        return {
            "text": "",
            "output_ids": out,
            "meta_info": {
                "output_token_logprobs": logprobs,
                "finish_reason": {"type": "length"},
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(out),
                "weight_version": version,
            },
        }


def serve(engine: Engine, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
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
            elif self.path == "/get_weight_version":
                self._send(200, {"weight_version": engine.version})
            elif self.path == "/get_model_info":
                self._send(
                    200,
                    {"model_path": "tiny", "is_generation": True, "weight_version": engine.version},
                )
            else:
                self._send(404, {"message": self.path})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/update_weights_from_tensor":
                named = [
                    nt for e in body["serialized_named_tensors"] for nt in decode_named_tensors(e)
                ]
                ok, msg = engine.install(named, str(body["weight_version"]))
                self._send(200 if ok else 400, {"success": ok, "message": msg})
            elif self.path == "/update_weights_from_disk":
                named = [
                    nt
                    for f in sorted(Path(body["model_path"]).glob("*.safetensors"))
                    for nt in load_file(str(f)).items()
                ]
                ok, msg = engine.install(named, str(body["weight_version"]))
                self._send(200 if ok else 400, {"success": ok, "message": msg})
            elif self.path == "/get_weights_by_name":
                with engine.lock:
                    values = engine.params[body["name"]].detach().reshape(-1).tolist()
                self._send(200, values)
            elif self.path == "/generate":
                self._send(
                    200,
                    engine.generate(
                        body["input_ids"], int(body["sampling_params"]["max_new_tokens"])
                    ),
                )
            elif self.path in ("/pause_generation", "/continue_generation", "/flush_cache"):
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"message": self.path})

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    server = serve(Engine(args.seed), 0)
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.rename(args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
