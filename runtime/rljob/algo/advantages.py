"""Advantage estimators over padded response tensors [B, T] with a 0/1 mask.

GRPO (and GSPO, CISPO, which share its advantage) normalises rewards within each prompt's
group; REINFORCE++ uses discounted token-level returns whitened over the batch, and its
baseline variant subtracts the group's mean reward first; PPO uses GAE on a learned critic.
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-6


def group_normalized(rewards: Tensor, group_size: int) -> Tensor:
    """GRPO: (r − group mean) / (group std + eps), one value per sample."""
    groups = rewards.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True, correction=0)
    return ((groups - mean) / (std + EPS)).reshape(-1)


def group_centered(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE++-baseline: r − group mean, one value per sample.

    Subtracting the group's mean before the batch whitening removes the prompt's difficulty
    from the return while keeping REINFORCE++'s batch-wide scale instead of a per-group std.
    A group whose rewards are all equal is centred to 0, but the whitening then subtracts the
    mean over every response token, so it keeps an advantage when response lengths differ
    (which is why dynamic sampling is refused with this estimator).
    """
    groups = rewards.view(-1, group_size)
    return (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)


def whiten(values: Tensor, mask: Tensor) -> Tensor:
    """Zero-mean, unit-variance over the masked entries (masked-out entries become 0)."""
    count = mask.sum()
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / count
    return (values - mean) * torch.rsqrt(var + EPS) * mask


def token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None, kl_coef: float) -> Tensor:
    """Per-token rewards: the sample's reward on its last response token, minus kl_coef·KL."""
    out = torch.zeros_like(mask, dtype=torch.float32)
    last = mask.sum(dim=1).long() - 1
    rows = torch.arange(mask.shape[0])
    has = last >= 0
    out[rows[has], last[has]] = rewards[has].float()
    if kl is not None and kl_coef:
        out = out - kl_coef * kl * mask
    return out


def discounted_returns(token_reward: Tensor, mask: Tensor, gamma: float) -> Tensor:
    returns = torch.zeros_like(token_reward)
    running = torch.zeros(token_reward.shape[0], dtype=token_reward.dtype)
    for t in reversed(range(token_reward.shape[1])):
        running = token_reward[:, t] + gamma * running * mask[:, t]
        returns[:, t] = running
    return returns * mask


def reinforce_pp(token_reward: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++: discounted return-to-go, whitened over every response token."""
    return whiten(discounted_returns(token_reward, mask, gamma), mask)


def gae(
    token_reward: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """PPO: (whitened GAE advantages, value targets)."""
    adv = torch.zeros_like(token_reward)
    running = torch.zeros(token_reward.shape[0], dtype=token_reward.dtype)
    width = token_reward.shape[1]
    for t in reversed(range(width)):
        next_value = values[:, t + 1] * mask[:, t + 1] if t + 1 < width else 0.0
        delta = token_reward[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running * (mask[:, t + 1] if t + 1 < width else 0.0))
        adv[:, t] = running * mask[:, t]
    returns = (adv + values) * mask
    return whiten(adv, mask), returns
