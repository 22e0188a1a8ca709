"""How many samples the rollout worker keeps in flight on its engines at once.

A request carries one sample, or a group's samples of one engine slot
(`rljob.rollout.hooks.default_generate_many`); either takes as many places as it has rows.
So sending samples together changes how they travel, not how much an engine is asked to hold
at once, nor how many samples a partial-rollout cut finds still waiting to be sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class InFlight:
    """Places for `capacity` rows; a request waits until it can take all of its rows at
    once (never some of them: requests holding part of what they need could wait on each
    other for good)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def rows(self, count: int) -> AsyncIterator[None]:
        """Hold `count` places while the block runs (a request of more rows than there are
        places waits for all of them)."""
        count = min(count, self.capacity)
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= count)
            self.free -= count
        try:
            yield
        finally:
            async with self._changed:
                self.free += count
                self._changed.notify_all()
