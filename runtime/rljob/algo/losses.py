"""Policy, KL, entropy and value losses on padded [B, T] tensors.

Every loss is a per-token sum divided by a token count the caller chooses (the whole
optimizer mini-batch's response tokens), so micro-batching and data parallelism give
the same gradient as one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL(policy ‖ ref) estimators: k1 (log ratio), k2, k3 (low-variance, ≥ 0)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


@dataclass
class PolicyTerms:
    loss: Tensor
    pg_loss: Tensor
    kl: Tensor
    entropy: Tensor
    clipfrac: Tensor


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    entropy: Tensor,
    mask: Tensor,
    *,
    denominator: float,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    entropy_coef: float,
) -> PolicyTerms:
    """Clipped surrogate (asymmetric clip-higher) + KL loss (k3) − entropy bonus."""
    ratio = torch.exp(logp - old_logp)
    surrogate = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(surrogate, clipped)
    pg_loss = (per_token * mask).sum() / denominator
    clipfrac = ((clipped > surrogate).float() * mask).sum() / denominator
    ent = (entropy * mask).sum() / denominator
    if ref_logp is not None:
        kl = (kl_estimate(logp, ref_logp, "k3") * mask).sum() / denominator
    else:
        kl = torch.zeros((), dtype=pg_loss.dtype)
    loss = pg_loss + kl_coef * kl - entropy_coef * ent
    return PolicyTerms(loss, pg_loss, kl, ent, clipfrac)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float,
    denominator: float,
) -> Tensor:
    """Clipped value loss of PPO's critic."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return (per_token * mask).sum() / denominator
