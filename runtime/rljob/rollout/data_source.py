"""Prompt order and the rollout buffer, both resumable.

Prompts are served epoch by epoch in a seeded order; groups that could not be finished
(aborted generation) go back into a buffer that is served first. Both the cursor and the
buffer are part of every checkpoint, so a resumed run sees the same prompts in the same
order as an uninterrupted one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from rljob.rollout.tasks import Prompt


@dataclass
class Cursor:
    epoch: int = 0
    index: int = 0


@dataclass
class DataSource:
    prompts: tuple[Prompt, ...]
    seed: int
    shuffle: bool
    cursor: Cursor = field(default_factory=Cursor)
    buffer: list[Prompt] = field(default_factory=list)

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[Prompt]:
        """The next `count` prompts: buffered ones first, then the dataset in epoch order."""
        out = self.buffer[:count]
        self.buffer = self.buffer[count:]
        while len(out) < count:
            order = self._order(self.cursor.epoch)
            out.append(self.prompts[order[self.cursor.index]])
            self.cursor.index += 1
            if self.cursor.index == len(order):
                self.cursor = Cursor(self.cursor.epoch + 1, 0)
        return out

    def give_back(self, prompts: list[Prompt]) -> None:
        """Prompts whose generation did not finish; they are served again next."""
        self.buffer.extend(prompts)

    def state(self) -> dict[str, Any]:
        return {
            "epoch": self.cursor.epoch,
            "index": self.cursor.index,
            "buffer": [[p.prompt, p.label] for p in self.buffer],
        }

    def load(self, state: dict[str, Any]) -> None:
        self.cursor = Cursor(int(state["epoch"]), int(state["index"]))
        self.buffer = [Prompt(p, label) for p, label in state["buffer"]]
