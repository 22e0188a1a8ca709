"""The rollout engines of a job as one object: every call the driver or weight sync makes on
engines goes through here, to each engine, once; and an engine that was lost is started
again here, in its own slots, with the arguments it first had."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import ray

from rljob.engine.launcher import Locality

# The handle of a new `EngineProcess` actor for engine i, and the holders of its further
# slots (multi-GPU engines), started in that engine's bundles of the placement group.
EngineStarter = Callable[[int], tuple[Any, list[Any]]]
PING_TIMEOUT_S = 10.0


class EngineGroup:
    def __init__(self, starter: EngineStarter) -> None:
        self.starter = starter
        self.handles: list[Any] = []  # Ray actor handles of `EngineProcess`es, by index
        # Further slots of multi-GPU engines, held so that no other actor takes their GPUs.
        self.slot_holders: list[list[Any]] = []
        self._urls: list[str] | None = None
        self._starting: dict[int, ray.ObjectRef[Any]] = {}  # a replacement's address
        self._nodes: dict[int, str] = {}  # the Ray node each engine was last located on

    def start(self, count: int) -> None:
        """Engines 0..count-1; each is appended as it starts, so a failure part-way stops
        exactly those started."""
        for i in range(count):
            handle, holders = self.starter(i)
            self.handles.append(handle)
            self.slot_holders.append(holders)

    def addresses(self) -> list[ray.ObjectRef[str]]:
        """Each engine's HTTP address to come, once it serves (not waited for here)."""
        return [e.address.remote() for e in self.handles]

    @property
    def urls(self) -> list[str]:
        """Each engine's HTTP address, once it serves (asked for when first needed, so the
        trainers start while the engines load)."""
        if self._urls is None:
            self._urls = list(ray.get([e.address.remote() for e in self.handles]))
        return self._urls

    def __len__(self) -> int:
        return len(self.handles)

    def localities(self) -> list[Locality]:
        """Each engine's Ray node and visible devices, as it reports them itself."""
        where: list[Locality] = ray.get([e.locality.remote() for e in self.handles])
        self._nodes.update((i, w.node_id) for i, w in enumerate(where))
        return where

    def replace(self, index: int) -> None:
        """Kill engine `index` (whatever is left of it) and start it again in its slots;
        `started` says when it serves. Ray places the slots again first when their node
        is gone (a placement group's bundles are rescheduled when a node dies)."""
        for handle in [self.handles[index], *self.slot_holders[index]]:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(handle)
        handle, holders = self.starter(index)
        self.handles[index], self.slot_holders[index] = handle, holders
        self._starting[index] = handle.address.remote()

    def replacing(self, index: int) -> bool:
        """Whether a replacement of engine `index` was started and has not served yet."""
        return index in self._starting

    def started(self, index: int) -> str | None:
        """The address of engine `index`'s replacement once it serves, else None (also
        when none was started); raises the RayError of one that failed to start."""
        ref = self._starting.get(index)
        if ref is None:
            return None
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return None
        del self._starting[index]
        url = str(ray.get(ref))
        self.urls[index] = url
        return url

    def locality(self, index: int) -> Locality:
        where: Locality = ray.get(self.handles[index].locality.remote(), timeout=PING_TIMEOUT_S)
        self._nodes[index] = where.node_id
        return where

    def node(self, index: int) -> str:
        """The Ray node engine `index` was last located on ("" before it was): a replacement
        that never served is not located, so this stays the node its predecessor ran on."""
        return self._nodes.get(index, "")

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
        for handle in [*self.handles, *(h for hs in self.slot_holders for h in hs)]:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(handle)
