"""Advantage estimators and losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rljob.algo.advantages import (
    discounted_returns,
    gae,
    group_normalized,
    reinforce_pp,
    token_rewards,
    whiten,
)
from rljob.algo.losses import kl_estimate, policy_loss, value_loss

pytestmark = pytest.mark.unit


def test_grpo_normalises_within_each_group() -> None:
    adv = group_normalized(torch.tensor([1.0, 0.0, 0.0, 5.0, 5.0, 5.0]), 3)
    std = math.sqrt(2 / 9)
    assert adv[:3].tolist() == pytest.approx([(2 / 3) / std, -(1 / 3) / std, -(1 / 3) / std],
                                             rel=1e-4)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # a group with equal rewards teaches nothing


def test_grpo_propagates_nan_rewards() -> None:
    adv = group_normalized(torch.tensor([float("nan"), 1.0]), 2)
    assert torch.isnan(adv).all()


def test_token_rewards_and_returns() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    tr = token_rewards(torch.tensor([2.0, 3.0]), mask, None, 0.0)
    assert tr.tolist() == [[0.0, 0.0, 2.0], [3.0, 0.0, 0.0]]
    ret = discounted_returns(tr, mask, 0.5)
    assert ret.tolist() == [[0.5, 1.0, 2.0], [3.0, 0.0, 0.0]]
    adv = reinforce_pp(tr, mask, 0.5)
    assert float((adv * mask).sum()) == pytest.approx(0.0, abs=1e-6)
    assert adv[1, 1:].tolist() == [0.0, 0.0]


def test_kl_in_reward_subtracts_per_token_kl() -> None:
    mask = torch.ones(1, 2)
    tr = token_rewards(torch.tensor([1.0]), mask, torch.tensor([[0.5, 0.25]]), 2.0)
    assert tr.tolist() == [[-1.0, 0.5]]


def test_gae_with_lambda_one_equals_returns_minus_values() -> None:
    mask = torch.ones(1, 3)
    tr = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.6]])
    _, returns = gae(tr, values, mask, 1.0, 1.0)
    assert torch.allclose(returns, torch.ones(1, 3))


def test_whiten_ignores_masked_entries() -> None:
    out = whiten(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert out[0, :2].tolist() == pytest.approx([-1.0, 1.0], abs=1e-4)
    assert out[0, 2] == 0


def test_kl_estimators() -> None:
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert kl_estimate(ref, ref, "k3").item() == 0.0


def test_policy_loss_clips_asymmetrically() -> None:
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    terms = policy_loss(logp, old, None, adv, torch.zeros(1, 2), mask, denominator=2.0,
                        clip_low=0.2, clip_high=0.28, kl_coef=0.0, entropy_coef=0.0)
    # positive advantage: min(1.5, 1.28) · 1; negative advantage: max(0.5, 0.8) · −1
    assert terms.pg_loss.item() == pytest.approx((-1.28 + 0.8) / 2)
    assert terms.clipfrac.item() == pytest.approx(1.0)


def test_policy_gradient_direction_and_entropy_bonus() -> None:
    logp = torch.zeros(1, 1, requires_grad=True)
    terms = policy_loss(logp, torch.zeros(1, 1), None, torch.ones(1, 1), torch.ones(1, 1),
                        torch.ones(1, 1), denominator=1.0, clip_low=0.2, clip_high=0.2,
                        kl_coef=0.0, entropy_coef=0.5)
    terms.loss.backward()
    assert logp.grad is not None and logp.grad.item() < 0  # descent raises a good token's logp
    assert terms.loss.item() == pytest.approx(-1.0 - 0.5)


def test_value_loss_clipped() -> None:
    loss = value_loss(torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[0.0]]),
                      torch.ones(1, 1), clip=0.5, denominator=1.0)
    assert loss.item() == pytest.approx(0.5 * 4.0)  # max of unclipped 4 and clipped 0.25
