"""The softmax-statistics algebra the fused GPU path relies on, checked on CPU in float64.

Chunks merge inside a rank (`merge`) and shards merge across a tensor-parallel group
(`all_reduce_stats`, here over real gloo ranks); both must give the full-vocabulary log-probs
and entropies, also when a shard holds no column at all.
"""

from __future__ import annotations

import itertools
import os
import socket
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rljob.kernels.logprobs_stats import Stats, all_reduce_stats, finish, merge, stats_of

pytestmark = pytest.mark.unit


def _logits(n: int, v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # A wide spread (about ±30): a merge that forgets to rescale is far off.
    logits = torch.randn(n, v, generator=g, dtype=torch.float64) * 10
    return logits, torch.randint(0, v, (n,), generator=g)


def _expected(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def test_chunks_merge_to_the_full_vocabulary() -> None:
    logits, targets = _logits(11, 97, seed=1)
    bounds = [0, 5, 5, 40, 96, 97]  # includes an empty chunk and a one-column chunk
    acc = stats_of(logits[:, :0], targets)
    for lo, hi in itertools.pairwise(bounds):
        acc = merge(acc, stats_of(logits[:, lo:hi], targets - lo))
    res = finish(acc)
    lp, ent = _expected(logits, targets)
    torch.testing.assert_close(res.logprobs, lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(res.entropy, ent, atol=1e-12, rtol=0)
    torch.testing.assert_close(res.lse, torch.logsumexp(logits, -1), atol=1e-12, rtol=0)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(res.mean_logit, (p * logits).sum(-1), atol=1e-12, rtol=0)


def test_merge_order_does_not_matter() -> None:
    logits, targets = _logits(7, 30, seed=2)
    parts = [stats_of(logits[:, lo:hi], targets - lo) for lo, hi in ((0, 9), (9, 21), (21, 30))]
    a = finish(merge(merge(parts[0], parts[1]), parts[2]))
    b = finish(merge(parts[2], merge(parts[1], parts[0])))
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-12, rtol=0)
    torch.testing.assert_close(a.entropy, b.entropy, atol=1e-12, rtol=0)


# Rank r holds columns [BOUNDS[r], BOUNDS[r + 1]): uneven, and rank 2 holds none (a shard made
# only of padding rows once they are cut).
BOUNDS = [0, 13, 50, 50]


def _worker(rank: int, world: int, port: int, path: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        logits, targets = _logits(9, BOUNDS[-1], seed=3)
        lo, hi = BOUNDS[rank], BOUNDS[rank + 1]
        local: Stats = stats_of(logits[:, lo:hi], targets - lo)
        res = finish(all_reduce_stats(local, dist.group.WORLD))
        torch.save({"lp": res.logprobs, "ent": res.entropy}, f"{path}.{rank}")
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_shards_all_reduce_to_the_full_vocabulary(tmp_path: Any) -> None:
    world = len(BOUNDS) - 1
    path = str(tmp_path / "out")
    mp.start_processes(  # type: ignore[attr-defined, no-untyped-call]
        _worker, args=(world, _free_port(), path), nprocs=world, start_method="spawn"
    )
    logits, targets = _logits(9, BOUNDS[-1], seed=3)
    lp, ent = _expected(logits, targets)
    for rank in range(world):
        out = torch.load(f"{path}.{rank}")
        torch.testing.assert_close(out["lp"], lp, atol=1e-12, rtol=0)
        torch.testing.assert_close(out["ent"], ent, atol=1e-12, rtol=0)


def test_no_group_leaves_the_stats_alone() -> None:
    logits, targets = _logits(4, 6, seed=4)
    stats = stats_of(logits, targets)
    assert all_reduce_stats(stats, None) is stats
