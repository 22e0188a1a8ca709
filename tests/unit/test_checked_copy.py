"""`copy_checked`: the copy that learns in the same pass whether its source held NaN or Inf.

The Triton kernel runs here under Triton's CPU interpreter (`TRITON_INTERPRET=1`, in a
process of its own: Triton reads the variable when a kernel is first built); on a GPU it is
tests/gpu/test_checked_copy_gpu.py. The CPU path (copy, then the screen) runs in process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rljob.weightsync.checked_copy import copy_checked

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"

# Per dtype, one length spanning several programs with a partial last one (the kernel's
# block is 8192), a non-finite value at the first, a middle and the last element (which a
# kernel masking its tail wrongly would miss), and a finite run: verdicts and bytes.
_INTERPRETED = r"""
import torch
from rljob.weightsync.checked_copy import _fused_applies, copy_checked

n = 8192 * 2 + 77
for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e5m2,
              torch.float8_e4m3fn):
    src = (torch.randn(n) * 4).to(dtype)
    dst = torch.full_like(src, 0)
    assert _fused_applies(src, dst), dtype
    assert copy_checked(src, dst), dtype
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8)), dtype
    specials = [float("nan")] + ([] if dtype == torch.float8_e4m3fn else
                                 [float("inf"), float("-inf")])
    for where in (0, n // 2, n - 1):
        for value in specials:
            bad = src.clone()
            bad[where] = value
            assert not copy_checked(bad, dst), (dtype, where, value)
            assert torch.equal(bad.view(torch.uint8), dst.view(torch.uint8)), dtype
    big = src.clone()
    big[n - 1] = torch.finfo(dtype).max
    assert copy_checked(big, dst), dtype
print("kernel ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_triton_kernel_finds_every_nonfinite_value_and_copies_every_bit() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(RUNTIME)}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "kernel ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e5m2])
def test_on_the_cpu_it_copies_then_screens(dtype: torch.dtype) -> None:
    src = torch.randn(5000).to(dtype)
    dst = torch.zeros_like(src)
    assert copy_checked(src, dst)
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
    src[4999] = float("nan")
    assert not copy_checked(src, dst)
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))


def test_integers_are_copied_and_never_flagged() -> None:
    src = torch.arange(100, dtype=torch.int32)
    dst = torch.zeros_like(src)
    assert copy_checked(src, dst) and torch.equal(src, dst)


def test_mismatched_buffers_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"copy_checked: torch.bfloat16\(4,\) into "
                       r"torch.float32\(4,\)"):
        copy_checked(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))
