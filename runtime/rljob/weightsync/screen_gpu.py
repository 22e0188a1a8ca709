# Triton kernels take untyped pointer and constexpr arguments.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The GPU non-finite screen: one Triton kernel that reads a span of floats as 32-bit words.

A NaN or Inf is a value whose exponent bits are all set, so the screen is bitwise: it reads
each byte once, does no float arithmetic (nothing can overflow) and writes one word only
where it finds something, so it runs at close to the copy speed of the memory. Imported
only when a CUDA tensor is screened (`protocol._screen`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Words per program: large enough that launching and reducing cost little against reading.
_BLOCK = 8192


@triton.jit
def _exponent_all_set(words, n_words, flag, LO: tl.constexpr, HI: tl.constexpr,
                      BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    w = tl.load(words + offs, mask=offs < n_words, other=0)
    bad = (w & LO) == LO
    if HI != 0:
        bad = bad | ((w & HI) == HI)
    hit = tl.max(bad.to(tl.int32), axis=0)
    # Written only by a program that found something: no contention on the flag.
    tl.atomic_max(flag, hit, mask=hit > 0)


def all_finite_words(words: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """A one-element bool tensor, True when no word of `words` (int32) has the exponent
    mask `lo` (or `hi`, for the upper half of a word of 16-bit values) fully set."""
    flag = torch.zeros(1, dtype=torch.int32, device=words.device)
    n = words.numel()
    if n:
        _exponent_all_set[(triton.cdiv(n, _BLOCK),)](words, n, flag, LO=lo, HI=hi,
                                                     BLOCK=_BLOCK, num_warps=8)
    return flag == 0
