# Triton kernels take untyped pointer and block arguments (their annotations drive Triton).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Token log-probs and entropy from hidden states on CUDA: cuBLAS matmuls, Triton epilogues.

The tiled torch function (`rljob.logprobs_vocab_parallel`) is exact and lean but slow: after
each logits matmul it makes about ten elementwise passes over an fp32 `[tokens x chunk]` tile
(shift, exp, gather, scale, cast...) and scatters the target's gradient with `index_put_`.
Here each vocabulary chunk costs one cuBLAS matmul with fp32 output (bf16 operands, fp32
accumulation, no 16-bit rounding of the logits) and one Triton pass over its logits:

* forward: `_chunk_stats_kernel` folds the chunk into per-token running softmax statistics
  (max, sum of exponentials, their logit-weighted sum for the entropy, the target's logit;
  `rljob.logprobs_stats` holds the algebra), so the forward peak is one fp32 chunk;
* backward: each chunk's logits are recomputed and `_chunk_grad_kernel` turns them into the
  logit gradient `g_lp * (onehot - p) - g_ent * p * (z - E_p[z])` (over the temperature),
  written once in the inputs' 16-bit dtype; two cuBLAS matmuls then give the hidden-state
  gradient (accumulated over chunks in fp32) and the chunk's weight-gradient rows (one matmul
  over all tokens, fp32 accumulation, rounded once).

Why cuBLAS computes the logits: Triton matmul kernels that kept the logits in registers (no
fp32 chunk at all; commit 1481f7e, `matmul="triton"`) were measured on an H200: their forward
took 29.5 ms against 24.4 ms here, and their fp32-accumulating hidden-gradient kernel ran at
~46 TFLOP/s; their logit-gradient kernel only matched cuBLAS plus `_chunk_grad_kernel`.

Vocabulary parallelism: the weight is this rank's rows `[vocab_start, vocab_start + local)`;
the statistics are combined over `group` with one MAX and one SUM all-reduce, then the
hidden-state gradient is summed over `group` (unless sequence parallelism reduces it).
Imports Triton: callers reach it through `rljob.logprobs_vocab_parallel.token_logprobs`, which
uses it only for CUDA tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from rljob.logprobs_stats import Stats, all_reduce_stats, finish

DEFAULT_CHUNK_BYTES = 1 << 27
"""Working bytes of one vocabulary chunk (128 MiB): the forward's fp32 logits, or the
backward's fp32 logits plus their 16-bit gradient. At 11,600 tokens that is 2,816 columns
forward and 1,920 backward; with the returned gradients (1.25 GiB for a 152k x 4,096 head)
and the fp32 hidden-state gradient the backward peak stays under 1.5 GiB (1.46 measured)."""

_STATS_BLOCK_M = 16
_STATS_BLOCK_N = 256
_GRAD_BLOCK_M = 16
_GRAD_BLOCK_N = 256


@triton.jit
def _chunk_stats_kernel(
    z_ptr,
    stride_z,
    n_rows,
    n_cols,
    tgt_ptr,
    col0,
    m_ptr,
    s_ptr,
    sz_ptr,
    tz_ptr,
    inv_t,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Fold the logits `z[:, :n_cols]` (chunk starting at local column `col0`) into the
    running statistics of its rows. One program owns BLOCK_M rows and walks the columns."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    # Rows past the end read the last row (never stored), so no lane sees an all -inf row.
    rows_in = tl.minimum(rows, n_rows - 1)
    m = tl.load(m_ptr + rows_in)
    s = tl.load(s_ptr + rows_in)
    sz = tl.load(sz_ptr + rows_in)
    tz = tl.load(tz_ptr + rows_in)
    tgt = tl.load(tgt_ptr + rows_in) - col0
    base = z_ptr + rows_in.to(tl.int64)[:, None] * stride_z
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        z = tl.load(base + cols[None, :], mask=col_ok[None, :], other=float("-inf")) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=1))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])
        if WITH_ENTROPY:
            shift = tl.where(s > 0, m - m_new, 0.0)
            zs = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
            sz = (sz + shift * s) * scale + tl.sum(e * zs, axis=1)
        s = s * scale + tl.sum(e, axis=1)
        hit = (cols[None, :] == tgt[:, None]) & col_ok[None, :]
        tz += tl.sum(tl.where(hit, z, 0.0), axis=1)
        m = m_new
    tl.store(m_ptr + rows, m, mask=row_ok)
    tl.store(s_ptr + rows, s, mask=row_ok)
    tl.store(sz_ptr + rows, sz, mask=row_ok)
    tl.store(tz_ptr + rows, tz, mask=row_ok)


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
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - col0
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


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`acc += a @ b` with fp32 `acc` and 16-bit operands, accumulated in fp32 in place."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _stats(
    hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor, inv_t: float,
    with_entropy: bool, chunk_bytes: int,
) -> Stats:
    """Per-token statistics of this rank's vocabulary, one fp32 logits chunk at a time."""
    n_tokens, v_local = hidden.shape[0], weight.shape[0]
    m = torch.full((n_tokens,), float("-inf"), dtype=torch.float32, device=hidden.device)
    s = torch.zeros(n_tokens, dtype=torch.float32, device=hidden.device)
    sz = torch.zeros_like(s)
    tz = torch.zeros_like(s)
    cols = chunk_columns(n_tokens, 4, chunk_bytes)
    for v0 in range(0, v_local if n_tokens else 0, cols):
        z = _logits_fp32(hidden, weight[v0 : v0 + cols])
        grid = (triton.cdiv(n_tokens, _STATS_BLOCK_M),)
        _chunk_stats_kernel[grid](
            z, z.stride(0), n_tokens, z.shape[1], local_targets, v0, m, s, sz, tz, inv_t,
            WITH_ENTROPY=with_entropy, BLOCK_M=_STATS_BLOCK_M, BLOCK_N=_STATS_BLOCK_N,
        )
        del z
    return Stats(m, s, sz, tz)


def _grads(
    hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor,
    lse: torch.Tensor, mean_logit: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor,
    with_entropy: bool, inv_t: float, chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 hidden-state gradient and 16-bit weight gradient, one vocabulary chunk at a time."""
    n_tokens, v_local = hidden.shape[0], weight.shape[0]
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.zeros_like(weight) if n_tokens == 0 else torch.empty_like(weight)
    # fp32 logits plus their gradient in the weight's dtype, per element of a chunk.
    cols = chunk_columns(n_tokens, 4 + weight.element_size(), chunk_bytes)
    for v0 in range(0, v_local if n_tokens else 0, cols):
        w = weight[v0 : v0 + cols]
        z = _logits_fp32(hidden, w)
        g = torch.empty(z.shape, dtype=weight.dtype, device=z.device)
        grid = (triton.cdiv(n_tokens, _GRAD_BLOCK_M), triton.cdiv(z.shape[1], _GRAD_BLOCK_N))
        _chunk_grad_kernel[grid](
            z, z.stride(0), g, g.stride(0), n_tokens, z.shape[1], local_targets, v0,
            lse, mean_logit, g_lp, g_ent, inv_t,
            WITH_ENTROPY=with_entropy, BLOCK_M=_GRAD_BLOCK_M, BLOCK_N=_GRAD_BLOCK_N,
        )
        del z
        _addmm_fp32_(grad_hidden, g, w)
        # One matmul over all tokens: fp32 accumulation, rounded once to the weight dtype.
        torch.mm(g.t(), hidden, out=grad_weight[v0 : v0 + cols])
        del g
    return grad_hidden, grad_weight


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
        stats = _stats(hidden, weight, local_targets, inv_t, with_entropy, chunk_bytes)
        res = finish(all_reduce_stats(stats, group))
        ctx.save_for_backward(hidden, weight, local_targets, res.lse, res.mean_logit)
        ctx.inv_t = inv_t
        ctx.with_entropy = with_entropy
        ctx.group = group
        ctx.chunk_bytes = chunk_bytes
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
            ctx.inv_t, ctx.chunk_bytes,
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
    """Same contract as `rljob.logprobs_vocab_parallel.vocab_parallel_logprobs` (arguments
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
