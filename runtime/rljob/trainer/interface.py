"""What the driver calls on a trainer rank, whatever the backend.

Both backends (`rljob.trainer.torch.actor.TorchTrainer`,
`rljob.trainer.megatron.actor.MegatronTrainerActor`) implement `TrainerActor`, so the driver
places and drives either one the same way through `rljob.cluster.trainer_group.TrainerGroup`.
Weight sync runs on rank 0 alone: the backend only supplies its weights in HF names
(`named_weights`); publishing them is the same for every backend (`TrainerSync`).
"""

from __future__ import annotations

from abc import abstractmethod

from rljob.model.offload import TakesTurns
from rljob.reporting.locatable import Locatable
from rljob.rollout.sample import Sample
from rljob.trainer.metrics import TrainMetrics
from rljob.trainer.publishing import TrainerSync
from rljob.weightsync.results import SyncResult
from rljob.weightsync.wire import NamedTensors


class TrainerActor(Locatable, TakesTurns):
    """One trainer rank, a Ray actor. Every rank of a job is constructed with the same
    arguments but its `rank`; calls other than the weight-sync ones go to every rank (they
    are collectives)."""

    sync: TrainerSync

    @abstractmethod
    def __init__(self, spec_json: str, model_dir: str, rank: int, world: int,
                 init_method: str, device: str) -> None:
        """`init_method` is rank 0's rendezvous address (empty for a single rank)."""

    @abstractmethod
    def train(self, samples: list[Sample], check_initial_kl: bool) -> TrainMetrics:
        """Train on one rollout step's samples; return its metrics (same on every rank,
        `rljob.trainer.batch.rollout_summary`)."""

    @abstractmethod
    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The current policy's log-prob of each response token of each sample (at the
        rollout temperature): what `train` takes as the old policy's before its first
        optimizer step, so a backend can be checked against the engines' log-probs or
        against another backend. A collective, like `train`."""

    @abstractmethod
    def named_weights(self) -> NamedTensors:
        """The weights the engines serve: HF names, serving dtype."""

    @abstractmethod
    def nonfinite_weights(self) -> list[str]:
        """Names of the weights holding NaN/Inf (none may reach the engines)."""

    @abstractmethod
    def save(self, directory: str, hf_export: bool) -> None:
        """Write this rank's part of a checkpoint into `directory` (the driver commits it
        once every rank returned); `hf_export` adds an HF-format copy under `hf/`."""

    @abstractmethod
    def load(self, directory: str) -> None:
        """Restore what `save` wrote."""

    @abstractmethod
    def shutdown(self) -> None:
        """Leave the weight-sync and trainer process groups."""

    def set_publisher(
        self, store_host: str, store_port: int, disk_dir: str, start_version: int,
        on_gpu: bool,
    ) -> None:
        """Join weight sync as its rank 0; `on_gpu` False when the engines' sidecars stage on
        the CPU (engines on CPU, `placement.Devices.sync_on_gpu`)."""
        self.sync.join(store_host, store_port, disk_dir, start_version, on_gpu)

    def wait_for_engines(self, count: int, timeout_s: float) -> list[str]:
        return self.sync.wait_for_engines(count, timeout_s)

    def publish(self, version: int, again: bool = False) -> SyncResult:
        return self.sync.publish(version, self.named_weights(), again=again)

    def forget_engine(self, name: str) -> None:
        self.sync.forget_engine(name)
