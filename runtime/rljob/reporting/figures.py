"""`Figures`: a record that also reads as the figures it reports, by their metrics.jsonl names.

The loop reads a record's typed fields; metrics.jsonl and the trackers get `row()`. Reading a
figure by its name (`metrics["logprob_gap"]`) gives what metrics.jsonl says for it, so a
check of a figure and the file cannot disagree.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Mapping


class Figures(Mapping[str, float]):
    @abstractmethod
    def row(self) -> dict[str, float]:
        """The figures metrics.jsonl reports, by name."""

    def __getitem__(self, key: str) -> float:
        return self.row()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.row())

    def __len__(self) -> int:
        return len(self.row())
