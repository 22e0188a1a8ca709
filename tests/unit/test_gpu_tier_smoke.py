"""The GPU tier, where there is no GPU: what of it runs on the CPU runs here, so that a change
that breaks a GPU test or a GPU benchmark fails CI, not the next run on a GPU machine
(hack/gpu-test runs the whole tier there).

- Every module of tests/gpu imports, and every test in it is marked `gpu` (hack/gpu-test
  selects them by that marker). They skip here, with the reason; the fused log-prob tests run
  their small shapes under Triton's CPU interpreter. What the GPU weight-sync test reads from
  the trainer's store is read by the CPU weight-sync tests through the same helper
  (`tests.weightsync.conftest.Cluster.announcement`).
- Every GPU benchmark runs its CPU form (`benchmarks/short_forms.py` says what each covers);
  one without a CPU form fails here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.controlplane import REPO

pytestmark = pytest.mark.unit


def _import(path: Path) -> ModuleType:
    """The module at `path`, under a name of its own (tests/gpu is no package)."""
    spec = importlib.util.spec_from_file_location(f"gpu_tier_smoke_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GPU_TESTS = sorted((REPO / "tests" / "gpu").glob("test_*.py"))
GPU_BENCHMARKS = sorted((REPO / "benchmarks").glob("*gpu*.py"))
SHORT_FORMS = _import(REPO / "benchmarks" / "short_forms.py").SHORT_FORMS


def test_the_gpu_tier_is_found() -> None:
    assert len(GPU_TESTS) >= 7 and len(GPU_BENCHMARKS) >= 4, (GPU_TESTS, GPU_BENCHMARKS)


@pytest.mark.parametrize("path", GPU_TESTS, ids=lambda p: p.name)
def test_each_gpu_test_module_imports_and_is_marked_gpu(path: Path) -> None:
    module = _import(path)
    tests = [name for name in vars(module) if name.startswith("test_")]
    assert tests, f"{path.name} defines no test"
    marks = getattr(module, "pytestmark", [])
    marks = marks if isinstance(marks, list) else [marks]
    assert any(mark.name == "gpu" for mark in marks), (
        f"{path.name}: pytestmark lacks pytest.mark.gpu, so hack/gpu-test (-m gpu) skips it")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_fused_log_prob_tests_run_under_the_triton_interpreter() -> None:
    # The one-token shape of each dtype's test (fp32, and bf16 and fp16 on the cuBLAS path):
    # the module's inputs, float64 reference and checks, in seconds.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/gpu/test_logprobs_fused.py", "-k", "one-token"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:]


def test_every_gpu_benchmark_has_a_short_form() -> None:
    assert {p.name for p in GPU_BENCHMARKS} == set(SHORT_FORMS)


@pytest.mark.parametrize("name", sorted(SHORT_FORMS))
def test_each_gpu_benchmark_runs_its_cpu_form(name: str) -> None:
    form = SHORT_FORMS[name]
    env = {**os.environ, **form.cpu_env, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, f"benchmarks/{name}", *form.cpu], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} {' '.join(form.cpu)}:\n{out[-4000:]}"
    assert any(line.startswith(form.figures) for line in out.splitlines()), out[-4000:]
