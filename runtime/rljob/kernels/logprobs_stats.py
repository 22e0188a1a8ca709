"""Softmax statistics of a vocabulary shard, and how shards (and chunks) combine.

The fused log-prob path (`rljob.kernels.logprobs_fused`) never holds a `[tokens x vocab]`
tensor: per token it keeps four numbers over the vocabulary columns seen so far,

* `m`  the largest logit,
* `s`  `sum(exp(z - m))`,
* `sz` `sum(exp(z - m) * (z - m))` (for the entropy; shifted by `m` so that the entropy
  `log s - sz / s` never subtracts two large numbers),
* `tz` the target's logit (0 where the target lies outside these columns).

Two such summaries of disjoint column sets merge exactly (the online-softmax identity), so the
same algebra combines vocabulary chunks inside a rank and vocabulary shards across a
tensor-parallel group. It lives here, in plain torch and apart from Triton, so that the CPU
tests check the reduction the GPU path relies on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class Stats(NamedTuple):
    """Per-token softmax statistics of a set of vocabulary columns (each `[tokens]`, fp32)."""

    m: torch.Tensor
    s: torch.Tensor
    sz: torch.Tensor
    tz: torch.Tensor


def _rescaled(stats: Stats, m_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`s` and `sz` of `stats` re-expressed relative to the larger maximum `m_new`."""
    live = stats.s > 0  # a shard with no columns has m = -inf: it contributes nothing
    scale = torch.where(live, torch.exp(stats.m - m_new), 0.0)
    shift = torch.where(live, stats.m - m_new, 0.0)
    return stats.s * scale, (stats.sz + shift * stats.s) * scale


def merge(a: Stats, b: Stats) -> Stats:
    """Statistics of the union of two disjoint column sets."""
    m = torch.maximum(a.m, b.m)
    sa, sza = _rescaled(a, m)
    sb, szb = _rescaled(b, m)
    return Stats(m, sa + sb, sza + szb, a.tz + b.tz)


def all_reduce_stats(stats: Stats, group: dist.ProcessGroup | None) -> Stats:
    """Statistics over the whole vocabulary from each rank's shard: one MAX, one SUM.

    The target logit sums because exactly one shard holds each target (the others carry 0).
    """
    if group is None or dist.get_world_size(group) <= 1:
        return stats
    m = stats.m.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s, sz = _rescaled(stats, m)
    sums = torch.stack([s, sz, stats.tz])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return Stats(m, sums[0], sums[1], sums[2])


class Result(NamedTuple):
    """What the backward pass needs besides the inputs, and what the caller gets."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    mean_logit: torch.Tensor


def finish(stats: Stats) -> Result:
    """Log-prob of the target, entropy, log-sum-exp and E_p[z] from full-vocabulary stats."""
    log_s = torch.log(stats.s)
    lse = stats.m + log_s
    mean_shifted = stats.sz / stats.s
    return Result(
        logprobs=stats.tz - lse,
        entropy=log_s - mean_shifted,
        lse=lse,
        mean_logit=stats.m + mean_shifted,
    )


def stats_of(logits: torch.Tensor, local_targets: torch.Tensor) -> Stats:
    """Reference statistics of a `[tokens, columns]` block (fp32 or wider); targets outside
    `[0, columns)` contribute no target logit. Used by tests and as the definition the Triton
    kernel must reproduce."""
    n_cols = logits.shape[1]
    if n_cols == 0:
        n = logits.shape[0]
        zero = logits.new_zeros(n)
        return Stats(logits.new_full((n,), float("-inf")), zero, zero, zero)
    m = logits.amax(dim=1)
    shifted = logits - m[:, None]
    e = shifted.exp()
    inside = (local_targets >= 0) & (local_targets < n_cols)
    col = local_targets.clamp(0, n_cols - 1)
    tz = torch.where(inside, logits.gather(1, col[:, None]).squeeze(1), 0.0)
    return Stats(m, e.sum(dim=1), (e * shifted).sum(dim=1), tz)

