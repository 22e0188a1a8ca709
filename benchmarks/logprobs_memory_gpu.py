"""Time, peak memory and accuracy of response log-probs: ours beside the naive path and peers.

Shape of one slime-style micro-batch (11,600 tokens, Qwen vocabulary 151,936, hidden 4,096,
bf16 hidden states and weight). Every method runs in this one process on the same inputs,
forward-only and forward+backward (gradients of hidden states and weight for a random
per-token upstream gradient; the entropy variants also get one for the entropy). Times are
CUDA-event medians of `--repeat` after two warm-ups; peaks are the caching allocator's peak
above the inputs, including the 1.25 GiB of gradients every method returns. Errors are
against a float64 reference computed from the same bf16 inputs: max |log-prob - ref|, and the
relative norm error of each gradient (`floor` prints what rounding the exact gradient to bf16
alone costs, the least any bf16 gradient can show).

Methods:
  naive-bf16      logits = (hidden @ weight.T).float(); log_softmax; gather (the anchor)
  tiled           rljob.logprobs_vocab_parallel.vocab_parallel_logprobs (CPU path, reference)
  fused           rljob.logprobs_fused.fused_logprobs (what the trainers use on GPU)
  fused+entropy   the same, with the entropy and its gradient
  liger           Liger 0.8.5 fused linear cross-entropy, reduction="none" (when installed)
  cce-exact       cut-cross-entropy 25.1.1, reduction="none", filter_eps=None (when installed)
  cce-default     cut-cross-entropy 25.1.1, reduction="none", default gradient filtering

Run: python3 benchmarks/logprobs_memory_gpu.py [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from rljob.logprobs_fused import fused_logprobs
from rljob.logprobs_vocab_parallel import vocab_parallel_logprobs

Out = tuple[torch.Tensor, torch.Tensor | None]
Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Out]


def naive_bf16(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    logits = (h @ w.t()).float()
    return torch.log_softmax(logits, dim=-1).gather(1, t[:, None]).squeeze(1), None


def tiled(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    return vocab_parallel_logprobs(h, w, t)


def fused(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    return fused_logprobs(h, w, t)


def fused_entropy(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    return fused_logprobs(h, w, t, with_entropy=True)



def liger(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    from liger_kernel.ops.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyFunction,
    )

    loss = LigerFusedLinearCrossEntropyFunction.apply(h, w, t, None, None, -100, 0.0, 0.0, "none")
    return -loss[0], None


def cce_exact(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(h, w, t, reduction="none", filter_eps=None), None


def cce_default(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(h, w, t, reduction="none"), None


def reference_fp64(
    h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor, g_ent: torch.Tensor,
    cols: int = 8192,
) -> dict[str, torch.Tensor]:
    """float64 log-probs and entropies, and the gradients of sum(g * logp) and of
    sum(g * logp + g_ent * entropy), a vocabulary chunk at a time (three passes)."""
    hd, n = h.double(), h.shape[0]
    lse = torch.full((n,), float("-inf"), dtype=torch.float64, device=h.device)
    tz = torch.zeros(n, dtype=torch.float64, device=h.device)
    for v0 in range(0, w.shape[0], cols):
        z = hd @ w[v0 : v0 + cols].double().t()
        lse = torch.logaddexp(lse, torch.logsumexp(z, dim=1))
        inside = (t >= v0) & (t < v0 + z.shape[1])
        tz += torch.where(inside, z.gather(1, (t - v0).clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0)
    mean = torch.zeros(n, dtype=torch.float64, device=h.device)
    for v0 in range(0, w.shape[0], cols):
        z = hd @ w[v0 : v0 + cols].double().t()
        mean += ((z - lse[:, None]).exp() * z).sum(dim=1)
    gh_lp = torch.zeros_like(hd)
    gh_ent = torch.zeros_like(hd)
    gw_lp = torch.empty(w.shape, dtype=torch.float64, device=h.device)
    gw_ent = torch.empty_like(gw_lp)
    idx = torch.arange(n, device=h.device)
    for v0 in range(0, w.shape[0], cols):
        wd = w[v0 : v0 + cols].double()
        z = hd @ wd.t()
        p = (z - lse[:, None]).exp()
        d_lp = -p * g.double()[:, None]
        hit = (t >= v0) & (t < v0 + z.shape[1])
        d_lp[idx[hit], (t - v0)[hit]] += g.double()[hit]
        d_ent = -p * (z - mean[:, None]) * g_ent.double()[:, None]
        gh_lp += d_lp @ wd
        gh_ent += d_ent @ wd
        gw_lp[v0 : v0 + cols] = d_lp.t() @ hd
        gw_ent[v0 : v0 + cols] = d_ent.t() @ hd
    return {
        "lp": tz - lse,
        "ent": lse - mean,
        "gh_lp": gh_lp,
        "gw_lp": gw_lp,
        "gh_all": gh_lp + gh_ent,
        "gw_all": gw_lp + gw_ent,
    }


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


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def measure(
    name: str, fn: Fn, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor,
    g_ent: torch.Tensor, ref: dict[str, torch.Tensor], repeat: int,
) -> dict[str, Any]:
    hl = h.detach().requires_grad_(True)
    wl = w.detach().requires_grad_(True)

    def fwd() -> Out:
        with torch.no_grad():
            return fn(h, w, t)

    def fwd_bwd() -> Out:
        hl.grad, wl.grad = None, None
        lp, ent = fn(hl, wl, t)
        if ent is None:
            torch.autograd.backward(lp, g)
        else:
            torch.autograd.backward((lp, ent), (g, g_ent))
        return lp, ent

    torch.cuda.synchronize()
    row: dict[str, Any] = {"method": name}
    for label, step in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        hl.grad, wl.grad = None, None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = step()
        torch.cuda.synchronize()
        row[f"{label}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        del result
        row[f"{label}_ms"] = time_ms(step, repeat)
    lp, ent = fwd_bwd()
    assert hl.grad is not None and wl.grad is not None
    row["max_err"] = float((lp.detach().double() - ref["lp"]).abs().max())
    row["ent_max_err"] = (
        float((ent.detach().double() - ref["ent"]).abs().max()) if ent is not None else None
    )
    which = "all" if ent is not None else "lp"
    row["gh_rel"] = rel(hl.grad, ref[f"gh_{which}"])
    row["gw_rel"] = rel(wl.grad, ref[f"gw_{which}"])
    return row


def profile(fn: Fn, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor) -> None:
    """Where one forward+backward spends its GPU time, by kernel."""
    from torch.profiler import ProfilerActivity, profile

    hl = h.detach().requires_grad_(True)
    wl = w.detach().requires_grad_(True)
    torch.autograd.backward(fn(hl, wl, t)[0], g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.backward(fn(hl, wl, t)[0], g)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10,
                                    max_name_column_width=70))


def version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=11_600)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=4_096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
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
    g_ent = torch.randn(args.tokens, device=dev)
    ref = reference_fp64(h, w, t, g, g_ent)
    floor = {k: rel(ref[k].to(torch.bfloat16), ref[k]) for k in ("gh_lp", "gw_lp")}
    torch.cuda.empty_cache()

    methods: list[tuple[str, Fn]] = [
        ("naive-bf16", naive_bf16),
        ("tiled", tiled),
        ("fused", fused),
        ("fused+entropy", fused_entropy),
    ]
    versions = {d: version(d) for d in ("triton", "liger-kernel", "cut-cross-entropy")}
    if versions["liger-kernel"]:
        methods.append(("liger", liger))
    if versions["cut-cross-entropy"]:
        methods += [("cce-exact", cce_exact), ("cce-default", cce_default)]
    rows = []
    for name, fn in methods:
        try:
            rows.append(measure(name, fn, h, w, t, g, g_ent, ref, args.repeat))
        except Exception as err:
            if name == "naive-bf16":
                raise
            # any other method that breaks is reported and the others still run
            print(f"{name} failed: {type(err).__name__}: {err}", flush=True)
            continue
        finally:
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    del ref

    meta = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(),
        **versions,
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "bf16_rounding_floor": floor,
    }
    # The matmul ceiling of this run: one [tokens x hidden] @ [hidden x vocab] product.
    mm_ms = time_ms(lambda: torch.mm(h, w.t()), args.repeat)
    meta["logits_matmul_ms"] = mm_ms
    meta["matmul_tflops"] = 2 * args.tokens * args.vocab * args.hidden / mm_ms / 1e9
    if "fused" in {r["method"] for r in rows}:
        print("profile of fused, forward+backward:")
        profile(fused, h, w, t, g)
    print(json.dumps(meta))
    cols = [
        ("method", "{:>20}"),
        ("fwd_ms", "{:>8.1f}"),
        ("fwd_peak_gib", "{:>8.3f}"),
        ("fwd_bwd_ms", "{:>8.1f}"),
        ("fwd_bwd_peak_gib", "{:>8.3f}"),
        ("max_err", "{:>9.2e}"),
        ("gh_rel", "{:>9.2e}"),
        ("gw_rel", "{:>9.2e}"),
    ]
    print(" | ".join(c for c, _ in cols))
    for row in rows:
        print(" | ".join(f.format(row[c]) for c, f in cols))
    by = {r["method"]: r for r in rows}
    anchor = by["naive-bf16"]
    print(
        f"matmul floor: fwd 1 x {mm_ms:.1f} ms, fwd+bwd with a per-token upstream gradient "
        f"4 x = {4 * mm_ms:.1f} ms (logits again in the backward, then two gradient matmuls)"
    )
    peers = [r for r in rows if r["method"] in ("liger", "cce-exact", "cce-default")]
    if peers:
        print(
            f"fastest peer: fwd+bwd {min(r['fwd_bwd_ms'] for r in peers):.1f} ms, "
            f"fwd {min(r['fwd_ms'] for r in peers):.1f} ms"
        )
    ours, ent = by.get("fused"), by.get("fused+entropy")
    if ours is not None and ent is not None:
        print(
            f"fused: fwd+bwd {ours['fwd_bwd_ms'] / anchor['fwd_bwd_ms']:.2f}x naive-bf16 "
            f"(target <= 1.10); with entropy {ent['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}x "
            f"fwd+bwd, {ent['fwd_ms'] / ours['fwd_ms']:.2f}x fwd (target <= 1.15); "
            f"entropy max err {ent['ent_max_err']:.2e}"
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "logprobs_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}))


if __name__ == "__main__":
    main()
