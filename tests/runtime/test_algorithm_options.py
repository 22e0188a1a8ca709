"""GSPO with truncated importance sampling and dynamic sampling through the whole loop on CPU
(real `hf` engine, tiny model, local Ray): the new metrics are in metrics.jsonl with values
that hold together, and a run split by a resume gives the same rows as a straight one (the
data cursor stays exact although dynamic sampling consumes a varying number of prompts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob.cluster.cluster import RunOptions
from rljob.driver.run import run_job
from rljob_api.exits import OK as EXIT_OK
from tests.runtime.conftest import RecordingReporter
from tests.runtime.jobs import job_spec, metric_rows

pytestmark = pytest.mark.runtime



def test_gspo_with_tis_and_dynamic_sampling_resumes_exactly(
        ray_local: None, tmp_path: Path, reporter: RecordingReporter) -> None:
    spec = job_spec(tmp_path, {"algorithm": {
        "estimator": "gspo", "tis": {"enabled": True, "cap": 2.0},
        "dynamicSampling": {"enabled": True, "maxRounds": 2}}})
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_job("job", spec, RunOptions(straight), reporter) == EXIT_OK
    assert run_job("job", spec, RunOptions(split, max_steps=2), RecordingReporter()) == EXIT_OK
    assert run_job("job", spec, RunOptions(split), RecordingReporter()) == EXIT_OK
    rows = metric_rows(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows == metric_rows(split)
    want = spec.algorithm.rollout_batch_size
    for r in rows:
        assert 1 <= r["generation_rounds"] <= 2
        # every generated group is trained on, or dropped, or dropped and then filled in
        assert r["generated_groups"] == want + r["filtered_groups"] - r["filtered_groups_kept"]
        # engine and trainer hold the same weights: the ratio is 1 up to float noise
        assert r["logprob_gap_max"] < 1e-3 and r["logprob_gap"] <= r["logprob_gap_max"]
        assert r["tis_weight"] == pytest.approx(1.0, abs=1e-3) and r["tis_truncated"] == 0.0
    # the untrained tiny model rarely answers: some group had equal rewards and was dropped
    assert sum(r["filtered_groups"] for r in rows) > 0
