"""Same-GPU handoff from the sidecar process to the engine process over CUDA IPC, in GB/s,
against the device-to-device copy rate of the same bytes measured in the same run.

This process plays the sidecar after a version arrived: its buckets sit on the GPU, it
serializes the tensor views (`encode_named_tensors`: CUDA IPC handles) and installs them
through the engine's `/update_weights_from_tensor` (`EngineHTTP`), exactly as
`rljob-weight-sync` does. The engine (benchmarks/weight_sync_engine.py, another process on
the same GPU) opens the handles, checks names/shapes/dtypes/finiteness (one fused
reduction per dtype, `protocol.nonfinite_names`), copies into its parameters and
synchronizes before answering; it reports how long each of those phases took.

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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "runtime"))
for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ[_var] = "0" if _var == "NCCL_NVLS_ENABLE" else "1"

import torch  # noqa: E402

from rljob.weightsync.engine_http import EngineHTTP  # noqa: E402
from rljob.weightsync.protocol import (  # noqa: E402
    nonfinite_names,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)
from rljob.weightsync.tensor_payload import encode_named_tensors  # noqa: E402


def d2d_gbs(nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def check_gbs(views: list[tuple[str, torch.Tensor]], reps: int) -> float:
    """The fused finite check alone, on the sidecar's buffers (no handoff around it)."""
    best = float("inf")
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if nonfinite_names(views):
            raise SystemExit("the benchmark's weights are finite; the check says otherwise")
        best = min(best, time.perf_counter() - start)
    return sum(t.numel() * t.element_size() for _, t in views) / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--tensor-mb", type=int, default=128)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    count = max(1, int(args.size_gb * 1024) // args.tensor_mb)
    elems = (args.tensor_mb << 20) // 2
    named = [
        (f"layers.{i}.weight", torch.randn(elems, device="cuda:0").bfloat16()) for i in range(count)
    ]
    plan = plan_buckets(named, args.bucket_mb << 20)
    by_name = dict(named)
    buffers = [pack_bucket(b, [by_name[m.name] for m in b.tensors]) for b in plan]
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
            "cuda:0",
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
        client = EngineHTTP(f"http://127.0.0.1:{port_file.read_text()}", timeout_s=60)
        times: list[tuple[float, str]] = []
        for rep in range(args.reps + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            payload = encode_named_tensors(views)
            encoded = time.perf_counter()
            result = client.update_from_tensor([payload], str(rep + 1), 600)
            elapsed = time.perf_counter() - start
            asked = time.perf_counter()
            if not result.success or client.weight_version() != str(rep + 1):
                raise SystemExit(f"install failed: {result.message}")
            if rep:
                times.append((elapsed, f"encode {(encoded - start) * 1e3:.3f} (sidecar), "
                              f"{result.message}; a GET round trip "
                              f"{(time.perf_counter() - asked) * 1e3:.3f}"))
        times.sort()
        best, phases = times[0]
        ipc = nbytes / best / 1e9
        copy = d2d_gbs(nbytes, args.reps)
        print(
            f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
            f"{nbytes / 1e9:.2f} GB bf16 in {len(views)} tensors, {len(plan)} buckets"
        )
        print(
            f"CUDA IPC handoff sidecar -> engine (incl. finite check, copy, sync): "
            f"{ipc:.1f} GB/s (best of {args.reps}: {best * 1e3:.3f} ms; median "
            f"{nbytes / times[len(times) // 2][0] / 1e9:.1f} GB/s)"
        )
        print(f"  phases of the best, ms: {phases}")
        print(f"fused finite check alone: {check_gbs(views, args.reps):.1f} GB/s")
        print(f"device-to-device copy, same bytes: {copy:.1f} GB/s")
        print(f"ratio IPC handoff / D2D copy: {ipc / copy:.3f}")
    finally:
        engine.kill()
        engine.wait(timeout=60)


if __name__ == "__main__":
    main()
