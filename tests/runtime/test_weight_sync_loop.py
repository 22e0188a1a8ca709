"""The RL loop with versioned broadcast weight sync (gloo): store, sidecars, acks, resyncs.

Each test runs the job the way `rljob run` does (Ray started here, sidecars started by
the driver) and inspects the live engines before the driver shuts everything down.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from rljob.cluster.cluster import RunOptions, worker_env
from rljob.driver.attempt import Attempt
from rljob.driver.job import WEIGHT_SYNC_LOG
from rljob.driver.outcome import exit_code
from rljob.driver.run import run_attempt
from rljob.engine.client import EngineClient
from rljob_api.exits import FAILED as EXIT_FAILED
from rljob_api.exits import NONFINITE as EXIT_NONFINITE
from rljob_api.exits import OK as EXIT_OK
from tests.faults import CORRUPT_ENV, NAN_PUBLISHED_ENV, SETUP_HOOK, SIDECAR_DIES_ENV
from tests.runtime.conftest import RecordingReporter
from tests.runtime.jobs import job_spec

pytestmark = pytest.mark.runtime

STEPS = 3


@contextmanager
def local_ray(env: dict[str, str], num_gpus: int | None = None) -> Iterator[None]:
    """Ray on this machine (`num_gpus`: how many GPUs it may hand out; None: all it finds).
    Every worker (the sidecars among them) installs the faults `env` asks for."""
    ray.init(num_cpus=2, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {**worker_env(), **env},
                          "worker_process_setup_hook": SETUP_HOOK})
    try:
        yield
    finally:
        ray.shutdown()


def engine_weights(url: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every parameter read back over the engine's `/get_weights_by_name`."""
    engine = EngineClient(url)
    out = {}
    for name, ref in like.items():
        status, body = engine._request(
            "POST", "/get_weights_by_name", {"name": name, "truncate_size": ref.shape[0]}, 30)
        assert status == 200, body
        out[name] = torch.tensor(body, dtype=ref.dtype)
    return out


def run_and_check_engines(tmp_path: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """Run STEPS rollout steps; every engine must end bit-equal to the trainer at STEPS."""
    spec = job_spec(tmp_path, {"algorithm": {"totalSteps": STEPS},
                               "checkpoint": {"interval": STEPS}})
    workdir = tmp_path / "w"
    with local_ray(env):
        attempt = Attempt.begin("job", spec, RunOptions(workdir), RecordingReporter())
        try:
            assert run_attempt(attempt) == EXIT_OK
            job = attempt.job
            assert job is not None
            trainer = dict(ray.get(job.roles.trainers.rank0.named_weights.remote()))
            for url in job.roles.engines.urls:
                got = engine_weights(url, trainer)
                differing = [n for n, t in trainer.items() if not torch.equal(got[n], t)]
                assert not differing, f"engine {url} differs from the trainer in {differing}"
                assert EngineClient(url).weight_version() == str(STEPS)
            assert attempt.cluster.weight_sync is not None
            health = attempt.cluster.weight_sync.health()
            assert [h["last_acked_version"] for h in health] == [STEPS]
        finally:
            attempt.shutdown(EXIT_OK)
    state = json.loads((workdir / "checkpoints" / f"step_{STEPS:08d}" / "state.json")
                       .read_text())
    assert state["weight_version"] == STEPS  # what a resume continues from
    log = [json.loads(line) for line in (workdir / WEIGHT_SYNC_LOG).read_text().splitlines()]
    # the initial sync (version 0, engines start from the model directory), then one a step
    assert [r["version"] for r in log] == list(range(STEPS + 1))
    assert all(r["acked"] == ["engine-0"] and r["stale"] == {} for r in log)
    return log


def test_engines_end_bit_equal_to_the_trainer(tmp_path: Path) -> None:
    log = run_and_check_engines(tmp_path, {})
    assert all(r["attempts"] == 1 and r["rejections"] == [] for r in log)


def test_a_nan_in_the_broadcast_is_rejected_and_the_engine_resynced(tmp_path: Path) -> None:
    log = run_and_check_engines(tmp_path, {CORRUPT_ENV: "engine-0:2"})
    by_version = {r["version"]: r for r in log}
    (rejection,) = by_version[2]["rejections"]
    assert rejection.startswith("engine-0: ") and "non-finite" in rejection, rejection
    assert "digest mismatch" in rejection
    assert "still serving version 1" in rejection  # the engine kept v−1 ...
    assert by_version[2]["attempts"] == 2  # ... until the trainer resynced it
    assert all(r["attempts"] == 1 for v, r in by_version.items() if v != 2)


def _run_with_fault(tmp_path: Path, fault: dict[str, str], reporter: RecordingReporter
                    ) -> tuple[int, list[dict[str, Any]]]:
    """Run STEPS steps with `fault` (tests.faults) in every Ray worker; the exit code (as
    `rljob run` would exit) and the weight-sync log. A run that ends well must leave the
    engine bit-equal to the trainer at version STEPS."""
    spec = job_spec(tmp_path, {"algorithm": {"totalSteps": STEPS},
                               "checkpoint": {"interval": STEPS},
                               "weightSync": {"ackTimeoutSeconds": 20}})
    workdir = tmp_path / "w"
    with local_ray(fault):
        attempt = Attempt.begin("job", spec, RunOptions(workdir), reporter)
        code = EXIT_FAILED
        try:
            code = exit_code(attempt, lambda: run_attempt(attempt))
            if code == EXIT_OK:
                job = attempt.job
                assert job is not None
                trainer = dict(ray.get(job.roles.trainers.rank0.named_weights.remote()))
                (url,) = job.roles.engines.urls
                got = engine_weights(url, trainer)
                assert all(torch.equal(got[n], t) for n, t in trainer.items())
                assert attempt.cluster.weight_sync is not None
                (health,) = attempt.cluster.weight_sync.health()
                assert health["last_acked_version"] == STEPS
        finally:
            attempt.shutdown(code)
    log = [json.loads(line) for line in (workdir / WEIGHT_SYNC_LOG).read_text().splitlines()]
    return code, log


def test_a_sidecar_that_dies_is_started_again_and_sent_the_version_it_missed(
        tmp_path: Path) -> None:
    marker = tmp_path / "sidecar-died"
    code, log = _run_with_fault(tmp_path, {SIDECAR_DIES_ENV: f"engine-0:2:{marker}"},
                                RecordingReporter())
    assert marker.exists()  # a sidecar process really exited when version 2 came
    assert code == EXIT_OK  # ... and the run went on: Ray started it again
    # Version 2 reached the engine only after a failed try (the first sidecar died with it),
    # and every version ends acknowledged, in order.
    v2 = [r for r in log if r["version"] == 2]
    assert v2[0]["attempts"] > 1 or v2[0]["stale"], v2
    assert v2[-1]["acked"] == ["engine-0"] and v2[-1]["stale"] == {}, v2
    assert sorted({r["version"] for r in log}) == list(range(STEPS + 1))


def test_a_sidecar_that_keeps_dying_ends_the_attempt_as_sidecar_lost(tmp_path: Path) -> None:
    reporter = RecordingReporter()
    code, log = _run_with_fault(tmp_path, {SIDECAR_DIES_ENV: "engine-0:2:"}, reporter)
    assert code == EXIT_FAILED  # retryable: the operator restarts the job, counted
    (failure,) = reporter.failures
    assert failure.reason == "WeightSyncSidecarLost", failure
    assert "engine-0" in failure.message and "version 2" in failure.message, failure
    assert [r["version"] for r in log if not r["stale"]] == [0, 1]


def test_weights_that_fail_the_publishers_scan_stop_the_run_with_nothing_sent(
        tmp_path: Path) -> None:
    reporter = RecordingReporter()
    code, log = _run_with_fault(tmp_path, {NAN_PUBLISHED_ENV: "2"}, reporter)
    assert code == EXIT_NONFINITE
    (failure,) = reporter.failures
    assert failure.reason == "NonFiniteWeights" and not failure.retryable, failure
    assert "nothing was sent to the engines" in failure.message, failure
    assert [r["version"] for r in log] == [0, 1]  # version 2 never left the trainer
