"""Policy, KL, entropy and value losses on padded [B, T] tensors.

Every loss is a per-token sum divided by a token count the caller chooses (the whole
optimizer mini-batch's response tokens), so micro-batching and data parallelism give
the same gradient as one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

# How the policy term uses the importance ratio: `ppo` clips token ratios (grpo, ppo and the
# reinforce++ estimators), `gspo` clips one ratio per sequence, `cispo` clips the detached
# token weight of a plain log-prob gradient.
LossKind = Literal["ppo", "gspo", "cispo"]


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


def sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's ratio per token: every token of a response carries the value
    s = exp(mean over its tokens of (logp − old_logp)), and the gradient of token t is
    s · ∇logp_t (written sg(s) · exp(logp − sg(logp)), sg = stop-gradient), so the
    sequence-level ratio weighs each token's own log-prob gradient."""
    tokens = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    seq = torch.exp((((logp - old_logp) * mask).sum(dim=1, keepdim=True) / tokens).detach())
    return seq * torch.exp(logp - logp.detach())


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
    kind: LossKind = "ppo",
    is_weight: Tensor | None = None,
) -> PolicyTerms:
    """Policy term + KL loss (k3) − entropy bonus.

    `ppo`: clipped surrogate on token ratios (asymmetric clip-higher). `gspo`: the same clip
    on the sequence ratio of `sequence_ratio`, so a response is kept or dropped whole.
    `cispo`: −sg(clip(ratio)) · A · logp, where clipping bounds the weight but never removes
    a token from the gradient (PPO's clip zeroes the gradient of tokens outside the range,
    often the rare tokens that matter for reasoning). `is_weight`, when given, is the
    detached truncated importance weight of every token (trainer vs engine policy); it
    multiplies each token's policy term. `clipfrac` is the share of tokens whose ratio was
    clipped.
    """
    ratio = sequence_ratio(logp, old_logp, mask) if kind == "gspo" else torch.exp(logp - old_logp)
    bounded = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    if kind == "cispo":
        per_token = -bounded.detach() * advantages * logp
        clipped_tokens = (bounded != ratio).float()
    else:
        surrogate = -advantages * ratio
        clipped = -advantages * bounded
        per_token = torch.maximum(surrogate, clipped)
        clipped_tokens = (clipped > surrogate).float()
    if is_weight is not None:
        per_token = per_token * is_weight
    pg_loss = (per_token * mask).sum() / denominator
    clipfrac = (clipped_tokens * mask).sum() / denominator
    ent = (entropy * mask).sum() / denominator
    if ref_logp is not None:
        kl = (kl_estimate(logp, ref_logp, "k3") * mask).sum() / denominator
    else:
        kl = torch.zeros((), dtype=pg_loss.dtype)
    loss = pg_loss + kl_coef * kl - entropy_coef * ent
    return PolicyTerms(loss, pg_loss, kl, ent, clipfrac)


def truncated_is_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float
                         ) -> tuple[Tensor, Tensor]:
    """TIS: per-token min(exp(old_logp − rollout_logp), cap) (0 where masked), and a 0/1
    tensor marking the tokens whose weight was truncated. The samples were drawn by the
    engine's policy while the loss treats the trainer's recomputation as the behaviour
    policy, so this ratio corrects the mismatch; the cap bounds its variance."""
    ratio = torch.exp(old_logp - rollout_logp) * mask
    return torch.clamp(ratio, max=cap).detach(), (ratio > cap).float() * mask


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float,
    denominator: float,
) -> Tensor:
    """Clipped value loss of PPO's critic."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return (per_token * mask).sum() / denominator
