"""`copy_checked` on a CUDA GPU: the Triton kernel over versions the size engines receive,
past 2**31 elements (64-bit offsets), every float dtype a version travels in."""

from __future__ import annotations

import pytest
import torch

from rljob.weightsync.checked_copy import _fused_applies, copy_checked

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_version_is_copied_bit_for_bit_and_its_nonfinite_values_found(
    dtype: torch.dtype,
) -> None:
    n = (256 << 20) + 12345  # 256 Mi elements and a partial last block
    src = (torch.randn(n, device="cuda") * 3).to(dtype)
    dst = torch.empty_like(src)
    assert _fused_applies(src, dst)
    assert copy_checked(src, dst)
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
    specials = [float("nan")] + ([] if dtype == torch.float8_e4m3fn else
                                 [float("inf"), float("-inf")])
    for where in (0, n // 3, n - 1):
        for value in specials:
            saved = src[where].clone()
            src[where] = value
            assert not copy_checked(src, dst), (where, value)
            at = slice(where, where + 1)
            assert torch.equal(src[at].view(torch.uint8), dst[at].view(torch.uint8))
            src[where] = saved
    assert copy_checked(src, dst)


def test_offsets_past_two_to_the_31_elements_are_copied_and_checked() -> None:
    n = (1 << 31) + 4099
    src = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.zeros_like(src)
    assert copy_checked(src, dst)
    assert bool(dst[-5:].eq(1).all()) and bool(dst[: 1 << 20].eq(1).all())
    src[n - 2] = float("nan")
    assert not copy_checked(src, dst)
    assert bool(dst[n - 2].isnan())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_the_kernel_runs_on_the_tensors_gpu_not_the_current_one() -> None:
    """An engine on `cuda:1` in a process whose current device is 0 (Triton launches on the
    current device unless told otherwise)."""
    torch.cuda.set_device(0)
    src = torch.ones(1 << 20, dtype=torch.bfloat16, device="cuda:1")
    dst = torch.zeros_like(src)
    assert copy_checked(src, dst) and bool(dst.eq(1).all())
    src[-1] = float("inf")
    assert not copy_checked(src, dst)
