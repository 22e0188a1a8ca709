"""The rollout engines of a job as one object: every call the driver or weight sync makes on
engines goes through here, to each engine, once."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import ray

from rljob.engine.launcher import Locality


class EngineGroup:
    def __init__(self, handles: list[Any], slot_holders: list[Any]) -> None:
        self.handles = handles  # Ray actor handles of `EngineProcess`es, by engine index
        # Further slots of multi-GPU engines, held so that no other actor takes their GPUs.
        self.slot_holders = slot_holders

    @functools.cached_property
    def urls(self) -> list[str]:
        """Each engine's HTTP address, once it serves (asked for when first needed, so the
        trainers start while the engines load)."""
        urls: list[str] = ray.get([e.address.remote() for e in self.handles])
        return urls

    def __len__(self) -> int:
        return len(self.handles)

    def localities(self) -> list[Locality]:
        """Each engine's Ray node and visible devices, as it reports them itself."""
        where: list[Locality] = ray.get([e.locality.remote() for e in self.handles])
        return where

    def release(self) -> None:
        """The engines' weights and caches leave the GPUs."""
        ray.get([e.release_memory.remote() for e in self.handles])

    def resume(self) -> bool:
        """The engines' memory comes back; False when one dropped its weights (SGLang)."""
        return all(ray.get([e.resume_memory.remote() for e in self.handles]))

    def stop(self, timeout_s: float) -> None:
        """Each engine stops its server; a dead one has nothing to stop."""
        for engine in self.handles:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(engine.stop.remote(), timeout=timeout_s)

    def kill(self) -> None:
        for handle in [*self.handles, *self.slot_holders]:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(handle)
