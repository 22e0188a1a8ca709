"""One rollout step's samples as every trainer backend sees them: padded tensors,
micro-batches, advantages, the initial-KL check and the step's metrics. Kept in one module
both backends import, so a job gives the same numbers whichever backend trains it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rljob.algo import advantages as adv_fns
from rljob.sample import Sample
from rljob_api.spec import AlgorithmSpec


class InitialKLMismatch(AssertionError):
    """Reference and actor log-probs differ before any update: the two models differ."""


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


def micro_batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def widen(t: Tensor, width: int) -> Tensor:
    """`t` right-padded with zeros to `width` columns."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def rewards_of(samples: list[Sample], device: torch.device | None = None) -> Tensor:
    """Per-sample rewards; NaN where a reward is missing, so nothing passes for zero."""
    return torch.tensor([float("nan") if s.reward is None else s.reward for s in samples],
                        dtype=torch.float32, device=device)


def verify_initial_kl(old: Tensor, ref: Tensor) -> None:
    """At step 0 the reference must be the policy itself: any gap means the two differ."""
    if not torch.equal(ref, old):
        gap = float((ref - old).abs().max())
        raise InitialKLMismatch(
            f"reference and actor log-probs differ at step 0 (max |Δ| = {gap:.3e}); "
            "the reference must be the initial policy")


def advantages(
    algo: AlgorithmSpec, rewards: Tensor, old: Tensor, ref: Tensor, mask: Tensor,
    values: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token advantages `[N, T]` and, for PPO (which needs the critic's `values`), the
    returns the critic is trained towards."""
    kl_tok = (old - ref) * mask
    in_reward = algo.kl_mode == "reward" and algo.kl_coef > 0
    if algo.estimator == "grpo":
        if in_reward:
            rewards = rewards - algo.kl_coef * kl_tok.sum(dim=1)
        per_sample = adv_fns.group_normalized(rewards, algo.n_samples_per_prompt)
        return per_sample.unsqueeze(1) * mask, None
    token_reward = adv_fns.token_rewards(rewards, mask, kl_tok if in_reward else None,
                                         algo.kl_coef)
    if algo.estimator == "reinforce++":
        return adv_fns.reinforce_pp(token_reward, mask, algo.gamma), None
    assert values is not None
    return adv_fns.gae(token_reward, values, mask, algo.gamma, algo.lam)
