# Triton kernels take untyped pointer and block arguments (their annotations drive Triton).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Copy a flat buffer and learn in the same pass whether it held NaN or Inf.

An engine that checks a version before copying it in reads its bytes twice and writes them
once: at best 0.6 of the device's copy rate. On a CUDA device one Triton pass here reads each
element once, writes it to the destination and tests its exponent bits on the way, so the
check costs no extra read of the version. Elsewhere (the CPU, a source on another device, a
dtype without a bit test) it is the copy, then `nonfinite.nonfinite_names` on what arrived.

Triton is imported only on the CUDA path (or under `TRITON_INTERPRET=1`, its CPU
interpreter, which tests use to run the kernel without a GPU).
"""

from __future__ import annotations

import contextlib
import os
from functools import cache
from typing import Any

import torch

from rljob.weightsync.nonfinite import BYTE_NONFINITE, nonfinite_names

# Per dtype: the integer dtype of the same width, and (mask, value) such that an element is
# NaN or Inf exactly when `bits & mask == value` (every exponent bit set; for the one-byte
# formats the table `nonfinite` already keeps).
_BITS: dict[torch.dtype, tuple[torch.dtype, int, int]] = {
    torch.bfloat16: (torch.int16, 0x7F80, 0x7F80),
    torch.float16: (torch.int16, 0x7C00, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000, 0x7F800000),
    **{dtype: (torch.uint8, mask, value) for dtype, (mask, value) in BYTE_NONFINITE.items()},
}
# Elements per program: 16 KiB of bf16, enough in flight per SM to reach the copy rate.
_BLOCK = 8192


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_flag(src, dst, flag, n, MASK: tl.constexpr, VALUE: tl.constexpr,
                  BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        bits = tl.load(src + offs, mask=inside, other=0)
        tl.store(dst + offs, bits, mask=inside)
        bad = tl.max((inside & ((bits & MASK) == VALUE)).to(tl.int32), axis=0)
        # Only a program that saw one writes; every writer writes 1, so no atomic is needed.
        tl.store(flag, bad, mask=bad > 0)

    return copy_flag


def _fused_applies(src: torch.Tensor, dst: torch.Tensor) -> bool:
    same_place = src.device == dst.device and (src.is_cuda or _interpreted())
    return (same_place and src.dtype == dst.dtype and src.dtype in _BITS
            and src.dim() == 1 and dst.dim() == 1 and src.numel() == dst.numel()
            and src.is_contiguous() and dst.is_contiguous())


class CheckedCopy:
    """A copy under way: `finite()` waits for it and says whether every value was finite."""

    def __init__(self, flag: torch.Tensor | None = None, finite: bool | None = None) -> None:
        self._flag = flag
        self._finite = finite

    def finite(self) -> bool:
        """The verdict; the copy has finished when this returns (one host synchronisation)."""
        if self._finite is None:
            assert self._flag is not None
            self._finite = not bool(self._flag.item())
        return self._finite


def start_copy_checked(src: torch.Tensor, dst: torch.Tensor) -> CheckedCopy:
    """Start copying the flat `src` into the flat `dst` (same length and dtype) and checking
    it for NaN/Inf. On a CUDA device this only launches the pass, so the caller's host work
    runs beside it until it asks `finite()`; elsewhere the copy and the screen are done here.

    A non-finite verdict covers every byte of `src`, alignment padding between tensors
    included: the caller names the tensors at fault (or finds none) with
    `nonfinite.nonfinite_names`.
    """
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"copy_checked: {src.dtype}{tuple(src.shape)} into "
                         f"{dst.dtype}{tuple(dst.shape)}")
    if not src.is_floating_point():
        dst.copy_(src)
        return CheckedCopy(finite=True)
    if not _fused_applies(src, dst):
        dst.copy_(src)
        return CheckedCopy(finite=not nonfinite_names([("", dst)]))
    ints, mask, value = _BITS[src.dtype]
    flag = torch.zeros(1, dtype=torch.int32, device=src.device)
    n = src.numel()
    if n:
        grid = ((n + _BLOCK - 1) // _BLOCK,)
        # Triton launches on the current device's current stream: make it the tensors'.
        with torch.cuda.device(src.device) if src.is_cuda else contextlib.nullcontext():
            _kernel()[grid](src.view(ints), dst.view(ints), flag, n, MASK=mask, VALUE=value,
                            BLOCK=_BLOCK, num_warps=8)
    return CheckedCopy(flag=flag)


def copy_checked(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """`start_copy_checked(src, dst).finite()`: the copy, then its verdict."""
    return start_copy_checked(src, dst).finite()
