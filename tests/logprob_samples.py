"""Samples and their float64 reference log-probs for the trainers' `logprobs` tests (torch
ranks in Ray, the Megatron actor on a GPU); no Ray import, so a GPU machine without Ray can
use it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rljob.rollout.sample import Sample, Status
from rljob.trainer.metrics import TrainMetrics

TEMPERATURE = 0.7


def samples_of(vocab: int) -> list[Sample]:
    """Eight prompt+response token sequences of different lengths, rewards 0 and 1 in each
    group of four (so the group-normalised advantages are not all zero)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        prompt, response = 3 + i % 3, 2 + i % 4
        tokens = torch.randint(3, vocab, (prompt + response,), generator=gen).tolist()
        out.append(Sample(prompt=f"p{i // 4}", group_index=i // 4, index=i % 4,
                          prompt_tokens=tokens[:prompt], tokens=tokens,
                          response_length=response, loss_mask=[1] * response,
                          reward=float(i % 2), status=Status.completed))
    return out


def float64_logprobs(model_dir: Path, samples: list[Sample]) -> list[list[float]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens])
            logits = model(input_ids=ids).logits[0] / TEMPERATURE
            start = len(s.tokens) - s.response_length
            logp = torch.log_softmax(logits[start - 1 : -1], dim=-1)
            out.append(logp.gather(1, ids[0, start:, None])[:, 0].tolist())
    return out


def check_policy_logprobs(
    logprobs: Callable[[list[Sample]], list[list[float]]],
    train: Callable[[list[Sample], bool], TrainMetrics],
    model_dir: Path, samples: list[Sample],
) -> list[list[float]]:
    """A trainer's `logprobs` before any step: one per response token, equal to a float64
    forward of the model files; given to `train` as the engines' log-probs, no gap against
    the old-policy log-probs it computes itself; then moved by its two optimizer steps.
    Returns the log-probs from before the steps."""
    before = logprobs(samples)
    assert [len(lp) for lp in before] == [s.response_length for s in samples]
    for got, want in zip(before, float64_logprobs(model_dir, samples), strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    for s, lp in zip(samples, before, strict=True):
        s.rollout_log_probs = lp
    metrics = train(samples, True)
    assert metrics.optimizer_steps == 2
    assert metrics.logprob_gap_max < 1e-6
    after = logprobs(samples)
    moved = max(abs(a - b) for ra, rb in zip(after, before, strict=True)
                for a, b in zip(ra, rb, strict=True))
    assert moved > 1e-4
    return before


# The engine's log-prob of every token exceeds the trainer's by this many nats in
# `with_engine_excess`: each token's ratio against the engine's starts at exp(−1) ≈ 0.37.
ENGINE_EXCESS = 1.0
# In `samples_of` (response lengths 2, 3, 4, 5, 2, 3, 4, 5, rewards 0, 1, 0, 1, ...) the
# reward-0 half, 12 of the 28 response tokens, has a negative advantage; PPO's clip holds a
# negative-advantage token whose ratio is below 1 − clipEps.
NEGATIVE_ADVANTAGE_SHARE = 12 / 28


def with_engine_excess(samples: list[Sample], trainer_logprobs: list[list[float]]
                       ) -> list[Sample]:
    """`samples` with engine log-probs ENGINE_EXCESS above the trainer's own: against them
    every token of the first step is clipped that has a negative advantage, against the
    trainer's none is (the ratio is 1)."""
    for s, lp in zip(samples, trainer_logprobs, strict=True):
        s.rollout_log_probs = [x + ENGINE_EXCESS for x in lp]
    return samples
