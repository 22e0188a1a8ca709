"""User hooks the runtime tests name by import path (they run in the rollout worker)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from rljob.hooks import HookArgs, default_reward
from rljob.sample import Sample


async def nan_reward(args: HookArgs, sample: Sample) -> float:
    """A broken reward model: every reward is NaN."""
    return float("nan")


async def length_reward(args: HookArgs, sample: Sample) -> float:
    """Rewards short answers: a custom hook that any policy can learn quickly."""
    return 1.0 if sample.response_length <= 2 else 0.0


GATE_ENV = "RLJOB_TEST_REWARD_GATE"  # a file path: rewards wait while it exists


async def gated_reward(args: HookArgs, sample: Sample) -> float:
    """The task's reward, held back while the file named by RLJOB_TEST_REWARD_GATE exists:
    the test decides when a step may finish. A `BLOCKED` file beside it says one waits."""
    gate = Path(os.environ[GATE_ENV])
    while gate.exists():
        (gate.parent / f"{gate.name}.BLOCKED").touch()
        await asyncio.sleep(0.1)
    return await default_reward(args, sample)
