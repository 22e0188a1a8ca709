"""CPU weight-sync throughput against this machine's memcpy rate, measured in the same run.

One trainer (a real `WeightPublisher`, in this process) publishes versions to `--engines`
engines, each a separate process with its own real `rljob-weight-sync` sidecar process,
over gloo on loopback. A version counts as delivered when every engine acknowledged it
(received, digest checked, finite-scanned, installed through shared memory, version read
back). Printed: GB/s per engine (version bytes / publish seconds), the aggregate over
engines, and the memcpy rate (torch copy_) of the same number of bytes.

    .venv/bin/python benchmarks/weight_sync_cpu.py --size-mb 256 --engines 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rljob.weightsync.publisher import PublisherConfig, WeightPublisher

HERE = Path(__file__).resolve().parent


def memcpy_gbs(nbytes: int, reps: int = 5) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return nbytes / best / 1e9


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--tensor-mb", type=int, default=16)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    count = max(1, args.size_mb // args.tensor_mb)
    params = {f"layers.{i}.weight": torch.randn(args.tensor_mb << 18) for i in range(count)}
    nbytes = sum(t.numel() * 4 for t in params.values())
    work = Path(tempfile.mkdtemp(prefix="ws-bench-"))
    layout = work / "layout.json"
    layout.write_text(json.dumps({n: ["float32", list(t.shape)] for n, t in params.items()}))
    publisher = WeightPublisher(
        PublisherConfig(port=0, bucket_bytes=args.bucket_mb << 20, ack_timeout_s=600)
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(args.engines):
            port_file = work / f"e{i}.port"
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(HERE / "weight_sync_engine.py"),
                        "--layout",
                        str(layout),
                        "--device",
                        "cpu",
                        "--port-file",
                        str(port_file),
                    ],
                    env=env,
                )
            )
            deadline = time.monotonic() + 120
            while not port_file.exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"engine {i} did not start")
                time.sleep(0.1)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "rljob.engine.sidecar",
                        "--trainer",
                        f"127.0.0.1:{publisher.port}",
                        "--engine-url",
                        f"http://127.0.0.1:{port_file.read_text()}",
                        "--engine-name",
                        f"e{i}",
                        "--listen",
                        "127.0.0.1:0",
                        "--advertise-host",
                        "127.0.0.1",
                        "--device",
                        "cpu",
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        publisher.wait_for_engines(args.engines, timeout_s=120)
        copy = memcpy_gbs(nbytes)
        print(
            f"version size {nbytes / 1e6:.0f} MB in {count} tensors, buckets of "
            f"{args.bucket_mb} MiB, {args.engines} engines, {os.cpu_count()} cores"
        )
        print(
            f"memcpy (torch copy_, same bytes, {torch.get_num_threads()} threads): {copy:.2f} GB/s"
        )
        version = 0
        for verified in (True, False):
            publisher.config = dataclasses.replace(
                publisher.config, verify_digest=verified, scan_nonfinite=verified
            )
            times = []
            for rep in range(args.reps + 1):
                version += 1
                with torch.no_grad():
                    for t in params.values():
                        t.add_(1e-3)
                result = publisher.publish(version, params.items())
                if result.stale:
                    raise SystemExit(f"version {version} not delivered: {result.stale}")
                if rep:
                    times.append(result.seconds)
            best = min(times)
            per_engine = nbytes / best / 1e9
            label = "digest + finite scan" if verified else "no verification"
            print(
                f"sync ({label}): {best:.2f}s per version, {per_engine:.3f} GB/s per engine, "
                f"{per_engine * args.engines:.3f} GB/s aggregate; "
                f"ratio to memcpy {per_engine / copy:.3f} (per engine), "
                f"{per_engine * args.engines / copy:.3f} (aggregate)"
            )
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        publisher.close()


if __name__ == "__main__":
    main()
