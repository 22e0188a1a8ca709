"""Advantage estimators and losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rljob.algo.advantages import (
    discounted_returns,
    gae,
    group_centered,
    group_normalized,
    reinforce_pp,
    token_rewards,
    whiten,
)
from rljob.algo.losses import kl_estimate, policy_loss, truncated_is_weights, value_loss
from rljob.rollout.sample import Sample
from rljob.trainer.batch import advantages, policy_settings, rollout_summary, truncated_is
from rljob.trainer.metrics import StepFigures
from rljob_api.spec import AlgorithmSpec

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


def _algo(**fields: object) -> AlgorithmSpec:
    return AlgorithmSpec.model_validate({"rolloutBatchSize": 2, "nSamplesPerPrompt": 2,
                                         "globalBatchSize": 4, "microBatchSize": 4, **fields})


def test_reinforce_pp_baseline_subtracts_the_group_mean_before_whitening() -> None:
    assert group_centered(torch.tensor([1.0, 0.0, 0.0, 5.0, 5.0, 5.0]), 3).tolist() == \
        pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])
    mask = torch.ones(4, 1)  # one response token each, groups of two
    zero = torch.zeros(4, 1)
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    base, _ = advantages(_algo(estimator="reinforce++_baseline", klCoef=0.0), rewards, zero,
                         zero, mask)
    # centred: [0.5, -0.5, 0, 0]; batch mean 0, variance (0.25 + 0.25) / 4 = 0.125,
    # std 0.353553: [1.414214, -1.414214, 0, 0] (zero for the equal-reward group here only
    # because every response is one token long: the whitening's mean is over tokens)
    assert base[:, 0].tolist() == pytest.approx([1.414214, -1.414214, 0.0, 0.0], abs=1e-4)
    plain, _ = advantages(_algo(estimator="reinforce++"), rewards, zero, zero, mask)
    # without the baseline: mean 1.75, variance (0.5625 + 3.0625 + 1.5625 + 1.5625) / 4
    # = 1.6875, std 1.299038: [-0.577350, -1.347151, 0.962250, 0.962250]
    assert plain[:, 0].tolist() == pytest.approx([-0.57735, -1.347151, 0.96225, 0.96225],
                                                 abs=1e-4)


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
def test_gspo_and_cispo_use_grpo_advantages(estimator: str) -> None:
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    zero = torch.zeros(4, 2)
    adv, returns = advantages(_algo(estimator=estimator), torch.tensor([1.0, 0.0, 2.0, 2.0]),
                              zero, zero, mask)
    # group (1, 0): mean 0.5, std 0.5 -> ±1 on every response token; group (2, 2): 0
    assert adv.flatten().tolist() == pytest.approx([1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                                                   abs=1e-5)
    assert returns is None


def test_gspo_clips_and_weighs_the_sequence_ratio() -> None:
    old = torch.zeros(2, 2)
    # sequence 1: mean log-ratio 0.0003, s = 1.00030004, inside [1 - 3e-4, 1 + 4e-4];
    # sequence 2: mean 0.002, s = 1.002002, above 1 + 4e-4: clipped
    logp = torch.tensor([[0.0002, 0.0004], [0.001, 0.003]], requires_grad=True)
    settings = policy_settings(_algo(estimator="gspo"))
    assert (settings.kind, settings.clip_low, settings.clip_high) == ("gspo", 3e-4, 4e-4)
    terms = policy_loss(logp, old, None, torch.ones(2, 2), torch.zeros(2, 2), torch.ones(2, 2),
                        denominator=4.0, clip_low=3e-4, clip_high=4e-4, kl_coef=0.0,
                        entropy_coef=0.0, kind="gspo")
    # (-2 · 1.00030004 - 2 · 1.0004) / 4
    assert terms.pg_loss.item() == pytest.approx(-1.00035002, abs=1e-7)
    assert terms.clipfrac.item() == pytest.approx(0.5)
    terms.loss.backward()
    assert logp.grad is not None
    # both tokens of sequence 1 get -s / 4 = -0.25007501 although their token ratios differ
    # (PPO would give -exp(0.0002) / 4 and -exp(0.0004) / 4); sequence 2 is clipped whole
    assert logp.grad.flatten().tolist() == pytest.approx([-0.25007501, -0.25007501, 0.0, 0.0],
                                                         abs=1e-7)


def test_cispo_keeps_every_token_in_the_gradient() -> None:
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()  # ratios
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    settings = policy_settings(_algo(estimator="cispo", clipEpsHigh=0.28))
    assert (settings.kind, settings.clip_low, settings.clip_high) == ("cispo", 0.2, 0.28)
    terms = policy_loss(logp, old, None, adv, torch.zeros(1, 3), torch.ones(1, 3),
                        denominator=3.0, clip_low=0.2, clip_high=0.28, kl_coef=0.0,
                        entropy_coef=0.0, kind="cispo")
    # weights clip(r, 0.8, 1.28) = [1.28, 0.8, 1.1]; -w · A · logp =
    # [-1.28 · 0.405465, -0.8 · -0.693147, 1.1 · 0.095310] = [-0.518995, 0.554518, 0.104841]
    assert terms.pg_loss.item() == pytest.approx((-0.518995 + 0.554518 + 0.104841) / 3,
                                                 abs=1e-6)
    assert terms.clipfrac.item() == pytest.approx(2 / 3)
    terms.loss.backward()
    assert logp.grad is not None
    # d/dlogp = -w · A / 3: the clipped tokens still move (PPO's clip would zero the first)
    assert logp.grad[0].tolist() == pytest.approx([-1.28 / 3, -0.8 / 3, 1.1 / 3], abs=1e-6)


def test_truncated_importance_weights_and_their_metrics() -> None:
    old = torch.zeros(1, 4)
    rollout = torch.tensor([[-0.1, 0.5, -1.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, truncated = truncated_is_weights(old, rollout, mask, 2.0)
    # exp(old - rollout) = [e^0.1, e^-0.5, e^1, (masked)] = [1.105171, 0.606531, 2.718282, -]
    assert weights[0].tolist() == pytest.approx([1.105171, 0.606531, 2.0, 0.0], abs=1e-6)
    assert truncated.tolist() == [[0.0, 0.0, 1.0, 0.0]]
    logp = torch.zeros(1, 4, requires_grad=True)
    terms = policy_loss(logp, old, None, torch.ones(1, 4), torch.zeros(1, 4), mask,
                        denominator=3.0, clip_low=0.2, clip_high=0.2, kl_coef=0.0,
                        entropy_coef=0.0, is_weight=weights)
    assert terms.pg_loss.item() == pytest.approx(-(1.105171 + 0.606531 + 2.0) / 3, abs=1e-6)
    terms.loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-1.105171 / 3, -0.606531 / 3, -2.0 / 3, 0.0],
                                                  abs=1e-6)

    assert truncated_is(_algo(), old, rollout, mask) is None  # off by default
    tis = truncated_is(_algo(tis={"enabled": True, "cap": 2.0}), old, rollout, mask)
    assert tis is not None
    samples = [Sample(prompt="p", reward=1.0, response_length=3)]
    step = StepFigures(loss=0.5, pg_loss=0.0, kl_loss=0.0, entropy=0.0, clipfrac=0.0,
                       value_loss=0.0, grad_norm=0.0, skipped=False)
    m = rollout_summary(samples, old, old, rollout, mask, [step], [], tis)
    assert m.tis_weight == pytest.approx((1.105171 + 0.606531 + 2.0) / 3, abs=1e-6)
    assert m.tis_truncated == pytest.approx(1 / 3)
    # |rollout - old| over the response tokens: 0.1, 0.5, 1.0 (the masked 5.0 is not counted)
    assert m.logprob_gap == pytest.approx(1.6 / 3)
    assert m.logprob_gap_max == pytest.approx(1.0)
    assert rollout_summary(samples, old, old, rollout, mask, [step], [], None).tis_weight is None
