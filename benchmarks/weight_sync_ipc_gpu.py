"""Same-GPU handoff from the sidecar process to the engine process over CUDA IPC, in GB/s,
against the device-to-device copy rate of the same bytes measured in the same run.

This process plays the sidecar after a version arrived: its buckets are views of one
staging allocation on the GPU (as `Sidecar._buffers` makes them), and it installs them
through the engine's `/update_weights_from_tensor` as `EngineClient.update_from_rank_tensors`
does for `rljob-weight-sync` (one flattened bucket: one CUDA IPC handle; a kept
connection). The engine (benchmarks/weight_sync_engine.py, another process on the same
GPU) decodes (the handle stays open from the last version), checks names/shapes/dtypes,
copies the version beside its served tensors with the NaN/Inf check in the same pass
(`weight_swap.stage_version`, `checked_copy.copy_checked`: one Triton kernel, one
synchronisation) and switches its tensors to the copy before answering; it reports how
long each of those phases took. Timed: from the staged version to the engine's answer.
Printed beside it: that GPU work alone in this process, the GPU work of an install that
checks, then copies (what the one-pass copy saves), and a device-to-device copy.

    python benchmarks/weight_sync_ipc_gpu.py --size-gb 1 --bucket-mb 512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "runtime"))
for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ[_var] = "0" if _var == "NCCL_NVLS_ENABLE" else "1"

import torch  # noqa: E402

from rljob.engine.client import EngineClient  # noqa: E402
from rljob.weightsync.checked_copy import copy_checked  # noqa: E402
from rljob.weightsync.nonfinite import nonfinite_names  # noqa: E402
from rljob.weightsync.protocol import (  # noqa: E402
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)
from rljob.weightsync.wire import (  # noqa: E402
    FLATTENED,
    copy_into,
    encode_flattened,
    flat_span,
)

DEVICE = "cuda:0"


def sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize(DEVICE)


def d2d_gbs(nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _best_gbs(nbytes: int, reps: int, work: Callable[[], None]) -> float:
    """GB/s of the best of `reps` (+1 warm-up) runs of `work`, each ended by a sync."""
    best = float("inf")
    for _ in range(reps + 1):
        sync()
        start = time.perf_counter()
        work()
        sync()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def checked_copy_gbs(views: list[tuple[str, torch.Tensor]], reps: int) -> float:
    """The engine's GPU work alone, in this process: the flat version copied beside the
    served tensors with its NaN/Inf check in the same pass (no IPC, no request)."""
    flat = flat_span(views)
    assert flat is not None
    dst = torch.empty_like(flat)

    def work() -> None:
        if not copy_checked(flat, dst):
            raise SystemExit("the benchmark's weights are finite; the check says otherwise")

    return _best_gbs(flat.numel() * flat.element_size(), reps, work)


def check_then_copy_gbs(views: list[tuple[str, torch.Tensor]], reps: int) -> float:
    """The GPU work of an install that checks before it copies (`nonfinite_names`, then
    `copy_into`): the anchor for what the copy that carries the check saves."""
    targets = [torch.empty_like(t) for _, t in views]

    def work() -> None:
        if nonfinite_names(views):
            raise SystemExit("the benchmark's weights are finite; the check says otherwise")
        copy_into(targets, [t for _, t in views])

    return _best_gbs(sum(t.numel() * t.element_size() for _, t in views), reps, work)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--tensor-mb", type=int, default=128)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda:0", help="cpu: a smoke run of the plumbing only")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    count = max(1, int(args.size_gb * 1024) // args.tensor_mb)
    elems = (args.tensor_mb << 20) // 2
    named = [
        (f"layers.{i}.weight", torch.randn(elems, device=DEVICE).bfloat16()) for i in range(count)
    ]
    plan = plan_buckets(named, args.bucket_mb << 20)
    by_name = dict(named)
    sizes = [b.nbytes for b in plan]
    staging = torch.empty(sum(sizes), dtype=torch.uint8, device=DEVICE)
    buffers = [pack_bucket(b, [by_name[m.name] for m in b.tensors], out)
               for b, out in zip(plan, staging.split(sizes), strict=True)]
    views = [nt for b, buf in zip(plan, buffers, strict=True) for nt in unpack_bucket(b, buf)]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    del named, by_name
    work = Path(tempfile.mkdtemp(prefix="ws-ipc-"))
    layout = work / "layout.json"
    layout.write_text(json.dumps({n: ["bfloat16", list(t.shape)] for n, t in views}))
    port_file = work / "engine.port"
    engine = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "weight_sync_engine.py"),
            "--layout",
            str(layout),
            "--device",
            DEVICE,
            "--port-file",
            str(port_file),
        ]
    )
    try:
        deadline = time.monotonic() + 180
        while not port_file.exists():
            if engine.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("engine did not start")
            time.sleep(0.1)
        client = EngineClient(f"http://127.0.0.1:{port_file.read_text()}", timeout_s=60)
        times: list[tuple[float, str]] = []
        for rep in range(args.reps + 1):
            sync()
            start = time.perf_counter()
            # What `client.update_from_rank_tensors([views], ...)` does for a one-rank
            # engine, in its two steps, to time the sidecar's encoding apart.
            flat = flat_span(views)
            assert flat is not None
            entry = encode_flattened(views, flat)
            encoded = time.perf_counter()
            result = client.update_from_tensor([entry], str(rep + 1), 600, FLATTENED)
            elapsed = time.perf_counter() - start
            answered = start + elapsed
            if not result.success or client.weight_version() != str(rep + 1):
                raise SystemExit(f"install failed: {result.message}")
            asked = time.perf_counter()
            client.weight_version()
            get_rtt = time.perf_counter() - asked
            engine_side = json.loads(result.message)
            ms = {"sidecar encode": (encoded - start) * 1e3,
                  "request to the engine's handler": (engine_side["arrived"] - encoded) * 1e3,
                  **engine_side["phases"],
                  "answer back to the sidecar": (answered - engine_side["installed"]) * 1e3}
            if rep:
                times.append((elapsed, "; ".join(f"{k} {v:.3f}" for k, v in ms.items())
                              + f" (a GET round trip on the kept connection: {get_rtt * 1e3:.3f})"))
        times.sort()
        best, phases = times[0]
        ipc = nbytes / best / 1e9
        copy = d2d_gbs(nbytes, args.reps)
        print(
            f"{torch.cuda.get_device_name(0) if DEVICE != 'cpu' else 'CPU'}; "
            f"torch {torch.__version__}; "
            f"{nbytes / 1e9:.2f} GB bf16 in {len(views)} tensors, {len(plan)} buckets"
        )
        print(
            f"CUDA IPC handoff sidecar -> engine (incl. finite check, copy, sync): "
            f"{ipc:.1f} GB/s (best of {args.reps}: {best * 1e3:.3f} ms; median "
            f"{nbytes / times[len(times) // 2][0] / 1e9:.1f} GB/s)"
        )
        print(f"  phases of the best, ms: {phases}")
        fused = checked_copy_gbs(views, args.reps)
        print(f"the engine's GPU work alone (copy with the check in the same pass; no IPC, "
              f"no request): {fused:.1f} GB/s, ratio {fused / copy:.3f}")
        before = check_then_copy_gbs(views, args.reps)
        print(f"check, then copy (the install before): {before:.1f} GB/s, "
              f"ratio {before / copy:.3f}")
        print(f"device-to-device copy, same bytes: {copy:.1f} GB/s")
        print(f"ratio IPC handoff / D2D copy: {ipc / copy:.3f} (target >= 0.5: "
              f"{'met' if ipc / copy >= 0.5 else 'missed'})")
    finally:
        engine.kill()
        engine.wait(timeout=60)


if __name__ == "__main__":
    main()
