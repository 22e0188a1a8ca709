"""Every example in examples/ either runs (CPU ones: tests/runtime/test_examples_run.py runs
each one found here) or is refused by `rljob validate` with the reason, and a layout the
runtime cannot run is refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rljob_api.spec import RLJobSpec
from rljob_api.validate import load_job
from tests.controlplane import REPO

pytestmark = pytest.mark.unit

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
RLJOB = [sys.executable, "-m", "rljob.cli"]


def runs_on_cpu(spec: RLJobSpec) -> bool:
    """A job `rljob run` can run on this machine: the torch trainer and the hf engine."""
    return spec.trainer.backend == "torch" and spec.rollout.backend == "hf"


def cpu_examples() -> list[Path]:
    return [p for p in EXAMPLES if runs_on_cpu(load_job(str(p))[1])]


def test_examples_are_found_and_one_runs_on_cpu() -> None:
    assert len(EXAMPLES) >= 4 and cpu_examples(), EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_rljob_validate_accepts_each_example(path: Path) -> None:
    out = subprocess.run([*RLJOB, "validate", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"{path}: valid RLJob" in out.stdout
    assert "deprecated" not in out.stderr, "examples use no deprecated field (rollout.engines)"


def test_a_megatron_model_parallel_layout_is_refused_with_the_field_and_the_fix(
    tmp_path: Path,
) -> None:
    """The qwen-7b example with `tensor: 2` (as it once was) never reaches the driver."""
    doc = yaml.safe_load((REPO / "examples" / "qwen-7b-megatron-sglang.yaml").read_text())
    doc["spec"]["trainer"]["parallelism"] = {"tensor": 2, "pipeline": 1, "context": 1}
    path = tmp_path / "qwen-tp2.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = subprocess.run([*RLJOB, "validate", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "1 problem(s)" in out.stderr and "Traceback" not in out.stderr
    assert "spec.trainer.parallelism: the megatron backend needs tensor, pipeline and " \
        "context 1" in out.stderr
    assert "set them to 1" in out.stderr
