"""GPU memory in each phase of a colocated step: the trainer offloaded while the engine
generates, the engine's memory released while the trainer trains, then back.

One process holds the trainer of an example job (`MegatronTrainerActor`, or `TorchTrainer`
with `--backend torch` or where megatron-core is missing) and its `hf` engine on the same GPU,
and walks through `--steps` rollout steps as the driver does for `placement: colocated` on
GPUs (`rljob.driver.loop`): `trainer.offload()` before generating, `engine.release_memory()`
before training (the trainer comes back on its first use), `engine.resume_memory()` after,
and the new weights installed. Each phase prints what the device has in use
(`cudaMemGetInfo`, the CUDA context included), what torch has allocated, the bytes the
trainer's and the engine's tensors hold on the GPU and how fast they moved; the anchor for
the moves, a plain copy of the trainer's bytes to pinned host memory and back, ends it.
`--hidden/--layers` grow the example's tiny model so the moves show beside the context's
fixed cost.

    python benchmarks/colocated_memory_gpu.py examples/tiny-megatron-gpu.yaml
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "runtime"))

import torch  # noqa: E402

from rljob.engine.hf_server import HFEngine  # noqa: E402
from rljob.model.offload import device_bytes, module_tensors  # noqa: E402
from rljob.model.tiny_model import write_tiny  # noqa: E402
from rljob.rollout.sample import Sample, Status  # noqa: E402
from rljob.rollout.tasks import load_task  # noqa: E402
from rljob_api.validate import load_job  # noqa: E402

MIB = 1 << 20


def row(phase: str, trainer: Any, engine: HFEngine, peak: int | None = None) -> str:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used, allocated = total - free, torch.cuda.memory_allocated()
    else:
        used = allocated = 0
    engine_bytes = device_bytes(module_tensors([engine.model]))
    text = (f"{phase:<34} device in use {used / MIB:9.1f} MiB | torch allocated "
            f"{allocated / MIB:9.1f} MiB | trainer {trainer.gpu_bytes() / MIB:9.1f} MiB | "
            f"engine {engine_bytes / MIB:9.1f} MiB")
    if peak is not None:
        text += f" | peak allocated {peak / MIB:9.1f} MiB"
    return text


def host_copy_gbs(nbytes: int) -> tuple[float, float]:
    """The anchor for the moves: a plain copy of `nbytes` GPU -> pinned host and back, GB/s
    (best of three, after one to warm up)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = [float("inf"), float("inf")]
    for _ in range(4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        middle = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        end = time.perf_counter()
        best = [min(best[0], middle - start), min(best[1], end - middle)]
    del dev, host
    torch.cuda.empty_cache()
    return nbytes / best[0] / 1e9, nbytes / best[1] / 1e9


def rollout(engine: HFEngine, task: Any, spec: Any, step: int) -> list[Sample]:
    """One rollout step's samples from the engine, rewarded like the driver's worker does."""
    algo, sampling = spec.algorithm, spec.rollout.sampling
    samples = []
    for g in range(algo.rollout_batch_size):
        prompt = task.prompts[(step * algo.rollout_batch_size + g) % len(task.prompts)]
        ids = engine.codec.encode(prompt.prompt)
        params = [{"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                   "sampling_seed": 1000 * step + 10 * g + i}
                  for i in range(algo.n_samples_per_prompt)]
        for i, out in enumerate(engine.generate([ids] * len(params), params)):
            response = out["output_ids"]
            samples.append(Sample(
                prompt=prompt.prompt, label=prompt.label, group_index=g, index=i,
                prompt_tokens=ids, tokens=ids + response, response=out["text"],
                response_length=len(response), loss_mask=[1] * len(response),
                rollout_log_probs=[lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
                reward=task.reward(out["text"], prompt.label), weight_version=str(step),
                status=Status.completed))
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("job", type=Path)
    p.add_argument("--backend", choices=["megatron", "torch"], default=None,
                   help="default: the job's, or torch where megatron-core is missing")
    p.add_argument("--hidden", type=int, default=None, help="grow the tiny model")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    _, spec = load_job(args.job)
    backend = args.backend or str(spec.trainer.backend)
    if backend == "megatron" and importlib.util.find_spec("megatron") is None:
        print("megatron-core is not installed here: the torch backend stands in", flush=True)
        backend = "torch"
    tiny = spec.model.tiny
    if args.hidden:
        tiny = tiny.model_copy(update={"hidden_size": args.hidden,
                                       "intermediate_size": 4 * args.hidden})
    if args.layers:
        tiny = tiny.model_copy(update={"num_layers": args.layers})
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"tiny": tiny})})
    task = load_task(spec.data.dataset)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="colocated-"))
    model_dir = write_tiny(work / "model", tiny, task.alphabet, spec.algorithm.seed,
                           spec.model.dtype)
    spec_json = spec.model_dump_json(by_alias=True)
    if backend == "megatron":
        from rljob.trainer.megatron.actor import MegatronTrainerActor

        trainer: Any = MegatronTrainerActor(spec_json, str(model_dir), 0, 1, "", device)
    else:
        from rljob.trainer.torch.actor import TorchTrainer

        trainer = TorchTrainer(spec_json, str(model_dir), 0, 1, "", device)
    engine = HFEngine(str(model_dir), spec.model.dtype, device, "0")
    params = sum(t.numel() for t in engine.model.parameters())
    print(f"{torch.cuda.get_device_name(0) if device == 'cuda' else 'CPU'}; torch "
          f"{torch.__version__}; {args.job.name}: trainer backend {backend}, tiny model "
          f"hidden {tiny.hidden_size}, {tiny.num_layers} layers, {params / 1e6:.1f} M parameters "
          f"({spec.model.dtype} serving)", flush=True)
    print(row("both loaded (before the first step)", trainer, engine), flush=True)
    for step in range(args.steps):
        start = time.perf_counter()
        moved = trainer.offload()
        took = time.perf_counter() - start
        samples = rollout(engine, task, spec, step)
        print(row(f"step {step}: rollout (trainer off)", trainer, engine)
              + f" | offload {moved / MIB:.1f} MiB in {took * 1e3:.1f} ms "
              f"({moved / max(took, 1e-9) / 1e9:.1f} GB/s)", flush=True)
        start = time.perf_counter()
        released = engine.release_memory()
        took = time.perf_counter() - start
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        back = trainer.on_device()
        took_back = time.perf_counter() - start
        result = trainer.train(samples, step == 0)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        print(row(f"step {step}: training (engine off)", trainer, engine, peak)
              + f" | release {released / MIB:.1f} MiB in {took * 1e3:.1f} ms; trainer back "
              f"{back / MIB:.1f} MiB in {took_back * 1e3:.1f} ms; "
              f"{result.optimizer_steps} optimizer steps", flush=True)
        engine.resume_memory()
        engine.install(trainer.named_weights(), str(step + 1))
        print(row(f"step {step}: engine back, v{step + 1} in", trainer, engine), flush=True)
    served = dict(engine.model.state_dict())
    for name, tensor in trainer.named_weights():
        if name in served and not torch.equal(served[name], tensor.to(served[name].device)):
            raise SystemExit(f"the engine does not serve the trainer's {name} after the moves")
    print(f"the engine serves exactly the trainer's weights after {args.steps} offload round "
          "trips")
    if device == "cuda":
        down, up = host_copy_gbs(trainer.gpu_bytes())
        print(f"anchor, same run: a plain copy of the trainer's bytes GPU -> pinned host "
              f"{down:.1f} GB/s, back {up:.1f} GB/s")


if __name__ == "__main__":
    main()
