"""One rollout step's samples as every trainer backend sees them: padded tensors,
micro-batches, advantages, the initial-KL check and the step's metrics. Kept in one module
both backends import, so a job gives the same numbers whichever backend trains it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rljob.algo import advantages as adv_fns
from rljob.algo.losses import LossKind, truncated_is_weights
from rljob.rollout.sample import Sample
from rljob.trainer.metrics import OptimizerFigures, StepFigures, TrainMetrics
from rljob_api.spec import AlgorithmSpec, OldLogprobs


class InitialKLMismatch(AssertionError):
    """Reference and actor log-probs differ before any update: the two models differ."""


@dataclass
class PaddedBatch:
    """Samples as right-padded tensors, prompt and response lengths kept per row."""

    input_ids: Tensor  # [B, L], right-padded
    attention_mask: Tensor  # [B, L]
    prompt_lengths: list[int]
    response_lengths: list[int]
    loss_mask: Tensor  # [B, T] float, T = longest response
    rollout_logp: Tensor  # [B, T]

    def to(self, device: torch.device) -> PaddedBatch:
        return PaddedBatch(self.input_ids.to(device), self.attention_mask.to(device),
                           self.prompt_lengths, self.response_lengths,
                           self.loss_mask.to(device), self.rollout_logp.to(device))


def collate(samples: list[Sample], pad_id: int) -> PaddedBatch:
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
    return PaddedBatch(ids, attn, [len(s.tokens) - s.response_length for s in samples],
                       [s.response_length for s in samples], mask, rollout)


@dataclass(frozen=True)
class PolicySettings:
    """What the shared policy loss needs from the spec, derived once for both backends."""

    kind: LossKind
    clip_low: float
    clip_high: float
    kl_coef: float  # of the KL loss term; 0 when the KL goes into the reward or nowhere
    entropy_coef: float


def policy_settings(algo: AlgorithmSpec) -> PolicySettings:
    """gspo clips its sequence ratio in its own (much narrower) range; every other estimator
    uses clipEps/clipEpsHigh (cispo as the bounds of its detached token weight)."""
    if algo.estimator == "gspo":
        low, high = algo.gspo.clip_eps, algo.gspo.clip_eps_high
    else:
        low = algo.clip_eps
        high = algo.clip_eps_high if algo.clip_eps_high is not None else algo.clip_eps
    kind: LossKind = "gspo" if algo.estimator == "gspo" else (
        "cispo" if algo.estimator == "cispo" else "ppo")
    return PolicySettings(kind, low, high, algo.kl_coef if algo.kl_mode == "loss" else 0.0,
                          algo.entropy_coef)


def old_policy_logprobs(source: OldLogprobs, trainer: Tensor, rollout: Tensor, mask: Tensor
                        ) -> Tensor:
    """The old log-probs of the loss's ratio and clip `[N, T]`: the trainer's recompute, or
    the engine's log-probs of the tokens it sampled (`algorithm.oldLogprobs`). Positions
    outside the loss mask (masked tokens inside a response) keep the trainer's, so a
    non-finite engine value there cannot reach the loss through 0 × inf."""
    if source == OldLogprobs.trainer:
        return trainer
    return torch.where(mask > 0, rollout, trainer)


@dataclass(frozen=True)
class TruncatedIS:
    """Per-token truncated importance weights `[N, T]` and the 0/1 marks of truncated ones."""

    weights: Tensor
    truncated: Tensor


def truncated_is(algo: AlgorithmSpec, old: Tensor, rollout_logp: Tensor, mask: Tensor
                 ) -> TruncatedIS | None:
    """The step's TIS weights when `spec.algorithm.tis` is enabled, else None."""
    if not algo.tis.enabled:
        return None
    return TruncatedIS(*truncated_is_weights(old, rollout_logp, mask, algo.tis.cap))


def rollout_summary(
    samples: list[Sample], old: Tensor, ref: Tensor, rollout_logp: Tensor, mask: Tensor,
    steps: list[StepFigures], skipped: list[str], tis: TruncatedIS | None,
) -> TrainMetrics:
    """One rollout step's metrics, the same for every trainer backend: the means of its
    optimizer steps' figures, reward, KL to the reference, the rollout-vs-trainer log-prob
    gap per response token and, with TIS, the mean weight and the share of tokens whose
    weight the cap truncated. `skipped` says why each skipped one of `steps` was."""
    tokens = max(float(mask.sum()), 1.0)
    rewards = [float("nan") if s.reward is None else s.reward for s in samples]
    gap = (rollout_logp - old).abs() * mask
    return TrainMetrics(
        step_means=OptimizerFigures.mean(steps),
        reward=float(np.mean(rewards)),
        kl=float(((old - ref) * mask).sum()) / tokens,
        logprob_gap=float(gap.sum()) / tokens,
        logprob_gap_max=float(gap.max()) if gap.numel() else 0.0,
        response_length=float(np.mean([s.response_length for s in samples])),
        step_skipped=[s.skipped for s in steps],
        nonfinite=skipped,
        tis_weight=None if tis is None else float(tis.weights.sum()) / tokens,
        tis_truncated=None if tis is None else float(tis.truncated.sum()) / tokens,
    )


def per_sample(logp: Tensor, response_lengths: list[int]) -> list[list[float]]:
    """Padded `[N, T]` response log-probs as one list per sample, padding dropped."""
    rows = logp.detach().float().cpu().tolist()
    return [row[:n] for row, n in zip(rows, response_lengths, strict=True)]


def micro_batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def widen(t: Tensor, width: int) -> Tensor:
    """`t` right-padded with zeros to `width` columns."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def rewards_of(samples: list[Sample], device: torch.device | None = None) -> Tensor:
    """Per-sample rewards; NaN where a reward is missing, so nothing passes for zero."""
    return torch.tensor([float("nan") if s.reward is None else s.reward for s in samples],
                        dtype=torch.float32, device=device)


INITIAL_KL_TOLERANCE = 1e-4
"""Largest step-0 gap between reference and policy log-probs taken for rounding. Two copies of
the same weights need not be bit-equal on a GPU: Megatron's policy (parameters that are views
into DDP's contiguous buffer) and its plain reference module gave float32 log-probs up to
4.8e-7 apart on an H200. The check is for a reference that is not the initial policy at all
(a random init, another dtype, another checkpoint)."""


def verify_initial_kl(old: Tensor, ref: Tensor) -> None:
    """At step 0 the reference must be the policy itself: a gap beyond rounding means the
    two differ."""
    # Equal entries (a -inf in both included) are no gap.
    diff = torch.where(ref == old, torch.zeros_like(ref), ref - old)
    gap = float(diff.abs().max()) if ref.numel() else 0.0
    if not gap <= INITIAL_KL_TOLERANCE:  # a NaN gap fails too
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
    if algo.estimator in ("grpo", "gspo", "cispo"):
        if in_reward:
            rewards = rewards - algo.kl_coef * kl_tok.sum(dim=1)
        per_sample = adv_fns.group_normalized(rewards, algo.n_samples_per_prompt)
        return per_sample.unsqueeze(1) * mask, None
    if algo.estimator == "reinforce++_baseline":
        rewards = adv_fns.group_centered(rewards, algo.n_samples_per_prompt)
    token_reward = adv_fns.token_rewards(rewards, mask, kl_tok if in_reward else None,
                                         algo.kl_coef)
    if algo.estimator in ("reinforce++", "reinforce++_baseline"):
        return adv_fns.reinforce_pp(token_reward, mask, algo.gamma), None
    assert values is not None
    return adv_fns.gae(token_reward, values, mask, algo.gamma, algo.lam)
