"""The terminal progress bar: step, mean reward, tokens/s and ETA."""

from __future__ import annotations

import sys

from tqdm import tqdm


class ProgressBar:
    def __init__(self, start: int, end: int) -> None:
        self.bar = tqdm(total=end, initial=start, unit="step", file=sys.stderr,
                        dynamic_ncols=True, desc="rljob")

    def update(self, step: int, reward: float, tokens_per_second: float) -> None:
        self.bar.set_postfix(reward=f"{reward:.3f}", tok_s=f"{tokens_per_second:.0f}")
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()
