"""What a weight-sync delivery gives its caller, in a module without torch: the driver reads
these results (and catches `NonFiniteWeights`) without loading what the publisher needs."""

from __future__ import annotations

from dataclasses import dataclass


class NonFiniteWeights(ValueError):
    """The trainer's own weights hold NaN/Inf: nothing is sent, the caller must stop."""


@dataclass(frozen=True)
class SyncResult:
    version: int
    acked: list[str]
    stale: dict[str, str]
    attempts: int
    seconds: float
    bytes_per_engine: int
    # Every failed delivery of this call, repaired later or not: "engine: reason".
    rejections: tuple[str, ...] = ()
