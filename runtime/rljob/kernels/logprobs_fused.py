# Triton kernels take untyped pointer and block arguments (their annotations drive Triton).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Token log-probs and entropy from hidden states on CUDA: the logits matmul fused with its
epilogue on Hopper (`rljob.kernels.logprobs_tma`), cuBLAS matmuls and Triton passes elsewhere.

The tiled torch function (`rljob.kernels.logprobs_vocab_parallel`) is exact and lean but slow: after
each logits matmul it makes about ten elementwise passes over an fp32 `[tokens x chunk]` tile
(shift, exp, gather, scale, cast...) and scatters the target's gradient with `index_put_`.
Here each vocabulary chunk costs one cuBLAS matmul with fp32 output (bf16 operands, fp32
accumulation, no 16-bit rounding of the logits) and one Triton pass over its logits:

* forward: `_chunk_stats_kernel` reduces the chunk to per-token softmax statistics (max, sum
  of exponentials, their logit-weighted sum for the entropy, the target's logit, read with one
  load per row) per piece of columns, and the pieces merge once at the end
  (`rljob.kernels.logprobs_stats` holds the algebra), so the forward peak is one fp32 chunk;
* backward: each chunk's logits are recomputed a piece at a time (`_GRAD_Z_PARTS` pieces) and
  `_chunk_grad_kernel` turns them into the logit gradient
  `g_lp * (onehot - p) - g_ent * p * (z - E_p[z])` (over the temperature), written once in the
  inputs' 16-bit dtype; two cuBLAS matmuls then give the hidden-state gradient (accumulated
  over chunks in fp32) and the chunk's weight-gradient rows (one matmul over all tokens, fp32
  accumulation, rounded once; the first chunk's overwrites the accumulator, so it needs no
  zero fill). Holding only a piece of fp32 logits makes the chunk wider for the same bytes
  (3,840 columns instead of 1,920 at 11,600 tokens), and the fp32-accumulating
  hidden-gradient matmul pays its accumulator's read and write 40 times instead of 79 (on an
  H200: 22.3 ms instead of 25.1 ms over the vocabulary, against 20.8 ms for the weight
  gradient's plain matmul).

On Hopper and later GPUs with 16-bit operands TMA can address, the logits matmul and its
epilogue are one kernel instead (`rljob.kernels.logprobs_tma`: persistent, TMA loads,
warp-specialised;
the fp32 logits stay in registers): forward 21.1 ms against 24.1 ms for cuBLAS plus
`_chunk_stats_kernel` on an H200 at 11,600 x 151,936 x 4,096. The backward's logit gradient
comes from the same matmul, so its chunk holds only the 16-bit gradient and is wider. The
gradient matmuls stay cuBLAS: Triton matmuls without TMA run the fp32-accumulating
hidden-gradient product at ~46 TFLOP/s on an H200. Elsewhere (older GPUs, fp32
inputs, Triton's CPU interpreter) the cuBLAS path below runs.

Vocabulary parallelism: the weight is this rank's rows `[vocab_start, vocab_start + local)`;
the statistics are combined over `group` with one MAX and one SUM all-reduce, then the
hidden-state gradient is summed over `group` (unless sequence parallelism reduces it).
Imports Triton: callers reach it through
`rljob.kernels.logprobs_vocab_parallel.token_logprobs`, which uses it only for CUDA tensors.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from rljob.kernels import logprobs_tma
from rljob.kernels.logprobs_stats import Stats, all_reduce_stats, finish, merge

DEFAULT_CHUNK_BYTES = 1 << 27
"""Working bytes of one vocabulary chunk (128 MiB). TMA path: the forward's partial
statistics of one launch (the whole 151,936 vocabulary at 11,600 tokens) and the backward's
16-bit logit gradient (5,632 columns); cuBLAS path: the forward's fp32 logits (2,816 columns)
or the backward's 16-bit logit gradient plus the fp32 logits of one of its pieces (3,840
columns, five pieces of 768). With the returned gradients (1.25 GiB for a 152k x 4,096 head)
and the fp32 hidden-state gradient the backward peak stays under 1.5 GiB (1.462 and 1.454
measured on an H200)."""

_STATS_BLOCK_M = 8
_STATS_BLOCK_N = 256
_STATS_WARPS = 4
_STATS_SPLIT = 4096
"""Logit columns per statistics program: a chunk is split across programs when it is wider
(few tokens, wide chunks); at 11,600 tokens each chunk is one piece."""
_GRAD_Z_PARTS = 5
"""fp32 logit pieces per backward chunk (1: the whole chunk's logits at once). On the H200 3,
4, 5 and 6 pieces timed within 1% of one another (4 the slowest); 5 gives the widest chunk
(fewest accumulator passes) and the lowest peak (1.453 GiB against 1.461 with 3)."""
_GRAD_BLOCK_M = 16
_GRAD_BLOCK_N = 256
_USE_TMA = True
"""Take `rljob.kernels.logprobs_tma` where it can run (off: the cuBLAS path everywhere;
tests and the benchmark compare the two)."""


@triton.jit
def _chunk_stats_kernel(
    z_ptr,
    stride_z,
    n_rows,
    n_cols,
    tgt_ptr,
    col0,
    part_ptr,
    stride_part,
    split0,
    inv_t,
    WITH_ENTROPY: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Statistics of BLOCK_M rows over SPLIT columns of the logits `z[:, :n_cols]` (a chunk
    starting at local column `col0`): program (i, j) walks columns [j * SPLIT, (j + 1) * SPLIT)
    and writes (m, s, sz, tz) to rows `4 * (split0 + j) + 0..3` of the partials."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    row_ok = rows < n_rows
    # Rows past the end read the last row (never stored), so no lane sees an all -inf row.
    rows_in = tl.minimum(rows, n_rows - 1)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    sz = tl.zeros((BLOCK_M,), tl.float32)
    base = z_ptr + rows_in.to(tl.int64)[:, None] * stride_z
    c_end = tl.minimum(n_cols, (split + 1) * SPLIT)
    # The target's logit: one load per row whose target lies in this piece.
    tgt = tl.load(tgt_ptr + rows_in) - col0
    t_in = (tgt >= split * SPLIT) & (tgt < c_end)
    t_off = rows_in.to(tl.int64) * stride_z + tl.where(t_in, tgt, 0)
    tz = tl.load(z_ptr + t_off, mask=t_in, other=0.0) * inv_t
    for c0 in range(split * SPLIT, c_end, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < c_end
        z = tl.load(base + cols[None, :], mask=col_ok[None, :], other=float("-inf")) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=1))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])
        if WITH_ENTROPY:
            shift = tl.where(s > 0, m - m_new, 0.0)
            zs = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
            sz = (sz + shift * s) * scale + tl.sum(e * zs, axis=1)
        s = s * scale + tl.sum(e, axis=1)
        m = m_new
    out = part_ptr + (4 * (split0 + split)).to(tl.int64) * stride_part + rows
    tl.store(out, m, mask=row_ok)
    tl.store(out + stride_part, s, mask=row_ok)
    tl.store(out + 2 * stride_part, sz, mask=row_ok)
    tl.store(out + 3 * stride_part, tz, mask=row_ok)


@triton.jit
def _chunk_grad_kernel(
    z_ptr,
    stride_z,
    g_ptr,
    stride_g,
    n_rows,
    n_cols,
    tgt_ptr,
    col0,
    lse_ptr,
    mean_ptr,
    glp_ptr,
    gent_ptr,
    inv_t,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Gradient w.r.t. the raw logits of one chunk, in the dtype of `g_ptr`."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    z = tl.load(z_ptr + rows64 * stride_z + cols[None, :], mask=ok, other=0.0) * inv_t
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    # 32-bit column of the target in this chunk (-1 when outside it): no 64-bit compares.
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - col0
    tgt = tl.where((tgt >= 0) & (tgt < n_cols), tgt, -1).to(tl.int32)
    p = tl.exp(z - lse[:, None])
    onehot = tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0)
    g = glp[:, None] * (onehot - p)
    if WITH_ENTROPY:
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        g -= gent[:, None] * p * (z - mean[:, None])
    g = g * inv_t
    tl.store(g_ptr + rows64 * stride_g + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=ok)


def chunk_columns(n_tokens: int, bytes_per_element: int, chunk_bytes: int) -> int:
    """Vocabulary columns per chunk: as many as fit `chunk_bytes`, a multiple of 128 once
    that many fit (matmul tiles), at least one."""
    cols = max(1, chunk_bytes // max(1, bytes_per_element * n_tokens))
    return cols - cols % 128 if cols >= 256 else cols


def _logits_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`hidden @ weight.T` in fp32: 16-bit operands with fp32 output on CUDA (no rounding of
    the logits to 16 bits); upcast operands elsewhere (Triton's CPU interpreter)."""
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return hidden.float() @ weight.float().t()


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float) -> None:
    """`acc = beta * acc + a @ b` with fp32 `acc` and 16-bit operands, accumulated in fp32 in
    place; `beta=0` ignores what `acc` held (uninitialised memory: no zero fill first)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float(), beta=beta)


def _stats(
    hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor, inv_t: float,
    with_entropy: bool, chunk_bytes: int, tma: bool,
) -> Stats:
    """Per-token statistics of this rank's vocabulary: TMA launches over ranges of it
    (`tma`), merged one after another; else one fp32 logits chunk at a time, each split into
    `_STATS_SPLIT`-column pieces across programs (enough of them to keep the reads in
    flight), whose partial statistics are merged once at the end."""
    n_tokens, v_local = hidden.shape[0], weight.shape[0]
    cols = (logprobs_tma.range_columns(n_tokens, v_local, chunk_bytes) if tma
            else chunk_columns(n_tokens, 4, chunk_bytes))
    starts = list(range(0, v_local if n_tokens else 0, cols))
    if not starts:
        inf = torch.full((n_tokens,), float("-inf"), dtype=torch.float32, device=hidden.device)
        zero = torch.zeros(n_tokens, dtype=torch.float32, device=hidden.device)
        return Stats(inf, zero, zero.clone(), zero.clone())
    if tma:
        # Each range's partials (one per tile of columns) merge before the next range's are
        # made: `chunk_bytes` bounds them.
        out: Stats | None = None
        for v0 in starts:
            got = logprobs_tma.stats(
                hidden, weight[v0 : v0 + cols], local_targets, v0, inv_t, with_entropy)
            out = got if out is None else merge(out, got)
        assert out is not None
        return out
    splits = [triton.cdiv(min(cols, v_local - v0), _STATS_SPLIT) for v0 in starts]
    part = torch.empty(4 * sum(splits), n_tokens, dtype=torch.float32, device=hidden.device)
    split0 = 0
    for v0, n_split in zip(starts, splits, strict=True):
        z = _logits_fp32(hidden, weight[v0 : v0 + cols])
        grid = (triton.cdiv(n_tokens, _STATS_BLOCK_M), n_split)
        _chunk_stats_kernel[grid](
            z, z.stride(0), n_tokens, z.shape[1], local_targets, v0, part, part.stride(0),
            split0, inv_t, WITH_ENTROPY=with_entropy, SPLIT=_STATS_SPLIT,
            BLOCK_M=_STATS_BLOCK_M, BLOCK_N=_STATS_BLOCK_N, num_warps=_STATS_WARPS,
        )
        split0 += n_split
        del z
    return _merge_parts(part.view(-1, 4, n_tokens))


def _merge_parts(part: torch.Tensor) -> Stats:
    """Merge `[pieces, 4, tokens]` partial statistics (each piece holds at least one column)
    with the online-softmax identity of `rljob.kernels.logprobs_stats.merge`."""
    m_i, s_i, sz_i, tz_i = part.unbind(1)
    m = m_i.amax(dim=0)
    shift = m_i - m
    scale = torch.exp(shift)
    s = (s_i * scale).sum(dim=0)
    sz = ((sz_i + shift * s_i) * scale).sum(dim=0)
    return Stats(m, s, sz, tz_i.sum(dim=0))


def _grads(
    hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor,
    lse: torch.Tensor, mean_logit: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor,
    with_entropy: bool, inv_t: float, chunk_bytes: int, tma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 hidden-state gradient and 16-bit weight gradient, one vocabulary chunk at a time.

    A chunk's 16-bit logit gradient comes from one TMA launch (`tma`), or is filled
    `_GRAD_Z_PARTS` column pieces at a time from fp32 logits of one piece, so for the same
    working bytes the chunk is wider (more columns per fp32-accumulating hidden-gradient
    matmul, fewer passes over that accumulator)."""
    n_tokens, v_local = hidden.shape[0], weight.shape[0]
    parts = _GRAD_Z_PARTS
    # Per piece column: `parts` columns of the 16-bit gradient plus one of fp32 logits (with
    # TMA, the 16-bit gradient alone).
    sub = chunk_columns(n_tokens, 4 + parts * weight.element_size(), chunk_bytes)
    cols = (logprobs_tma.grad_columns(n_tokens, weight.element_size(), chunk_bytes) if tma
            else sub * parts)
    starts = range(0, v_local if n_tokens else 0, cols)
    # The first chunk's matmul overwrites the fp32 accumulator (beta = 0): no zero fill,
    # unless no chunk runs at all.
    grad_hidden = (torch.empty if len(starts) else torch.zeros)(
        hidden.shape, dtype=torch.float32, device=hidden.device
    )
    grad_weight = torch.zeros_like(weight) if n_tokens == 0 else torch.empty_like(weight)
    for v0 in starts:
        w = weight[v0 : v0 + cols]
        if tma:
            g = logprobs_tma.logit_grad(hidden, w, local_targets, v0, lse, mean_logit, g_lp,
                                        g_ent, with_entropy, inv_t)
        else:
            g = _logit_grad_pieces(hidden, w, local_targets, v0, lse, mean_logit, g_lp, g_ent,
                                   with_entropy, inv_t, sub)
        _addmm_fp32_(grad_hidden, g, w, beta=0.0 if v0 == 0 else 1.0)
        # One matmul over all tokens: fp32 accumulation, rounded once to the weight dtype.
        torch.mm(g.t(), hidden, out=grad_weight[v0 : v0 + cols])
        del g
    return grad_hidden, grad_weight


def _logit_grad_pieces(
    hidden: torch.Tensor, w: torch.Tensor, local_targets: torch.Tensor, v0: int,
    lse: torch.Tensor, mean_logit: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor,
    with_entropy: bool, inv_t: float, sub: int,
) -> torch.Tensor:
    """The 16-bit logit gradient of the chunk `w` (columns from `v0`), `sub` columns of fp32
    logits at a time (cuBLAS, then `_chunk_grad_kernel`)."""
    n_tokens = hidden.shape[0]
    g = torch.empty((n_tokens, w.shape[0]), dtype=w.dtype, device=hidden.device)
    for p0 in range(0, w.shape[0], sub):
        z = _logits_fp32(hidden, w[p0 : p0 + sub])
        gp = g[:, p0 : p0 + sub]
        grid = (triton.cdiv(n_tokens, _GRAD_BLOCK_M), triton.cdiv(z.shape[1], _GRAD_BLOCK_N))
        _chunk_grad_kernel[grid](
            z, z.stride(0), gp, gp.stride(0), n_tokens, z.shape[1], local_targets,
            v0 + p0, lse, mean_logit, g_lp, g_ent, inv_t,
            WITH_ENTROPY=with_entropy, BLOCK_M=_GRAD_BLOCK_M, BLOCK_N=_GRAD_BLOCK_N,
        )
        del z, gp  # a view keeps the whole chunk alive
    return g


_TOLD: set[str] = set()


def _say_why_not_tma(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """Log once per process and reason why 16-bit inputs take the slower cuBLAS path, so a
    misaligned or non-contiguous head is seen rather than silently slow."""
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        return  # fp32 inputs: the TMA kernels would multiply in TF32; cuBLAS is the path
    if not hidden.is_cuda:
        return  # CPU tensors under Triton's interpreter: no GPU to ask, nothing slower to tell
    if not logprobs_tma.gpu_fits(hidden.device, hidden.element_size()):
        why = f"{torch.cuda.get_device_name(hidden.device)} lacks TMA or its shared memory"
    else:
        why = (f"operands TMA cannot address (hidden {tuple(hidden.shape)} contiguous="
               f"{hidden.is_contiguous()}, weight {tuple(weight.shape)} contiguous="
               f"{weight.is_contiguous()}, dtypes {hidden.dtype}/{weight.dtype}, rows of a "
               "multiple of 16 bytes and 16-byte alignment needed)")
    if why not in _TOLD:
        _TOLD.add(why)
        logging.getLogger(__name__).warning("fused log-probs take the cuBLAS path: %s", why)


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        temperature: float,
        with_entropy: bool,
        group: dist.ProcessGroup | None,
        chunk_bytes: int,
        reduce_hidden_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_t = 1.0 / temperature
        local_targets = (targets - vocab_start).contiguous()
        # One choice of path per call, so the backward takes the forward's.
        tma = _USE_TMA and logprobs_tma.usable(hidden, weight)
        if _USE_TMA and not tma:
            _say_why_not_tma(hidden, weight)
        stats = _stats(hidden, weight, local_targets, inv_t, with_entropy, chunk_bytes, tma)
        res = finish(all_reduce_stats(stats, group))
        ctx.save_for_backward(hidden, weight, local_targets, res.lse, res.mean_logit)
        ctx.inv_t = inv_t
        ctx.with_entropy = with_entropy
        ctx.group = group
        ctx.chunk_bytes = chunk_bytes
        ctx.tma = tma
        ctx.reduce_hidden_grad = reduce_hidden_grad
        entropy = res.entropy if with_entropy else torch.zeros_like(res.entropy)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return res.logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, local_targets, lse, mean_logit = ctx.saved_tensors
        g_ent = grad_entropy if ctx.with_entropy else None
        g_lp = (
            torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            if grad_logprobs is None
            else grad_logprobs.float().contiguous()
        )
        with_entropy = g_ent is not None
        g_ent = g_lp if g_ent is None else g_ent.float().contiguous()
        grad_hidden, grad_weight = _grads(
            hidden, weight, local_targets, lse, mean_logit, g_lp, g_ent, with_entropy,
            ctx.inv_t, ctx.chunk_bytes, ctx.tma,
        )
        if ctx.reduce_hidden_grad and ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)
        return (grad_hidden.to(hidden.dtype), grad_weight) + (None,) * 7


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    temperature: float = 1.0,
    with_entropy: bool = False,
    group: dist.ProcessGroup | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    reduce_hidden_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `rljob.kernels.logprobs_vocab_parallel.vocab_parallel_logprobs` (arguments
    already checked by `token_logprobs`); `chunk_bytes` bounds the working memory."""
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}")
    logprobs, entropy = _FusedLogProbs.apply(
        hidden.contiguous(),
        weight.contiguous(),  # the kernels read rows with unit stride along the hidden size
        targets,
        vocab_start,
        temperature,
        with_entropy,
        group,
        chunk_bytes,
        reduce_hidden_grad,
    )
    return logprobs, (entropy if with_entropy else None)
