"""The full loop on CPU with local Ray: resume exactness, learning, non-finite stops."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import ray
from safetensors.torch import load_file

from rljob.cluster.cluster import RunOptions
from rljob.driver.run import run_job
from rljob.reporting import metrics_log
from rljob_api.exits import NONFINITE as EXIT_NONFINITE
from rljob_api.exits import OK as EXIT_OK
from tests.runtime.conftest import RecordingReporter
from tests.runtime.jobs import job_spec, metric_rows

pytestmark = pytest.mark.runtime



def _final_weights(workdir: Path) -> dict[str, Any]:
    latest = sorted((workdir / "checkpoints").glob("step_*"))[-1]
    return load_file(str(latest / "model.safetensors"))


def test_resume_is_exact(ray_local: None, tmp_path: Path, reporter: RecordingReporter) -> None:
    spec = job_spec(tmp_path)
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_job("job", spec, RunOptions(straight), reporter) == EXIT_OK
    assert run_job("job", spec, RunOptions(split, max_steps=2), RecordingReporter()) == EXIT_OK
    assert len(metric_rows(split)) == 2
    resumed = RecordingReporter()
    assert run_job("job", spec, RunOptions(split), resumed) == EXIT_OK

    a, b = metric_rows(straight), metric_rows(split)
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    assert a == b  # every figure of every step, bit for bit
    wa, wb = _final_weights(straight), _final_weights(split)
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)

    # step 0: the reference is the initial policy, so KL is exactly zero
    assert a[0]["kl"] == 0.0
    assert any(r["kl"] > 0.0 for r in a[1:])  # once a reward was seen, the policy moved
    # engines generate with the weights the trainer has: only float noise between them
    assert all(r["logprob_gap"] < 1e-4 for r in a)
    # weight versions persist across the resume and are reported
    assert [r["weight_version"] for r in b] == [1, 2, 3, 4]
    # The resumed attempt shows the step it resumed from (and its figures) before it trains.
    first = resumed.progresses[0]
    assert (first.rollout_step, first.weight_version, first.mean_reward) == (
        2, 2, a[1]["reward"])
    assert resumed.progresses[1].rollout_step == 3 and resumed.progresses[-1].weight_version == 4
    # Each run reports what it loaded: nothing, then the verified checkpoint of step 2.
    (fresh,) = reporter.resumes
    assert (fresh.found, fresh.step, fresh.path, fresh.attempt) == (False, 0, None, 0)
    (loaded,) = resumed.resumes
    step_2 = split / "checkpoints" / "step_00000002"
    assert (loaded.found, loaded.step, loaded.path) == (True, 2, str(step_2))
    assert loaded.checksum == hashlib.sha256((step_2 / "MANIFEST.json").read_bytes()).hexdigest()
    assert [c.step for c in reporter.checkpoints] == [2, 4]
    assert reporter.checkpoints[-1].verified and reporter.checkpoints[-1].checksum
    assert (straight / metrics_log.PLOT_FILE).stat().st_size > 0
    state = json.loads((straight / "checkpoints" / "step_00000004" / "state.json").read_text())
    assert state["step"] == 4 and state["train_step"] == 8 and state["weight_version"] == 4
    # On one machine the driver (here: this process) served the weight-sync store itself:
    # Ray's table of this module's actors holds the runs' sidecars and no store actor.
    made = Counter(a["ActorClassName"] for a in ray._private.state.actors().values())
    assert made["SidecarActor"] >= 1 and made["StoreHost"] == 0, made


def test_it_learns(ray_local: None, tmp_path: Path, reporter: RecordingReporter) -> None:
    """Mean reward of the last steps clearly beats the untrained policy's."""
    spec = job_spec(tmp_path, {
        "algorithm": {"rolloutBatchSize": 16, "nSamplesPerPrompt": 8, "globalBatchSize": 64,
                      "stepsPerRollout": 2, "microBatchSize": 64, "totalSteps": 40},
        "checkpoint": {"interval": 40},
    })
    assert run_job("job", spec, RunOptions(tmp_path / "w"), reporter) == EXIT_OK
    rewards = [r["reward"] for r in metric_rows(tmp_path / "w")]
    baseline = sum(rewards[:3]) / 3
    final = sum(rewards[-8:]) / 8
    assert final > baseline + 0.08, (baseline, final, rewards)


def test_nonfinite_rewards_stop_the_run_with_evidence(
    ray_local: None, tmp_path: Path, reporter: RecordingReporter
) -> None:
    spec = job_spec(tmp_path, {
        "reward": {"function": "tests.runtime.hooks_for_tests:nan_reward"},
        "algorithm": {"maxConsecutiveNonfinite": 3},
    })
    workdir = tmp_path / "w"
    assert run_job("job", spec, RunOptions(workdir), reporter) == EXIT_NONFINITE
    # 2 optimizer steps per rollout step: skipped 2, then 2 more → stop at the third
    rows = metric_rows(workdir)
    assert len(rows) == 1 and rows[0]["skipped_steps"] == 2 and rows[0]["weight_version"] == 0
    assert reporter.progresses[-1].skipped_steps == 2
    (failure,) = reporter.failures
    assert failure.reason == "NonFiniteLoss" and not failure.retryable
    evidence = workdir / "nonfinite" / "step_00000002"
    assert (evidence / "batch.json").exists() and (evidence / "model.safetensors").exists()
    assert "nonfinite" in failure.message
