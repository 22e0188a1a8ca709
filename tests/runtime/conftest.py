"""Ray for the runtime tests that run jobs in this process: one per module with 2 CPU slots,
always shut down. A job frees what it held when it ends (`Cluster.shutdown` kills its actors
and removes its placement group), and a test that makes actors of its own kills them, so the
next test of the module gets every slot back without paying Ray's start again (seconds of
CPU on 2 cores, in every such test)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from rljob.cluster.cluster import worker_env
from rljob_api.status import (
    CheckpointStatus,
    EnginesStatus,
    Progress,
    ResumeReport,
    RuntimeFailure,
    RuntimeStop,
)


@contextlib.contextmanager
def _local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": worker_env()})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """One Ray for a module whose tests each run a job or make actors of their own."""
    with _local_ray():
        yield


class RecordingReporter:
    """A reporter that keeps what the loop reported, for assertions."""

    def __init__(self) -> None:
        self.progresses: list[Progress] = []
        self.checkpoints: list[CheckpointStatus] = []
        self.failures: list[RuntimeFailure] = []
        self.resumes: list[ResumeReport] = []
        self.stops: list[RuntimeStop] = []
        self.engine_reports: list[EnginesStatus] = []

    def progress(self, progress: Progress) -> None:
        self.progresses.append(progress)

    def checkpoint(self, checkpoint: CheckpointStatus) -> None:
        self.checkpoints.append(checkpoint)

    def resumed(self, resumed: ResumeReport) -> None:
        self.resumes.append(resumed)

    def failure(self, failure: RuntimeFailure) -> None:
        self.failures.append(failure)

    def stopped(self, stop: RuntimeStop) -> None:
        self.stops.append(stop)

    def engines(self, engines: EnginesStatus) -> None:
        self.engine_reports.append(engines)

    def close(self, timeout_s: float) -> bool:
        return True


@pytest.fixture
def reporter() -> Any:
    return RecordingReporter()
