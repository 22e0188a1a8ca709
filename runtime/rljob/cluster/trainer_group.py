"""The trainer ranks of a job as one object: each call the driver makes on trainers goes
to every rank (collectives) or to rank 0 (weight sync, the non-finite scan) here, once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import ray

from rljob.rollout.sample import Sample
from rljob.trainer.metrics import TrainMetrics
from rljob.weightsync.results import NonFiniteWeights, SyncResult

if TYPE_CHECKING:
    from rljob.trainer.interface import TrainerActor

T = TypeVar("T")


def _cause(call: Callable[[], T], expected: type[Exception]) -> T:
    """`call()`, with a remote `expected` error raised here as itself (Ray wraps it), so
    the driver handles what the role said without knowing how it travelled."""
    try:
        return call()
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, expected):
            raise err.cause from None
        raise


class TrainerGroup:
    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles  # Ray actor handles of `TrainerActor`s, by rank

    @classmethod
    def start(
        cls, actor: type[TrainerActor], options: Callable[[int], dict[str, Any]],
        slots: list[int], spec_json: str, model_dir: str, init_method: str, device: str,
    ) -> TrainerGroup:
        """One rank per slot of the placement group; `options(slot)` places it there."""
        remote: Any = ray.remote(actor)
        world = len(slots)
        return cls([remote.options(**options(slot)).remote(spec_json, model_dir, rank, world,
                                                           init_method, device)
                    for rank, slot in enumerate(slots)])

    @property
    def rank0(self) -> Any:
        return self.handles[0]

    def train(self, samples: list[Sample], check_initial_kl: bool) -> TrainMetrics:
        """One rollout step on every rank; the metrics (the same on every rank)."""
        results: list[TrainMetrics] = ray.get(
            [t.train.remote(samples, check_initial_kl) for t in self.handles])
        return results[0]

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The policy's response log-probs on every rank; rank 0's (every rank has the same
        weights)."""
        results: list[list[list[float]]] = ray.get(
            [t.logprobs.remote(samples) for t in self.handles])
        return results[0]

    def offload(self) -> None:
        """Every rank's parameters, gradients and optimizer state leave its GPU."""
        ray.get([t.offload.remote() for t in self.handles])

    def nonfinite_weights(self) -> list[str]:
        bad: list[str] = ray.get(self.rank0.nonfinite_weights.remote())
        return bad

    def save(self, directory: str, hf_export: bool) -> None:
        ray.get([t.save.remote(directory, hf_export) for t in self.handles])

    def load(self, directory: str) -> None:
        ray.get([t.load.remote(directory) for t in self.handles])

    def set_publisher(self, store: tuple[str, int], disk_dir: str, start_version: int,
                      on_gpu: bool) -> None:
        """Rank 0 joins weight sync; `on_gpu`: the engines' sidecars stage on GPUs too."""
        ray.get(self.rank0.set_publisher.remote(*store, disk_dir, start_version, on_gpu))

    def wait_for_engines(self, count: int, timeout_s: float) -> None:
        """Until `count` engines joined weight sync; TimeoutError (the publisher's) if not
        within `timeout_s`."""
        _cause(lambda: ray.get(self.rank0.wait_for_engines.remote(count, timeout_s)),
               TimeoutError)

    def publish(self, version: int, again: bool) -> SyncResult:
        """Deliver `version` to every engine; NonFiniteWeights (the publisher's scan) when
        the weights hold NaN/Inf and nothing was sent."""
        result: SyncResult = _cause(
            lambda: ray.get(self.rank0.publish.remote(version, again)), NonFiniteWeights)
        return result

    def forget_engine(self, name: str) -> None:
        """Weight sync stops delivering to engine `name` (lost) until it registers again."""
        ray.get(self.rank0.forget_engine.remote(name))

    def shutdown(self, timeout_s: float) -> None:
        """Each rank leaves its process groups; a dead one has nothing to leave."""
        for t in self.handles:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(t.shutdown.remote(), timeout=timeout_s)

    def kill(self) -> None:
        for t in self.handles:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(t)
