"""The `hf` rollout engine: SGLang's HTTP subset over a transformers model, for CPU runs.

It exists so the loop, the client and the weight updates run for real without SGLang or
a GPU. Generation and weight installs take turns under one lock, so a version is swapped
in whole, between requests, and every response names the version that produced it.
Requests are served one at a time; the rows of one request (SGLang's batch form, which the
rollout worker uses for a group's samples on one engine) are computed as one batch. That
keeps sampling reproducible: a request with a `sampling_seed` per row gives the same tokens
every time, where batching rows of whatever requests happened to arrive together would make
each row's numbers depend on its neighbours.

`POST /abort_request` with `abort_all` (SGLang's, as partial rollout uses it) stops every
generation that arrived before it at its next token; each answers with what it generated
so far and finish_reason `abort`. It counts epochs rather than setting a flag, so requests
that arrive after the abort run normally.

With `--tp-size N` the engine keeps SGLang's weight-update contract for N tensor-parallel
ranks (entry r of `serialized_named_tensors` is what rank r loads; see `install_ranks`), so
the per-rank payload is exercised without GPUs; the model itself runs whole on one device.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from rljob.engine.sglang_release import RELEASE
from rljob.engine.weight_swap import flat_version, stage_version
from rljob.model.dtypes import torch_dtype
from rljob.model.offload import Offload, module_tensors
from rljob.model.text_codec import TextCodec, load_codec
from rljob.weightsync.auth import bearer_middleware, peer_key
from rljob.weightsync.wire import (
    FLATTENED,
    NamedTensors,
    TensorReceiver,
    copy_into,
    update_problems,
)
from rljob_api.layout import ENGINE_PORT


def _frozen(value: Any) -> Any:
    """`value` (JSON) as a hashable key: equal exactly when the JSON values are."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("list", *map(_frozen, value))
    return (type(value).__name__, value)


class UpdateRejected(ValueError):
    """A weight update that does not fit the model; the previous version keeps serving."""


class MemoryReleased(RuntimeError):
    """The engine gave its memory back (a colocated trainer is training)."""


def _filtered_probs(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    probs = torch.softmax(scaled, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(-1, keepdim=True)


class HFEngine:
    """A transformers model that samples with log-probs and installs new weights atomically."""

    def __init__(
        self, model_path: str, dtype: str, device: str, weight_version: str, tp_size: int = 1
    ) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        torch.nn.Module.to(model, self.device)
        self.model: PreTrainedModel = model.eval()
        self.codec: TextCodec = load_codec(Path(model_path))
        self.weight_version = weight_version
        self.lock = threading.Lock()
        self.generated_tokens = 0
        # Bumped by every abort_all; a request remembers the epoch it arrived in and stops
        # when the epoch moves on.
        self.abort_epoch = 0
        self._abort_lock = threading.Lock()
        self.receiver = TensorReceiver()
        # Weights leave the device while a colocated trainer trains (SGLang's release/resume
        # memory occupation); a host copy brings them back as they were.
        self.memory = Offload(self.device.type)

    def info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "is_generation": True, "weight_version": self.weight_version}

    def server_info(self) -> dict[str, Any]:
        """The part of SGLang's `/get_server_info` (its server arguments and `version`) that
        rljob reads. The version is the SGLang release whose HTTP contract this engine keeps,
        which the client checks as it checks a real server's."""
        return {"model_path": self.model_path, "tp_size": self.tp_size,
                "weight_version": self.weight_version, "version": RELEASE}

    def release_memory(self) -> int:
        """Weights to host memory and the last version's handles closed, between requests;
        returns the bytes moved. Generating or installing is refused until resumed."""
        with self.lock:
            self.receiver.release()
            return self.memory.offload(module_tensors([self.model]))

    def resume_memory(self) -> int:
        """The weights back on the device, as they were; returns the bytes moved."""
        with self.lock:
            return self.memory.reload()

    def _check_resident(self) -> None:
        if self.memory.offloaded:
            raise MemoryReleased("the engine's memory is released (a colocated trainer is "
                                 "training); POST /resume_memory_occupation first")

    def abort_all(self) -> int:
        """Stop every generation that arrived before this call, running or queued, at its
        next token (SGLang's `abort_request` with `abort_all`); returns the new epoch. Not
        under `self.lock`: the generation it interrupts holds that."""
        with self._abort_lock:
            self.abort_epoch += 1
            return self.abort_epoch

    @torch.no_grad()
    def generate(
        self, rows: list[list[int]], params: list[dict[str, Any]], epoch: int | None = None
    ) -> list[dict[str, Any]]:
        """Sample every row; `epoch` is the abort epoch the request arrived in (now, if
        None): an abort_all after that stops it between tokens."""
        arrived = self.abort_epoch if epoch is None else epoch
        with self.lock:
            self._check_resident()
            version = self.weight_version
            out: list[dict[str, Any]] = [{} for _ in rows]
            # Rows computed together share their length (no padding) and every sampling
            # parameter but the seed (`_generate_same_length` reads the first row's).
            batches: dict[tuple[Any, ...], list[int]] = {}
            for i, (row, p) in enumerate(zip(rows, params, strict=True)):
                rest = _frozen({k: v for k, v in p.items() if k != "sampling_seed"})
                batches.setdefault((len(row), rest), []).append(i)
            for indices in batches.values():
                results = self._generate_same_length([rows[i] for i in indices],
                                                     [params[i] for i in indices], arrived)
                for i, result in zip(indices, results, strict=True):
                    result["meta_info"]["weight_version"] = version
                    out[i] = result
            return out

    def _generate_same_length(
        self, rows: list[list[int]], params: list[dict[str, Any]], epoch: int
    ) -> list[dict[str, Any]]:
        p0 = params[0]
        max_new = int(p0.get("max_new_tokens", 128))
        temperature = float(p0.get("temperature", 1.0))
        top_k = int(p0.get("top_k", -1))
        top_p = float(p0.get("top_p", 1.0))
        stop_ids = {int(t) for t in p0.get("stop_token_ids") or []}
        if not p0.get("ignore_eos", False):
            stop_ids.add(self.codec.eos_id)
        stops = [s for s in (p0.get("stop") or []) if s]
        generators = []
        for i, p in enumerate(params):
            g = torch.Generator(device=self.device)
            seed = p.get("sampling_seed")
            g.manual_seed(int(seed) if seed is not None else torch.seed() + i)
            generators.append(g)
        outputs: list[list[int]] = [[] for _ in rows]
        logps: list[list[float]] = [[] for _ in rows]
        finish: list[dict[str, Any] | None] = [None] * len(rows)
        abort = {"type": "abort", "message": "aborted by /abort_request"}
        if self.abort_epoch != epoch:  # aborted while it waited for its turn
            return self._results(rows, outputs, logps, [dict(abort) for _ in rows])
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        step = self.model(input_ids=ids, use_cache=True)
        logits = step.logits[:, -1].float()
        for _ in range(max_new):
            if self.abort_epoch != epoch:
                finish = [f or dict(abort) for f in finish]
                break
            if not torch.isfinite(logits).all():
                raise FloatingPointError("the model produced non-finite logits")
            if temperature > 0:
                scaled = logits / temperature
                logp_all = torch.log_softmax(scaled, dim=-1)
                probs = _filtered_probs(scaled, top_k, top_p)
                chosen = [int(torch.multinomial(probs[i], 1, generator=generators[i]))
                          for i in range(len(rows))]
            else:
                logp_all = torch.log_softmax(logits, dim=-1)
                chosen = [int(t) for t in logits.argmax(-1)]
            for i, token in enumerate(chosen):
                if finish[i] is not None:
                    continue
                outputs[i].append(token)
                logps[i].append(float(logp_all[i, token]))
                if token in stop_ids:
                    finish[i] = {"type": "stop", "matched": token}
                elif stops:
                    text = self.codec.decode(outputs[i])
                    hit = next((s for s in stops if text.endswith(s)), None)
                    if hit is not None:
                        finish[i] = {"type": "stop", "matched": hit}
            if all(f is not None for f in finish):
                break
            nxt = torch.tensor(chosen, dtype=torch.long, device=self.device).unsqueeze(1)
            step = self.model(input_ids=nxt, past_key_values=step.past_key_values, use_cache=True)
            logits = step.logits[:, -1].float()
        return self._results(rows, outputs, logps, finish)

    def _results(
        self, rows: list[list[int]], outputs: list[list[int]], logps: list[list[float]],
        finish: list[dict[str, Any] | None],
    ) -> list[dict[str, Any]]:
        """SGLang's answer per row; an aborted row keeps the tokens it got."""
        results = []
        for i, row in enumerate(rows):
            text = self.codec.decode(outputs[i])
            reason = finish[i] or {"type": "length", "length": len(outputs[i])}
            if isinstance(reason.get("matched"), str):
                text = text[: len(text) - len(reason["matched"])]
            self.generated_tokens += len(outputs[i])
            results.append({
                "text": text,
                "output_ids": outputs[i],
                "meta_info": {
                    "output_token_logprobs": [[lp, t, None]
                                              for lp, t in zip(logps[i], outputs[i], strict=True)],
                    "finish_reason": reason,
                    "prompt_tokens": len(row),
                    "completion_tokens": len(outputs[i]),
                },
            })
        return results

    def targets(self) -> dict[str, torch.Tensor]:
        """What the model computes with, by HF name (the state dict's names; tied names
        share one parameter): what a version's tensors are copied into, or repointed at.
        Looked up at every install, so a parameter replaced since
        (`load_state_dict(assign=True)`) is the one used."""
        return dict(self.model.state_dict(keep_vars=True))

    def install(self, named: NamedTensors, version: str) -> None:
        """One set of full tensors that every rank loads (what a disk update is)."""
        self.install_ranks([named] * self.tp_size, version)

    def install_ranks(self, per_rank: list[NamedTensors], version: str) -> None:
        """Install a version sent as SGLang's TP ranks receive it: rank r loads `per_rank[r]`.

        Each rank's entry holds full HF-named tensors, and rank r copies in only its own
        shard (the r-th of `tp_size` row blocks, as a column-parallel SGLang layer keeps its
        rows), so the model is whole only when every rank got the version: a payload built
        for fewer ranks, or ranks given different tensors, shows in the weights or is refused
        here. Every rank's tensors are checked first; on any problem nothing changes. A
        one-rank version in one flat buffer is copied and checked in one pass beside the
        served weights, then switched to (`weight_swap.stage_version`).
        """
        self._check_resident()
        if len(per_rank) != self.tp_size:
            raise UpdateRejected(
                f"serialized_named_tensors has {len(per_rank)} entries for {self.tp_size} "
                "tensor-parallel ranks; SGLang gives rank r entry r, so send one per rank")
        names = [name for name, _ in per_rank[0]]
        if not names:
            raise UpdateRejected("no tensors sent")
        targets = self.targets()
        flat = flat_version(targets, per_rank[0]) if self.tp_size == 1 else None
        if flat is not None:
            with self.lock:
                self._check_resident()
                self._swap_in(targets, per_rank[0], flat, version)
            return
        problems = []
        for rank, named in enumerate(per_rank):
            if [name for name, _ in named] != names:
                problems.append(f"rank {rank} was sent other tensors than rank 0")
            problems += [f"rank {rank}: {p}" for p in update_problems(targets, named)]
        if problems:
            raise UpdateRejected("; ".join(problems[:8]))
        owns = [targets[name].tensor_split(self.tp_size)[rank]
                for rank, named in enumerate(per_rank) for name, _ in named]
        shards = [tensor.tensor_split(self.tp_size)[rank]
                  for rank, named in enumerate(per_rank) for _, tensor in named]
        with self.lock, torch.no_grad():
            self._check_resident()
            # Finished before the answer, so the sender may reuse its buffers once it reads it.
            copy_into(owns, shards)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.weight_version = version

    def _swap_in(self, targets: dict[str, torch.Tensor], named: NamedTensors,
                 flat: torch.Tensor, version: str) -> None:
        staged = stage_version(targets, named, flat)
        if staged.problems:
            raise UpdateRejected("; ".join(staged.problems[:8]))
        staged.switch()
        self.weight_version = version

    def install_entries(self, entries: list[str], version: str) -> None:
        """Install `serialized_named_tensors` (entry r for rank r), either format. Refused
        before decoding while the memory is released: decoding maps the sender's memory,
        which would then stay mapped through the trainer's turn."""
        self._check_resident()
        self.install_ranks(self.receiver.decode(entries), version)

    def weights_by_name(self, name: str, truncate_size: int) -> list[Any]:
        """The first `truncate_size` rows of parameter `name` as float32 nested lists.

        SGLang's `/get_weights_by_name` answer; float32 holds every value of the serving
        dtypes exactly, so a reader can compare bit for bit.
        """
        with self.lock:
            self._check_resident()
            current = self.model.state_dict()
            if name not in current:
                raise UpdateRejected(f"{name}: not a parameter of this model")
            value: list[Any] = current[name][:truncate_size].detach().float().cpu().tolist()
        return value

    def install_from_disk(self, directory: str, version: str) -> None:
        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise UpdateRejected(f"{directory} holds no .safetensors files")
        named: NamedTensors = []
        for f in files:
            named += list(load_file(str(f)).items())
        self.install(named, version)


def build_app(engine: HFEngine, api_key: str) -> web.Application:
    """The aiohttp application; model work runs on one worker thread, off the event loop.

    Every route but /health requires `Authorization: Bearer <api_key>` (SGLang's
    `--api-key`): a request without it is answered 401 before its body is read, so a
    weight update from outside the job is never unpickled (`rljob.weightsync.auth`)."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
    running = asyncio.Event()
    running.set()

    async def run(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response(engine.info())

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response(engine.server_info())

    async def weight_version(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": engine.weight_version})

    async def json_body(request: web.Request, expected: str) -> Any:
        """The request's JSON body ({} when it has none), or a 400 answer naming what was
        expected: a body that does not parse is the caller's mistake, not the engine's."""
        if not request.can_read_body:
            return {}
        try:
            return await request.json()
        except ValueError as err:  # json.JSONDecodeError, or a body that is not UTF-8
            return web.json_response(
                {"error": f"the body is not JSON ({err}): send {expected}"}, status=400)

    async def generate(request: web.Request) -> web.Response:
        epoch = engine.abort_epoch  # an abort_all from now on stops this request
        body = await json_body(request, '{"input_ids": [...], "sampling_params": {...}}')
        if isinstance(body, web.Response):
            return body
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object with input_ids"},
                                     status=400)
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return web.json_response({"error": "input_ids must be a non-empty list"}, status=400)
        single = not isinstance(ids[0], list)
        rows: list[list[int]] = [ids] if single else ids
        params = body.get("sampling_params") or {}
        per_row = params if isinstance(params, list) else [params] * len(rows)
        if len(per_row) != len(rows):
            return web.json_response({"error": "one sampling_params per prompt"}, status=400)
        await running.wait()
        try:
            out = await run(engine.generate, rows, per_row, epoch)
        except FloatingPointError as err:
            return web.json_response({"error": str(err)}, status=500)
        except MemoryReleased as err:
            return web.json_response({"error": str(err)}, status=503)
        return web.json_response(out[0] if single else out)

    async def abort_request(request: web.Request) -> web.Response:
        # SGLang 0.5.3's contract: AbortReq {rid, abort_all}, answered 200 with no body.
        # This engine names no requests, so only abort_all is served. Not on the executor:
        # the generation it stops holds it.
        expected = ('SGLang\'s AbortReq, {"abort_all": true} or {"rid": ...}; this engine '
                    'names no requests, so send {"abort_all": true}')
        body = await json_body(request, expected)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body, dict) or body.get("abort_all") is not True:
            return web.json_response(
                {"error": f"this engine aborts all requests only: send {expected}"},
                status=400)
        engine.abort_all()
        return web.Response(status=200)

    async def pause(_: web.Request) -> web.Response:
        # SGLang's pause: every request held is aborted (answering with what it got), and
        # new ones wait for continue_generation.
        running.clear()
        engine.abort_all()
        return web.json_response({"message": "Generation paused successfully.",
                                  "status": "ok"})

    async def resume(_: web.Request) -> web.Response:
        running.set()
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def flush(_: web.Request) -> web.Response:
        # No prefix cache survives a request here, so there is nothing to drop.
        return web.json_response({"success": True, "message": "nothing cached"})

    async def update_tensor(request: web.Request) -> web.Response:
        body = await request.json()
        version = str(body.get("weight_version", engine.weight_version))
        entries = body.get("serialized_named_tensors")
        try:
            if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
                raise UpdateRejected("serialized_named_tensors must be a list of strings, "
                                     "one per tensor-parallel rank")
            if body.get("load_format") not in (None, FLATTENED):
                raise UpdateRejected(f"load_format {body['load_format']!r}: this engine reads "
                                     f"named tensors or {FLATTENED!r}")
            await run(engine.install_entries, entries, version)
        except (UpdateRejected, ValueError, OSError, RuntimeError) as err:
            return web.json_response({"success": False, "message": str(err)})
        return web.json_response({"success": True, "message": f"installed {version}"})

    async def release_memory(_: web.Request) -> web.Response:
        # Every tag SGLang knows is covered by the weights: this engine keeps no KV cache or
        # CUDA graph between requests.
        moved = await run(engine.release_memory)
        return web.json_response({"success": True, "message": f"released {moved} bytes"})

    async def resume_memory(_: web.Request) -> web.Response:
        moved = await run(engine.resume_memory)
        return web.json_response({"success": True, "message": f"resumed {moved} bytes"})

    async def update_disk(request: web.Request) -> web.Response:
        body = await request.json()
        version = str(body.get("weight_version", engine.weight_version))
        try:
            await run(engine.install_from_disk, str(body["model_path"]), version)
        except (UpdateRejected, KeyError, OSError, RuntimeError) as err:
            return web.json_response({"success": False, "message": str(err)})
        return web.json_response({"success": True, "message": f"installed {version}"})

    async def weights_by_name(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            value = await run(engine.weights_by_name, str(body["name"]),
                              int(body.get("truncate_size", 100)))
        except (UpdateRejected, KeyError, ValueError, MemoryReleased) as err:
            return web.json_response({"success": False, "message": str(err)}, status=400)
        return web.json_response(value)

    app = web.Application(client_max_size=1 << 30, middlewares=[bearer_middleware(api_key)])
    app.add_routes([
        web.get("/health", health),
        web.get("/get_model_info", model_info),
        web.get("/get_server_info", server_info),
        web.get("/get_weight_version", weight_version),
        web.post("/generate", generate),
        web.post("/abort_request", abort_request),
        web.post("/pause_generation", pause),
        web.post("/continue_generation", resume),
        web.post("/flush_cache", flush),
        web.post("/update_weights_from_tensor", update_tensor),
        web.post("/update_weights_from_disk", update_disk),
        web.post("/release_memory_occupation", release_memory),
        web.post("/resume_memory_occupation", resume_memory),
        web.post("/get_weights_by_name", weights_by_name),
    ])
    app.on_cleanup.append(lambda _: asyncio.to_thread(executor.shutdown))
    return app


class ServerThread:
    """The engine's HTTP server on a background thread of the calling process."""

    def __init__(self, engine: HFEngine, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None) -> None:
        """`api_key`: what requests must carry (default: the job's `peer_key()`)."""
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(build_app(engine, peer_key() if api_key is None
                                              else api_key))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        # Set up on the server's own loop: the caller may already run one (Ray actors do).
        self.port = asyncio.run_coroutine_threadsafe(self._start(host, port), self.loop).result(60)
        self.url = f"http://{host}:{self.port}"

    async def _start(self, host: str, port: int) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        return int(self.runner.addresses[0][1])

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


async def _serve(engine: HFEngine, host: str, port: int, api_key: str) -> None:
    runner = web.AppRunner(build_app(engine, api_key))
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    # The bound port, so `--port 0` callers learn where to connect.
    print(f"hf engine serving on http://{host}:{runner.addresses[0][1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="rljob's hf rollout engine (SGLang HTTP subset)")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=ENGINE_PORT, help="0 picks a free port")
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor-parallel ranks whose weight-update contract to keep")
    args = parser.parse_args(argv)
    engine = HFEngine(args.model_path, args.dtype, args.device, args.weight_version,
                      args.tp_size)
    # The key from the environment, never from the command line (which `ps` shows).
    asyncio.run(_serve(engine, args.host, args.port, peer_key()))


if __name__ == "__main__":
    main()
