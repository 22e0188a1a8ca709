"""User hooks the runtime tests name by import path (they run in the rollout worker)."""

from __future__ import annotations

from rljob.hooks import HookArgs
from rljob.sample import Sample


async def nan_reward(args: HookArgs, sample: Sample) -> float:
    """A broken reward model: every reward is NaN."""
    return float("nan")


async def length_reward(args: HookArgs, sample: Sample) -> float:
    """Rewards short answers: a custom hook that any policy can learn quickly."""
    return 1.0 if sample.response_length <= 2 else 0.0
