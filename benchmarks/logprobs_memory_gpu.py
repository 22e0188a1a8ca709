"""Peak extra memory, time and accuracy of response log-probs: full fp32 logits vs tiled.

Shape of one slime-style micro-batch (11,600 tokens, Qwen vocabulary 151,936, hidden 4,096,
bf16 hidden states and weight). For each method, forward and forward+backward (gradients of
hidden states and weight w.r.t. a random per-token upstream gradient) are timed with CUDA
events (median of `--repeat` after warm-up), and the peak memory above the inputs is read from
the caching allocator. "working" memory excludes the two gradient tensors every method must
return (hidden and weight grads); "with grads" includes them.

Methods:
  naive-fp32     logits = hidden.float() @ weight.float().T; log_softmax; gather (fp32 ref)
  naive-bf16mm   logits = (hidden @ weight.T).float(); log_softmax; gather (common practice)
  tiled          rljob.logprobs_vocab_parallel.vocab_parallel_logprobs

Run: python3 benchmarks/logprobs_memory_gpu.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from rljob.logprobs_vocab_parallel import vocab_parallel_logprobs

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def naive_fp32(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logits = h.float() @ w.float().t()
    return torch.log_softmax(logits, dim=-1).gather(1, t[:, None]).squeeze(1)


def naive_bf16mm(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logits = (h @ w.t()).float()
    return torch.log_softmax(logits, dim=-1).gather(1, t[:, None]).squeeze(1)


def tiled(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_logprobs(h, w, t)[0]


def tiled_entropy(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    lp, ent = vocab_parallel_logprobs(h, w, t, with_entropy=True)
    assert ent is not None
    return lp + 0.0 * ent


def reference_fp64(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(h.shape[0], dtype=torch.float64, device=h.device)
    for s in range(0, h.shape[0], 1024):
        z = h[s : s + 1024].double() @ w.double().t()
        out[s : s + 1024] = torch.log_softmax(z, -1).gather(1, t[s : s + 1024, None]).squeeze(1)
    return out


def time_ms(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(float(a.elapsed_time(b)))
    return statistics.median(times)


def measure(
    name: str, fn: Fn, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor,
    repeat: int,
) -> dict[str, Any]:
    """Figures (peaks, times) and the log-probs and gradients, for the comparisons."""
    hl = h.detach().requires_grad_(True)
    wl = w.detach().requires_grad_(True)
    grad_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return fn(h, w, t)

    def fwd_bwd() -> torch.Tensor:
        hl.grad, wl.grad = None, None
        lp = fn(hl, wl, t)
        torch.autograd.backward(lp, g)
        return lp

    torch.cuda.synchronize()
    out: dict[str, Any] = {"method": name}
    for label, step in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        hl.grad, wl.grad = None, None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del result
        out[f"{label}_peak_gib"] = peak / 2**30
        if label == "fwd_bwd":
            out["fwd_bwd_working_gib"] = (peak - grad_bytes) / 2**30
        out[f"{label}_ms"] = time_ms(step, repeat)
    lp = fwd_bwd()
    out["logp"] = lp.detach()
    out["grad_h"] = hl.grad.detach().float() if hl.grad is not None else None
    out["grad_w"] = wl.grad.detach().float() if wl.grad is not None else None
    return out


def profile_tiled(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor) -> None:
    """Where the tiled forward+backward spends its GPU time, by kernel."""
    from torch.profiler import ProfilerActivity, profile

    hl = h.detach().requires_grad_(True)
    wl = w.detach().requires_grad_(True)
    torch.autograd.backward(tiled(hl, wl, t), g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.backward(tiled(hl, wl, t), g)
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=14, max_name_column_width=60
    )
    print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=11_600)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=4_096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="print the tiled path's kernels")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    dev = torch.device("cuda")
    h = torch.randn(args.tokens, args.hidden, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(args.vocab, args.hidden, device=dev) * 0.02).to(torch.bfloat16)
    t = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    g = torch.randn(args.tokens, device=dev)
    ref = reference_fp64(h, w, t)

    rows = []
    results = {}
    for name, fn in (
        ("naive-fp32", naive_fp32),
        ("naive-bf16mm", naive_bf16mm),
        ("tiled", tiled),
        ("tiled+entropy", tiled_entropy),
    ):
        r = measure(name, fn, h, w, t, g, args.repeat)
        r["max_abs_diff_vs_fp64"] = float((r["logp"].double() - ref).abs().max())
        results[name] = r
        torch.cuda.empty_cache()

    base = results["naive-fp32"]
    for r in results.values():
        row = {k: v for k, v in r.items() if not isinstance(v, torch.Tensor) and v is not None}
        row["max_abs_diff_vs_naive_fp32"] = float(
            (r["logp"] - base["logp"]).abs().max()
        )
        for key in ("grad_h", "grad_w"):
            a, b = r[key], base[key]
            row[f"{key}_rel_err_vs_naive_fp32"] = float((a - b).norm() / b.norm())
        row["fwd_bwd_peak_ratio_vs_naive_fp32"] = (
            row["fwd_bwd_peak_gib"] / base["fwd_bwd_peak_gib"]
        )
        row["fwd_bwd_working_ratio_vs_naive_fp32"] = (
            row["fwd_bwd_working_gib"] / base["fwd_bwd_working_gib"]
        )
        rows.append(row)

    meta = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(),
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
    }
    print(json.dumps(meta))
    cols = [
        ("method", "{:>14}"),
        ("fwd_peak_gib", "{:>9.3f}"),
        ("fwd_bwd_peak_gib", "{:>9.3f}"),
        ("fwd_bwd_working_gib", "{:>9.3f}"),
        ("fwd_ms", "{:>8.1f}"),
        ("fwd_bwd_ms", "{:>8.1f}"),
        ("max_abs_diff_vs_naive_fp32", "{:>9.2e}"),
        ("max_abs_diff_vs_fp64", "{:>9.2e}"),
        ("grad_w_rel_err_vs_naive_fp32", "{:>9.2e}"),
    ]
    print(" | ".join(c for c, _ in cols))
    for row in rows:
        print(" | ".join(f.format(row[c]) for c, f in cols))
    tiled_row = next(r for r in rows if r["method"] == "tiled")
    print(
        f"tiled vs naive-fp32: peak {tiled_row['fwd_bwd_peak_ratio_vs_naive_fp32']:.2%} "
        f"(working {tiled_row['fwd_bwd_working_ratio_vs_naive_fp32']:.2%}), "
        f"fwd+bwd {tiled_row['fwd_bwd_ms']:.1f} ms vs {base['fwd_bwd_ms']:.1f} ms, "
        f"max |diff| {tiled_row['max_abs_diff_vs_naive_fp32']:.2e}"
    )
    if args.profile:
        profile_tiled(h, w, t, g)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "logprobs_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}))


if __name__ == "__main__":
    main()
