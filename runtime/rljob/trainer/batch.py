"""Samples → padded tensors for one forward pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rljob.sample import Sample


@dataclass
class Batch:
    input_ids: Tensor  # [B, L], right-padded
    attention_mask: Tensor  # [B, L]
    prompt_lengths: list[int]
    response_lengths: list[int]
    loss_mask: Tensor  # [B, T] float, T = longest response
    rollout_logp: Tensor  # [B, T]

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device),
                     self.prompt_lengths, self.response_lengths, self.loss_mask.to(device),
                     self.rollout_logp.to(device))


def collate(samples: list[Sample], pad_id: int) -> Batch:
    width = max(len(s.tokens) for s in samples)
    t_max = max(s.response_length for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), t_max), dtype=torch.float32)
    rollout = torch.zeros((len(samples), t_max), dtype=torch.float32)
    for row, s in enumerate(samples):
        ids[row, : len(s.tokens)] = torch.tensor(s.tokens, dtype=torch.long)
        attn[row, : len(s.tokens)] = 1
        mask[row, : s.response_length] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if s.rollout_log_probs:
            rollout[row, : s.response_length] = torch.tensor(s.rollout_log_probs)
    return Batch(ids, attn, [len(s.tokens) - s.response_length for s in samples],
                 [s.response_length for s in samples], mask, rollout)


def rollout_summary(
    samples: list[Sample], old: Tensor, ref: Tensor, rollout_logp: Tensor, mask: Tensor,
    steps: list[dict[str, float]], skipped: list[str],
) -> dict[str, Any]:
    """One rollout step's metrics, the same for every trainer backend: step means, reward,
    KL to the reference and the rollout-vs-trainer log-prob gap per response token."""
    tokens = max(float(mask.sum()), 1.0)
    rewards = [float("nan") if s.reward is None else s.reward for s in samples]
    out: dict[str, Any] = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}
    out.update({
        "reward": float(np.mean(rewards)),
        "kl": float(((old - ref) * mask).sum()) / tokens,
        "logprob_gap": float(((rollout_logp - old).abs() * mask).sum()) / tokens,
        "response_length": float(np.mean([s.response_length for s in samples])),
        "step_skipped": [bool(s["skipped"]) for s in steps],
        "optimizer_steps": len(steps) - len(skipped),
        "skipped_steps": len(skipped),
        "nonfinite": skipped,
    })
    return out
