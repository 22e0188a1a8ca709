"""A few real RL steps of a ~1B-parameter Llama-style policy on one GPU with the megatron backend.

Each RL step = old-policy log-probs and the frozen reference policy's log-probs (two forward
passes; `--kl-coef 0` leaves the reference out) + one optimizer step (forward, backward,
distributed Adam) with the shared clipped policy loss and its KL term, GRPO advantages from
random rewards.
Prints the step time and model FLOPs utilisation against `--peak-tflops` (bf16 dense matmul
rate measured on an H200 here: ~790 TFLOP/s). Model FLOPs count the matmuls of the model once
(3x forward for a training pass), causal attention at half the square, and the output
projection for response tokens only; recomputation is not counted.

`--smoke` takes a 2.5M-parameter model of the same architecture, short sequences and two steps:
the whole path in seconds (hack/gpu-test runs it). `--plan-only` stops before anything needs
megatron-core or a GPU: it prints the model's size, the tokens and the model FLOPs of one step,
which is all of the benchmark that runs on a machine without them (CI runs it that way).

Run: python3 benchmarks/megatron_step_gpu.py [--out DIR] [--smoke] [--plan-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from rljob.algo.advantages import group_normalized
from rljob.trainer.megatron.shape import ModelShape

if TYPE_CHECKING:
    from rljob.trainer.megatron.training import PolicyMicroBatch

CONFIG_1B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 151_936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
}
# `--smoke`: the same architecture, small enough that a step takes milliseconds.
CONFIG_SMOKE: dict[str, Any] = {**CONFIG_1B, "vocab_size": 4096, "hidden_size": 256,
                                "intermediate_size": 704, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2}


def train_flops(shape: ModelShape, micro_batches: list[tuple[int, int, int]]) -> float:
    """Model FLOPs of a training pass over micro-batches given as (sequences, sequence
    length, response tokens)."""
    h, layers = shape.hidden_size, shape.num_layers
    d = shape.head_dim
    linear = layers * (
        h * d * (shape.num_attention_heads + 2 * shape.num_query_groups)
        + shape.num_attention_heads * d * h
        + 3 * h * shape.ffn_hidden_size
    )
    fwd = 0.0
    for b, s, responses in micro_batches:
        fwd += 2.0 * linear * b * s
        fwd += layers * b * 2.0 * s * s * shape.num_attention_heads * d  # QK^T + AV, causal
        fwd += 2.0 * h * shape.vocab_size * responses
    return 3.0 * fwd


def sizes(batches: list[PolicyMicroBatch]) -> list[tuple[int, int, int]]:
    """What `train_flops` counts of each micro-batch."""
    return [(*mb.tokens.shape, sum(mb.response_lengths)) for mb in batches]


def make_batches(
    n_micro: int, micro: int, prompt: int, response: int, group: int, vocab: int, seed: int
) -> list[PolicyMicroBatch]:
    from rljob.trainer.megatron.training import PolicyMicroBatch

    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(n_micro * micro, generator=g)
    adv = group_normalized(rewards, group).view(n_micro, micro)
    out = []
    for i in range(n_micro):
        tokens = torch.randint(0, vocab, (micro, prompt + response), generator=g)
        out.append(
            PolicyMicroBatch(
                tokens=tokens.pin_memory(),
                prompt_lengths=[prompt] * micro,
                response_lengths=[response] * micro,
                loss_mask=torch.ones(micro, response),
                old_logp=torch.zeros(micro, response),
                advantages=adv[i][:, None].expand(micro, response).contiguous(),
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4, help="RL steps; the first is warm-up")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=1792)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO)")
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    parser.add_argument("--kl-coef", type=float, default=0.01,
                        help="KL to the frozen reference (0: no reference forward)")
    parser.add_argument("--cublas-logits", action="store_true",
                        help="the log-prob head's cuBLAS path instead of its TMA kernels")
    parser.add_argument("--megatron-arg", action="append", default=[])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="a 2.5M-parameter model, 2 micro-batches of 2 x (32 + 96) tokens, "
                             "2 steps")
    parser.add_argument("--plan-only", action="store_true",
                        help="print the model's size and a step's tokens and FLOPs, then stop "
                             "(needs neither megatron-core nor a GPU)")
    args = parser.parse_args()
    config = CONFIG_1B
    if args.smoke:
        config = CONFIG_SMOKE
        args.steps, args.micro_batch, args.micro_batches = 2, 2, 2
        args.prompt, args.response, args.group = 32, 96, 2
    shape = ModelShape.from_hf(config)
    step_flops = train_flops(
        shape, [(args.micro_batch, args.prompt + args.response,
                 args.micro_batch * args.response)] * args.micro_batches)
    print(f"plan: {shape.num_parameters() / 1e6:.1f}M params, "
          f"{args.micro_batches * args.micro_batch * (args.prompt + args.response)} "
          f"tokens/step, {step_flops / 1e12:.3f} TFLOP a training pass", flush=True)
    if args.plan_only:
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (--plan-only runs without one)")
    from rljob.trainer.megatron.training import MegatronTrainer, PolicyLossConfig, init_parallel

    if args.cublas_logits:
        import rljob.kernels.logprobs_fused as lf

        lf._USE_TMA = False
    init_parallel(1, 1, 1, seed=0)
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_config)
    weights = {
        k: v.to(torch.bfloat16) for k, v in hf.state_dict().items() if k != "lm_head.weight"
    }
    trainer = MegatronTrainer(
        shape,
        weights,
        dtype=torch.bfloat16,
        lr=1e-6,
        weight_decay=0.0,
        max_grad_norm=1.0,
        loss=PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=args.kl_coef,
                              entropy_coef=0.0),
        megatron_args=args.megatron_arg,
    )
    reference = trainer.frozen_copy(weights) if args.kl_coef > 0 else None
    del hf, weights
    torch.cuda.empty_cache()

    records = []
    for step in range(args.steps):
        batches = make_batches(
            args.micro_batches, args.micro_batch, args.prompt, args.response, args.group,
            shape.vocab_size, seed=step,
        )
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        old = trainer.logprobs(batches)
        for mb, lp in zip(batches, old, strict=True):
            mb.old_logp = lp.cpu()
        if reference is not None:
            for mb, lp in zip(batches, trainer.logprobs(batches, model=reference), strict=True):
                mb.ref_logp = lp.cpu()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        metrics = trainer.train_step(batches)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        flops = train_flops(shape, sizes(batches))
        forwards = 1 if reference is None else 2  # old policy, reference
        rec = {
            "step": step,
            "logprob_s": t1 - t0,
            "train_s": t2 - t1,
            "rl_step_s": t2 - t0,
            "train_mfu": flops / (t2 - t1) / (args.peak_tflops * 1e12),
            "rl_step_mfu": (flops + forwards * flops / 3) / (t2 - t0)
            / (args.peak_tflops * 1e12),
            "tokens": sum(mb.tokens.numel() for mb in batches),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            **asdict(metrics),
        }
        records.append(rec)
        print(json.dumps(rec), flush=True)

    timed = records[1:] or records
    summary = {
        "params": shape.num_parameters(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(),
        "train_step_s_median": statistics.median(r["train_s"] for r in timed),
        "rl_step_s_median": statistics.median(r["rl_step_s"] for r in timed),
        "train_mfu_median": statistics.median(r["train_mfu"] for r in timed),
        "rl_step_mfu_median": statistics.median(r["rl_step_mfu"] for r in timed),
        "tokens_per_step": timed[0]["tokens"],
        "peak_tflops": args.peak_tflops,
    }
    import megatron.core

    summary["megatron_core"] = megatron.core.__version__
    print(
        f"RL step: {summary['params'] / 1e9:.3f}B params, "
        f"{summary['tokens_per_step']} tokens/step, "
        f"train step {summary['train_step_s_median']:.3f} s "
        f"(MFU {summary['train_mfu_median']:.1%}), "
        f"RL step incl. old{' and reference' if reference is not None else ''} log-probs "
        f"{summary['rl_step_s_median']:.3f} s "
        f"(MFU {summary['rl_step_mfu_median']:.1%}) vs {args.peak_tflops:.0f} TFLOP/s"
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "megatron_step.json").write_text(
            json.dumps({"summary": summary, "steps": records})
        )


if __name__ == "__main__":
    main()
