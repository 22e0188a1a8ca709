"""Trainer → engine weight publishing behind one small interface.

`publish(version, named_tensors)` returns the engines that acknowledged the version. Two
publishers live here: tensors through the engines' `/update_weights_from_tensor` (shared
memory on one host) and HF safetensors directories through `/update_weights_from_disk`.
The versioned broadcast of `rljob.weightsync` can replace either behind the same call.
Weights are scanned before anything is sent: a NaN/Inf is never offered to an engine.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file

from rljob.engine.client import EngineClient, EngineError
from rljob.engine.serialize import NamedTensors, serialize


class NonFiniteWeights(ValueError):
    """Weights holding NaN/Inf; they were not sent."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        super().__init__(f"non-finite values in {len(names)} tensor(s): {', '.join(names[:5])}")


class WeightPublisher(Protocol):
    def publish(self, version: int, named: NamedTensors) -> list[str]: ...


def nonfinite_names(named: NamedTensors) -> list[str]:
    return [name for name, t in named if not bool(torch.isfinite(t).all())]


def buckets(named: NamedTensors, bucket_bytes: int) -> list[NamedTensors]:
    """Consecutive groups of tensors of at most `bucket_bytes` (a bigger tensor goes alone)."""
    out: list[NamedTensors] = [[]]
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nbytes
    return [b for b in out if b]


async def _each(urls: list[str], timeout_s: float, call: str, *args: str) -> list[str]:
    """Run one update call on every engine; return the URLs that acknowledged it."""

    async def one(url: str) -> str | None:
        async with EngineClient(url, update_timeout_s=timeout_s) as client:
            try:
                await client.pause()
                try:
                    if call == "tensor":
                        for text in args[1:]:
                            await client.update_weights_from_tensor([text], args[0])
                    else:
                        await client.update_weights_from_disk(args[1], args[0])
                finally:
                    await client.resume()
            except EngineError:
                return None
        return url

    acked = await asyncio.gather(*(one(u) for u in urls))
    return [u for u in acked if u is not None]


class TensorPublisher:
    """Shared-memory (CPU) or CUDA-IPC (GPU) tensors, one request per bucket, per engine."""

    def __init__(self, urls: list[str], bucket_bytes: int, timeout_s: float) -> None:
        self.urls = urls
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s

    def publish(self, version: int, named: NamedTensors) -> list[str]:
        bad = nonfinite_names(named)
        if bad:
            raise NonFiniteWeights(bad)
        texts = [serialize(b) for b in buckets(named, self.bucket_bytes)]
        return asyncio.run(_each(self.urls, self.timeout_s, "tensor", str(version), *texts))


class DiskPublisher:
    """An HF safetensors directory per version under `root`; only the newest is kept."""

    def __init__(self, urls: list[str], root: Path, timeout_s: float) -> None:
        self.urls = urls
        self.root = root
        self.timeout_s = timeout_s

    def publish(self, version: int, named: NamedTensors) -> list[str]:
        bad = nonfinite_names(named)
        if bad:
            raise NonFiniteWeights(bad)
        target = self.root / f"weight_v{version:08d}"
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({n: t.contiguous() for n, t in named}, str(tmp / "model.safetensors"))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        acked = asyncio.run(_each(self.urls, self.timeout_s, "disk", str(version), str(target)))
        for old in self.root.glob("weight_v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        return acked
