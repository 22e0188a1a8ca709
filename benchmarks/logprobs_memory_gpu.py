"""Time, peak memory and accuracy of response log-probs: ours beside the naive path and peers.

Shape of one slime-style micro-batch (11,600 tokens, Qwen vocabulary 151,936, hidden 4,096,
bf16 hidden states and weight). Every method runs in this one process on the same inputs,
forward-only and forward+backward (gradients of hidden states and weight for a random
per-token upstream gradient; the entropy variants also get one for the entropy). Times are
CUDA-event medians of `--repeat` rounds after two warm-up rounds, every method timed once per
round in an order shuffled anew each round (seeded): what a call follows changes its time by a
few percent (the GPU's clock under the power limit), so no call may always follow the same
other one, as a fixed or rotated order does; peaks are the caching allocator's peak above the
inputs, including the 1.25 GiB of gradients every method returns.
Errors are against a float64 reference computed from the same bf16 inputs: max |log-prob -
ref|, and the relative norm error of each gradient (`floor` prints what rounding the exact
gradient to bf16 alone costs, the least any bf16 gradient can show).

Methods:
  naive-bf16      logits = (hidden @ weight.T).float(); log_softmax; gather (the anchor)
  tiled           rljob.kernels.logprobs_vocab_parallel.vocab_parallel_logprobs
                  (CPU path, reference)
  fused           rljob.kernels.logprobs_fused.fused_logprobs (what the trainers use on GPU; on
                  Hopper its logits matmuls are rljob.kernels.logprobs_tma's kernels)
  fused-cublas    the same with those kernels off: cuBLAS logits, then a Triton pass
  fused+entropy   the same, with the entropy and its gradient
  liger           Liger 0.8.5 fused linear cross-entropy, reduction="none" (when installed)
  cce-exact       cut-cross-entropy 25.1.1, reduction="none", filter_eps=None (when installed)
  cce-default     cut-cross-entropy 25.1.1, reduction="none", default gradient filtering

`--idle` times each phase of one forward+backward (CUDA events, host issue time), reads one
profiled call's kernel timeline (kernel time, busy time, the GPU's idle gaps between kernels
and where the largest lie) and prints the host's first steps of one fused call. `--variants`
times the cuBLAS path's backward logit pieces (`_GRAD_Z_PARTS`) in shuffled rounds beside the
naive path, then ours beside `--baseline FILE` (another copy of `logprobs_fused.py`, say the last
commit's). `--set NAME=VALUE` sets a knob of `rljob.kernels.logprobs_fused` for the whole run.

`--smoke` takes a tiny shape and one round: every method's code path in seconds (hack/gpu-test
runs it on the GPU). `--device cpu --smoke` runs that path without a GPU, so that CI notices
when it breaks: times by the host clock, no memory peaks (the CPU has no caching allocator to
ask), the fused kernels only under Triton's CPU interpreter (`TRITON_INTERPRET=1`; otherwise
they are left out, as are the CUDA-only peers), and none of `--sweep`, `--idle`, `--variants`.

Run: python3 benchmarks/logprobs_memory_gpu.py [--out DIR] [--sweep] [--idle] [--variants]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from rljob.kernels.logprobs_fused import fused_logprobs
from rljob.kernels.logprobs_vocab_parallel import vocab_parallel_logprobs

Out = tuple[torch.Tensor, torch.Tensor | None]
Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Out]
# Where the run measures (`--device`): a CUDA GPU, or the CPU for a smoke run of the code path.
DEVICE = torch.device("cuda")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def elapsed_ms(fn: Callable[[], object]) -> float:
    """Milliseconds `fn` takes: CUDA events around it on the GPU, the host clock on the CPU."""
    if DEVICE.type != "cuda":
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return float(a.elapsed_time(b))


def naive_bf16(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    logits = (h @ w.t()).float()
    return torch.log_softmax(logits, dim=-1).gather(1, t[:, None]).squeeze(1), None


def tiled(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    return vocab_parallel_logprobs(h, w, t)


def fused(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    return fused_logprobs(h, w, t)


def fused_entropy(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    return fused_logprobs(h, w, t, with_entropy=True)


@contextlib.contextmanager
def cublas_path() -> Iterator[None]:
    """`rljob.kernels.logprobs_fused` with the TMA kernels off inside (a call's backward follows
    the path of its forward)."""
    import rljob.kernels.logprobs_fused as lf

    kept, lf._USE_TMA = lf._USE_TMA, False
    try:
        yield
    finally:
        lf._USE_TMA = kept


def fused_cublas(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Out:
    """The fused function with the TMA kernels off."""
    with cublas_path():
        return fused_logprobs(h, w, t)



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
    return statistics.median(elapsed_ms(fn) for _ in range(repeat))


def peak_gib(run: Callable[[], object], *leaves: torch.Tensor) -> float:
    """GiB allocated at the peak of `run` above what was allocated before it; the leaves'
    gradients are dropped first, so the ones `run` makes count as its own. NaN on the CPU,
    which has no caching allocator to ask (`run` still runs)."""
    for leaf in leaves:
        leaf.grad = None
    if DEVICE.type != "cuda":
        run()
        return float("nan")
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def measure(
    name: str, fn: Fn, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor,
    g_ent: torch.Tensor, ref: dict[str, torch.Tensor],
) -> tuple[dict[str, Any], dict[str, Callable[[], object]]]:
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

    sync()
    row: dict[str, Any] = {"method": name}
    steps: dict[str, Callable[[], object]] = {}
    for label, step in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        row[f"{label}_peak_gib"] = peak_gib(step, hl, wl)
        steps[label] = step
    lp, ent = fwd_bwd()
    assert hl.grad is not None and wl.grad is not None
    row["max_err"] = float((lp.detach().double() - ref["lp"]).abs().max())
    row["ent_max_err"] = (
        float((ent.detach().double() - ref["ent"]).abs().max()) if ent is not None else None
    )
    which = "all" if ent is not None else "lp"
    row["gh_rel"] = rel(hl.grad, ref[f"gh_{which}"])
    row["gw_rel"] = rel(wl.grad, ref[f"gw_{which}"])
    return row, steps


def time_interleaved(
    timed: list[tuple[dict[str, Any], dict[str, Callable[[], object]]]], repeat: int
) -> None:
    """Each row's `fwd_ms` / `fwd_bwd_ms`: the median over `repeat` rounds, each round
    timing every method's step once in turn (rotated by one per round), after two such
    warm-up rounds."""
    calls = [(row, label, step) for row, steps in timed for label, step in steps.items()]
    times = shuffled_times([step for _, _, step in calls], repeat)
    for (row, label, _), ts in zip(calls, times, strict=True):
        row[f"{label}_ms"] = statistics.median(ts)


def shuffled_times(
    steps: list[Callable[[], object]], repeat: int, seed: int = 0
) -> list[list[float]]:
    """Times (`elapsed_ms`) of each step over `repeat` rounds after two warm-up rounds, each round
    calling every step once in an order shuffled anew (seeded): a call's time depends on what
    ran just before it (the clock under the power limit), so no step may always follow the
    same other one."""
    order = list(range(len(steps)))
    rng = random.Random(seed)
    times: list[list[float]] = [[] for _ in steps]
    for r in range(2 + repeat):
        rng.shuffle(order)
        for i in order:
            ms = elapsed_ms(steps[i])
            if r >= 2:
                times[i].append(ms)
    return times


def profile(fn: Fn, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor) -> None:
    """Where one forward+backward spends its GPU time, by kernel."""
    from torch.profiler import ProfilerActivity, profile

    hl = h.detach().requires_grad_(True)
    wl = w.detach().requires_grad_(True)
    torch.autograd.backward(fn(hl, wl, t)[0], g)
    torch.cuda.synchronize()
    hl.grad, wl.grad = None, None  # the profiled backward writes fresh gradients
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.backward(fn(hl, wl, t)[0], g)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10,
                                    max_name_column_width=70))


def sm_clock_mhz() -> int | None:
    """The GPU's current SM clock (NVML), or None where it cannot be read."""
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # no NVML there: the clock is simply not reported
        return None


def kernel_timeline(run: Callable[[], object]) -> dict[str, Any]:
    """One profiled call of `run`: CUDA-event wall time, kernel time summed, busy time (the
    union of kernel intervals), idle time inside the kernels' span and outside it (before the
    first kernel starts and after the last ends), the gaps by size, the five largest with the
    kernels either side, and kernel time by family."""
    from torch.profiler import ProfilerActivity, profile

    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    kinds = ("kernel", "gpu_memset", "gpu_memcpy")
    ks = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e.get("name", "")))
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") in kinds
    )
    out: dict[str, Any] = {"wall_ms": float(a.elapsed_time(b)), "kernels": len(ks)}
    if not ks:
        return out
    out["kernel_sum_ms"] = sum(e - s for s, e, _ in ks) / 1e3
    busy, end, gaps = 0.0, ks[0][0], []
    prev = ks[0][2]
    for s, e, name in ks:
        if s > end:
            gaps.append((s - end, prev, name))
        busy += max(0.0, e - max(s, end))
        if e >= end:
            end, prev = e, name
    span = (end - ks[0][0]) / 1e3
    out["busy_ms"] = busy / 1e3
    out["idle_inside_ms"] = span - busy / 1e3
    out["idle_outside_ms"] = out["wall_ms"] - span
    buckets = [(0, 2), (2, 5), (5, 20), (20, 100), (100, float("inf"))]
    out["gaps_us"] = {
        f"{lo}-{hi}": [len(sel := [g for g, _, _ in gaps if lo <= g < hi]), round(sum(sel), 1)]
        for lo, hi in buckets
    }
    out["largest_gaps_us"] = [
        [round(g, 1), p[:48], n[:48]] for g, p, n in sorted(gaps, reverse=True)[:5]
    ]
    fam: dict[str, float] = {}
    for s, e, name in ks:
        low = name.lower()
        key = (
            "triton-stats" if "_chunk_stats" in low
            else "triton-grad" if "_chunk_grad" in low
            else "memset" if "memset" in low
            else "memcpy" if "memcpy" in low
            else "gemm" if any(k in low for k in ("gemm", "cutlass", "nvjet", "sm90", "xmma"))
            else "other"
        )
        fam[key] = fam.get(key, 0.0) + (e - s) / 1e3
    out["by_family_ms"] = {k: round(v, 3) for k, v in sorted(fam.items())}
    return out


def idle(
    methods: list[tuple[str, Fn]], h: torch.Tensor, w: torch.Tensor, t: torch.Tensor,
    g: torch.Tensor, g_ent: torch.Tensor, repeat: int,
) -> list[dict[str, Any]]:
    """Where one forward+backward's wall time goes, per method: CUDA-event time of each phase
    and the host's time to issue it (medians of `repeat`), then one profiled call's timeline
    (`kernel_timeline`). A host that issues a phase well before the GPU ends it is not what
    keeps the GPU waiting."""
    rows = []
    for name, fn in methods:
        hl = h.detach().requires_grad_(True)
        wl = w.detach().requires_grad_(True)
        with_ent = name.endswith("+entropy")

        def step(fn: Fn = fn, hl: torch.Tensor = hl, wl: torch.Tensor = wl,
                 with_ent: bool = with_ent) -> tuple[float, ...]:
            hl.grad, wl.grad = None, None
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            t0 = time.perf_counter()
            lp, ent = fn(hl, wl, t)
            t1 = time.perf_counter()
            e1.record()
            if with_ent and ent is not None:
                torch.autograd.backward((lp, ent), (g, g_ent))
            else:
                torch.autograd.backward(lp, g)
            t2 = time.perf_counter()
            e2.record()
            torch.cuda.synchronize()
            return (float(e0.elapsed_time(e1)), float(e1.elapsed_time(e2)),
                    float(e0.elapsed_time(e2)), 1e3 * (t1 - t0), 1e3 * (t2 - t1))

        for _ in range(2):
            step()
        samples = [step() for _ in range(repeat)]
        med = [statistics.median(col) for col in zip(*samples, strict=True)]
        step()  # the profiler's own first-call costs stay out of the timeline
        timeline = kernel_timeline(step)
        row = {"method": name, "fwd_ms": med[0], "bwd_ms": med[1], "wall_ms": med[2],
               "host_fwd_ms": med[3], "host_bwd_ms": med[4], "sm_mhz": sm_clock_mhz(),
               "profiled": timeline}
        print("idle " + json.dumps(row), flush=True)
        rows.append(row)
        hl.grad, wl.grad = None, None
        torch.cuda.empty_cache()
    return rows


def variants(
    h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor, g_ent: torch.Tensor,
    repeat: int, baseline: Any | None,
) -> None:
    """Forward+backward time (shuffled rounds, beside the naive path) and peak of the fused
    path over `_GRAD_Z_PARTS`, then the module as set beside `baseline` (another copy of
    `logprobs_fused.py`): forward and forward+backward, with and without the entropy."""
    import rljob.kernels.logprobs_fused as lf

    hl = h.detach().requires_grad_(True)
    wl = w.detach().requires_grad_(True)

    def fwd(mod: Any, ent: bool) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return mod.fused_logprobs(h, w, t, with_entropy=ent)
        return run

    def fwd_bwd(mod: Any, ent: bool, parts: int | None = None) -> Callable[[], object]:
        """`parts` set: the cuBLAS path (the only one with logit pieces) with that many."""
        def run() -> object:
            old = lf._GRAD_Z_PARTS
            lf._GRAD_Z_PARTS = parts or old
            path = cublas_path() if parts is not None else contextlib.nullcontext()
            try:
                with path:
                    hl.grad, wl.grad = None, None
                    lp, e = mod.fused_logprobs(hl, wl, t, with_entropy=ent)
                    if ent:
                        torch.autograd.backward((lp, e), (g, g_ent))
                    else:
                        torch.autograd.backward(lp, g)
                    return lp
            finally:
                lf._GRAD_Z_PARTS = old
        return run

    def naive_fwd_bwd() -> object:
        hl.grad, wl.grad = None, None
        torch.autograd.backward(naive_bf16(hl, wl, t)[0], g)
        return None

    def med(ts: list[float]) -> float:
        return round(statistics.median(ts), 2)

    all_parts = (3, 4, 5, 6)
    steps = [fwd_bwd(lf, False, p) for p in all_parts] + [naive_fwd_bwd]
    times = shuffled_times(steps, repeat, seed=2)
    naive_ms = med(times[-1])
    for p, ts in zip(all_parts, times, strict=False):
        peak = peak_gib(fwd_bwd(lf, False, p), hl, wl)
        print(f"variant fwd+bwd _GRAD_Z_PARTS={p}: {med(ts)} ms ({med(ts) / naive_ms:.3f}x "
              f"naive {naive_ms}), peak {peak:.3f} GiB", flush=True)
    cands = [("ours", lf)] + ([("baseline", baseline)] if baseline is not None else [])
    steps, labels = [], []
    for name, mod in cands:
        for ent in (False, True):
            tag = f"{name}{'+entropy' if ent else ''}"
            steps += [fwd(mod, ent), fwd_bwd(mod, ent)]
            labels += [f"{tag} fwd", f"{tag} fwd+bwd"]
    steps.append(naive_fwd_bwd)
    labels.append("naive fwd+bwd")
    res = {k: med(ts) for k, ts in zip(labels, shuffled_times(steps, repeat, seed=3), strict=True)}
    for name, _ in cands:
        print(f"variant {name}: fwd {res[f'{name} fwd']} ms, fwd+bwd {res[f'{name} fwd+bwd']} ms "
              f"= {res[f'{name} fwd+bwd'] / res['naive fwd+bwd']:.3f}x naive "
              f"{res['naive fwd+bwd']}; +entropy fwd {res[f'{name}+entropy fwd']} ms "
              f"({res[f'{name}+entropy fwd'] / res[f'{name} fwd']:.3f}x), fwd+bwd "
              f"{res[f'{name}+entropy fwd+bwd']} ms", flush=True)
    hl.grad, wl.grad = None, None
    torch.cuda.empty_cache()


def host_timeline(run: Callable[[], object], first: int = 40) -> None:
    """The first `first` host and device events of one profiled call, in time order (offset
    from the first, duration, in microseconds): what the host does before each launch."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    evs = sorted(
        (float(e["ts"]), float(e.get("dur", 0)), str(e.get("cat")), str(e.get("name", "")))
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") in (
            "cpu_op", "cuda_runtime", "cuda_driver", "kernel", "gpu_memset", "python_function",
            "user_annotation",
        )
    )
    if not evs:
        return
    t0 = evs[0][0]
    for ts, dur, cat, name in evs[:first]:
        print(f"host {ts - t0:9.1f} {dur:9.1f} {cat:<14} {name[:70]}", flush=True)


def load_module(path: Path) -> Any:
    """Another copy of `logprobs_fused.py` (say the last commit's), for a same-run comparison."""
    spec = importlib.util.spec_from_file_location(f"baseline_{path.stem}", path)
    if spec is None or spec.loader is None:
        sys.exit(f"--baseline: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sweep(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor, repeat: int) -> None:
    """The cuBLAS path's forward time over `_STATS_SPLIT`, forward+backward time and peak
    over `_GRAD_Z_PARTS`; the module's defaults are restored afterwards."""
    with cublas_path():
        _sweep(h, w, t, g, repeat)


def _sweep(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor,
           repeat: int) -> None:
    import rljob.kernels.logprobs_fused as lf

    defaults = (lf._STATS_SPLIT, lf._GRAD_Z_PARTS, lf._STATS_BLOCK_M, lf._STATS_WARPS)
    hl = h.detach().requires_grad_(True)
    wl = w.detach().requires_grad_(True)

    def fwd() -> None:
        with torch.no_grad():
            fused_logprobs(h, w, t)

    def fwd_bwd() -> None:
        hl.grad, wl.grad = None, None
        torch.autograd.backward(fused_logprobs(hl, wl, t)[0], g)

    import time

    for label, step in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"sweep {label}: host issues in {1e3 * (t1 - t0):.1f} ms, "
              f"done after {1e3 * (t2 - t0):.1f} ms", flush=True)
    z = w[:1152]
    calls: list[tuple[str, Callable[[], object]]] = [
        ("mm fp32-out 11600x1152", lambda: torch.mm(h, z.t(), out_dtype=torch.float32)),
        ("mm bf16 11600x1152", lambda: torch.mm(h, z.t())),
    ]
    for name, call in calls:
        call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"sweep {name}: host {1e3 * (t1 - t0) / 50:.3f} ms/call, "
              f"device {1e3 * (t2 - t0) / 50:.3f} ms/call", flush=True)
    for split in (512, 1024):
        lf._STATS_SPLIT = split
        print(f"sweep fwd split={split}: {time_ms(fwd, repeat):.2f} ms", flush=True)
    lf._STATS_SPLIT = defaults[0]
    for block_m in (4, 16):
        lf._STATS_BLOCK_M = block_m
        print(f"sweep fwd block_m={block_m}: {time_ms(fwd, repeat):.2f} ms", flush=True)
    lf._STATS_BLOCK_M = defaults[2]
    for warps in (2, 8):
        lf._STATS_WARPS = warps
        print(f"sweep fwd num_warps={warps}: {time_ms(fwd, repeat):.2f} ms", flush=True)
    lf._STATS_WARPS = defaults[3]
    for parts in (1, 3):
        lf._GRAD_Z_PARTS = parts
        peak = peak_gib(fwd_bwd, hl, wl)
        print(f"sweep fwd+bwd parts={parts}: {time_ms(fwd_bwd, repeat):.2f} ms, "
              f"peak {peak:.3f} GiB", flush=True)
    lf._STATS_SPLIT, lf._GRAD_Z_PARTS, lf._STATS_BLOCK_M, lf._STATS_WARPS = defaults
    hl.grad, wl.grad = None, None
    torch.cuda.empty_cache()


def gemm_shapes(h: torch.Tensor, w: torch.Tensor, repeat: int) -> None:
    """Sustained time of each matmul family of the fused path over the whole vocabulary, by
    chunk width (cuBLAS picks its tiles per shape, so the width decides the waves)."""
    n, v = h.shape[0], w.shape[0]
    f32 = torch.float32

    def over(cols: int, body: Callable[[int, int], object]) -> Callable[[], None]:
        def run() -> None:
            for v0 in range(0, v, cols):
                body(v0, min(cols, v - v0))
        return run

    t_full = time_ms(lambda: torch.mm(h, w.t(), out_dtype=f32), repeat)
    print(f"gemm full fp32-out: {t_full:.2f} ms", flush=True)
    for cols in (1024, 1152, 1280, 1408, 1920, 2048, 2304, 2816, 3072):
        t = time_ms(over(cols, lambda v0, c: torch.mm(h, w[v0 : v0 + c].t(), out_dtype=f32)),
                    repeat)
        print(f"gemm logits fp32-out cols={cols}: {t:.2f} ms", flush=True)
    acc = torch.zeros(n, h.shape[1], dtype=f32, device=h.device)
    gw = torch.empty_like(w)
    for cols in (1920, 2304, 2816, 3072, 3456, 3840):
        gc = torch.randn(n, cols, device=h.device).to(h.dtype)

        def grad_h(v0: int, c: int, gc: torch.Tensor = gc) -> object:
            return torch.addmm(acc, gc[:, :c], w[v0 : v0 + c], out_dtype=f32, out=acc)

        def grad_w(v0: int, c: int, gc: torch.Tensor = gc) -> object:
            return torch.mm(gc[:, :c].t(), h, out=gw[v0 : v0 + c])

        t, t2 = time_ms(over(cols, grad_h), repeat), time_ms(over(cols, grad_w), repeat)
        print(f"gemm grad-h addmm K={cols}: {t:.2f} ms; grad-W M={cols}: {t2:.2f} ms", flush=True)


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
    parser.add_argument(
        "--smoke", action="store_true",
        help="a tiny shape (24 tokens, vocabulary 600, hidden 32) and one round",
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda",
        help="cpu: the code path without a GPU (with --smoke; see the module's docstring)",
    )
    parser.add_argument(
        "--sweep", action="store_true",
        help="first time the fused path over its statistics split and backward logit pieces",
    )
    parser.add_argument(
        "--idle", action="store_true",
        help="first time each phase and read the GPU's idle gaps from one profiled call",
    )
    parser.add_argument(
        "--variants", action="store_true",
        help="first time the backward's logit pieces, and ours beside --baseline",
    )
    parser.add_argument(
        "--baseline", type=Path, default=None,
        help="another copy of logprobs_fused.py timed beside ours by --variants and --idle",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE",
        help="set a knob of rljob.kernels.logprobs_fused (say _GRAD_Z_PARTS=5) for the whole run",
    )
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.vocab, args.hidden, args.repeat = 24, 600, 32, 1
    global DEVICE
    DEVICE = torch.device(args.device)
    on_cpu = DEVICE.type == "cpu"
    if on_cpu and (args.sweep or args.idle or args.variants):
        sys.exit("--sweep, --idle and --variants read CUDA kernels: they need --device cuda")
    import rljob.kernels.logprobs_fused as lf

    for item in args.set:
        name, _, value = item.partition("=")
        if not hasattr(lf, name) or not name.startswith("_"):
            sys.exit(f"--set {item}: rljob.kernels.logprobs_fused has no knob {name!r}")
        setattr(lf, name, json.loads(value.lower()) if value.lower() in ("true", "false")
                else int(value))
    baseline = load_module(args.baseline) if args.baseline else None
    if not on_cpu and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --device cpu --smoke for the code path alone)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    dev = DEVICE
    h = torch.randn(args.tokens, args.hidden, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(args.vocab, args.hidden, device=dev) * 0.02).to(torch.bfloat16)
    t = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    g = torch.randn(args.tokens, device=dev)
    g_ent = torch.randn(args.tokens, device=dev)
    ref = reference_fp64(h, w, t, g, g_ent)
    floor = {k: rel(ref[k].to(torch.bfloat16), ref[k]) for k in ("gh_lp", "gw_lp")}
    if not on_cpu:
        torch.cuda.empty_cache()

    if args.sweep:
        gemm_shapes(h, w, args.repeat)
        sweep(h, w, t, g, args.repeat)
    if args.variants:
        variants(h, w, t, g, g_ent, args.repeat, baseline)
    knobs = {k: v for k, v in sorted(vars(lf).items())
             if k.startswith("_") and k.isupper() and isinstance(v, int)}
    print(f"knobs: {json.dumps(knobs)}", flush=True)
    if args.idle:
        idle_methods: list[tuple[str, Fn]] = [("naive-bf16", naive_bf16)]
        if baseline is not None:
            idle_methods.append(
                ("baseline", lambda h, w, t: baseline.fused_logprobs(h, w, t))
            )
        idle_methods += [("fused", fused), ("fused+entropy", fused_entropy)]
        idle(idle_methods, h, w, t, g, g_ent, args.repeat)
        hl = h.detach().requires_grad_(True)
        wl = w.detach().requires_grad_(True)
        host_timeline(lambda: torch.autograd.backward(fused(hl, wl, t)[0], g))
        del hl, wl

    methods: list[tuple[str, Fn]] = [("naive-bf16", naive_bf16), ("tiled", tiled)]
    # The fused kernels serve CUDA tensors, or CPU ones under Triton's interpreter.
    if not on_cpu or os.environ.get("TRITON_INTERPRET") == "1":
        methods += [("fused", fused), ("fused+entropy", fused_entropy),
                    ("fused-cublas", fused_cublas)]
    versions = {d: version(d) for d in ("triton", "liger-kernel", "cut-cross-entropy")}
    if versions["liger-kernel"] and not on_cpu:
        methods.append(("liger", liger))
    if versions["cut-cross-entropy"] and not on_cpu:
        methods += [("cce-exact", cce_exact), ("cce-default", cce_default)]
    rows = []
    timed = []
    for name, fn in methods:
        try:
            timed.append(measure(name, fn, h, w, t, g, g_ent, ref))
            rows.append(timed[-1][0])
        except Exception as err:
            # A smoke run is there to find what breaks.
            if name == "naive-bf16" or args.smoke:
                raise
            # any other method that breaks is reported and the others still run
            print(f"{name} failed: {type(err).__name__}: {err}", flush=True)
            continue
        finally:
            if not on_cpu:
                torch.cuda.empty_cache()
    del ref
    time_interleaved(timed, args.repeat)
    del timed
    for row in rows:
        print(json.dumps(row), flush=True)

    meta = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": "CPU" if on_cpu else torch.cuda.get_device_name(),
        **versions,
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "bf16_rounding_floor": floor,
        "knobs": knobs,
    }
    # The matmul ceiling of this run: one [tokens x hidden] @ [hidden x vocab] product.
    mm_ms = time_ms(lambda: torch.mm(h, w.t()), args.repeat)
    meta["logits_matmul_ms"] = mm_ms
    meta["matmul_tflops"] = 2 * args.tokens * args.vocab * args.hidden / mm_ms / 1e9
    if "fused" in {r["method"] for r in rows} and not on_cpu:
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
