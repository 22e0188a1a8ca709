"""Trainer rank 0's side of weight sync, the same for every trainer backend.

A trainer (`rljob.trainer.interface.TrainerActor`) sets `self.sync`; the backend only
supplies its weights in HF names (`named_weights`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rljob.reporting import worker_metrics
from rljob.weightsync.group import rank_device
from rljob.weightsync.publisher import PublisherConfig, WeightPublisher
from rljob.weightsync.results import SyncResult
from rljob.weightsync.wire import NamedTensors
from rljob_api.spec import WeightSyncMode, WeightSyncSpec


class TrainerSync:
    def __init__(self, spec: WeightSyncSpec, *, cuda: bool, config_json: str) -> None:
        self.spec = spec
        self.cuda = cuda  # the trainer's weights are on its GPU
        self.config_json = config_json  # written into disk versions, so they load as models
        self.publisher: WeightPublisher | None = None

    def join(self, store_host: str, store_port: int, disk_dir: str, start_version: int,
             on_gpu: bool) -> None:
        """Join the weight-sync store as rank 0; versions continue after `start_version`.

        NCCL on this rank's GPU when the trainer is on a GPU and `on_gpu` (the engines'
        sidecars stage on GPUs); otherwise gloo, the buckets packed on the CPU from wherever
        the weights are, since an NCCL group cannot reach a sidecar on the CPU."""
        gpu = self.cuda and on_gpu
        # This rank's GPU, read when joining: by then the backend has chosen its device.
        device = str(rank_device("cuda")) if gpu else "cpu"
        config = PublisherConfig.from_spec(
            self.spec, port=store_port, store_host=store_host,
            backend="nccl" if gpu else "gloo", device=device,
            disk_dir=Path(disk_dir) if self.spec.mode == WeightSyncMode.disk else None,
            config_json=self.config_json,
        )
        self.publisher = WeightPublisher(config, start_version=start_version)

    def _joined(self) -> WeightPublisher:
        if self.publisher is None:
            raise RuntimeError("weight sync: set_publisher must be called before publishing")
        return self.publisher

    def wait_for_engines(self, count: int, timeout_s: float) -> list[str]:
        return self._joined().wait_for_engines(count, timeout_s)

    def publish(self, version: int, named: NamedTensors, *, again: bool = False) -> SyncResult:
        """Deliver `named` as `version` to every engine.

        The version a run starts or resumes at is already the publisher's: it is delivered
        again as a resync, since engines start from the initial model, not from it. `again`
        sends the current version to every engine, acknowledged or not (engines that dropped
        their weights while the trainer ran). Raises `NonFiniteWeights` (nothing sent) when a
        weight is NaN/Inf.
        """
        publisher = self._joined()
        if version > publisher.version:
            result = publisher.publish(version, named)
        elif again:
            result = publisher.redeliver(named)
        else:
            result = publisher.resync(named)
        worker_metrics.WEIGHT_VERSION.set(version)
        return result

    def forget_engine(self, name: str) -> None:
        """Engine `name` was lost: deliveries stop targeting it until its replacement's
        sidecar registers."""
        self._joined().forget(name)

    def device_buffers(self) -> list[torch.Tensor]:
        """The publisher's send buffers: a serving-dtype copy of the weights it keeps on the
        trainer's GPU between versions, which leaves with the trainer's other tensors."""
        if self.publisher is None:
            return []
        return [buf for _, buf in self.publisher._send_buffers.values()]

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

