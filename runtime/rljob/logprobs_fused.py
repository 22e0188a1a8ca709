# Triton kernels take untyped pointer and block arguments (their annotations drive Triton).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Token log-probs and entropy from hidden states on CUDA, with Triton kernels.

The tiled torch function (`rljob.logprobs_vocab_parallel`) is exact and lean but slow: its
logits come from PyTorch's fp32-output bf16 matmul (a slow path, ~250 TFLOP/s on an H200)
and it makes about ten elementwise passes over each fp32 `[tokens x chunk]` tile. Both
variants here keep the per-token softmax statistics (max, sum of exponentials, their
logit-weighted sum for the entropy, the target's logit; `rljob.logprobs_stats` holds the
algebra) and never hold a `[tokens x vocab]` tensor:

* `matmul="triton"` (default): the logits exist only in registers. Forward,
  `_fwd_gemm_stats_kernel` computes logit tiles with fp32 accumulation and folds them into
  the statistics of its vocabulary split; the splits merge in torch. Backward, per
  vocabulary chunk, `_bwd_gemm_grad_kernel` recomputes the logits and writes the 16-bit logit
  gradient `g_lp * (onehot - p) - g_ent * p * (z - E_p[z])` (over the temperature);
  `_addmm_fp32_kernel` adds its product with the weight chunk to the fp32 hidden-state
  gradient, and one cuBLAS matmul over all tokens gives the chunk's weight-gradient rows
  (fp32 accumulation, rounded once).
* `matmul="cublas"`: cuBLAS writes each chunk's logits in fp32 (PyTorch's fp32-output
  matmul); `_chunk_stats_kernel` folds them (forward) or `_chunk_grad_kernel` turns them into
  the logit gradient (backward) in one pass.

Vocabulary parallelism: the weight is this rank's rows `[vocab_start, vocab_start + local)`;
the statistics are combined over `group` with one MAX and one SUM all-reduce, then the
hidden-state gradient is summed over `group` (unless sequence parallelism reduces it).
Imports Triton: callers reach it through `rljob.logprobs_vocab_parallel.token_logprobs`, which
uses it only for CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from rljob.logprobs_stats import Stats, all_reduce_stats, finish, merge_splits

DEFAULT_CHUNK_BYTES = 1 << 27
"""Working bytes of one vocabulary chunk (128 MiB): the backward's 16-bit logit gradient
(5,760 columns at 11,600 tokens), or with `matmul="cublas"` the fp32 logits (plus their
gradient, backward). With the returned gradients (1.25 GiB for a 152k x 4,096 head) and the
fp32 hidden-state gradient the backward peak stays under 1.5 GiB."""

_STATS_BLOCK_M = 16
_STATS_BLOCK_N = 256
_GRAD_BLOCK_M = 16
_GRAD_BLOCK_N = 256


@dataclass(frozen=True)
class Tiling:
    """Tile shape and launch settings of one Triton matmul kernel."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    warps: int = 8
    stages: int = 3
    """Software-pipeline depth for 16-bit operands; fp32 operands (tests, fp32 models) get
    at most two stages, whose shared memory three would overflow."""

    def stages_for(self, dtype: torch.dtype) -> int:
        return min(2, self.stages) if dtype == torch.float32 else self.stages


TILINGS: dict[str, Tiling] = {"fwd": Tiling(), "grad": Tiling(), "addmm": Tiling()}
"""Tiling of the forward-statistics, logit-gradient and hidden-gradient kernels; the
benchmark sweeps alternatives through `set_tilings`."""


def set_tilings(**tilings: Tiling) -> None:
    """Replace the tiling of named kernels (`fwd`, `grad`, `addmm`) for later calls."""
    unknown = set(tilings) - set(TILINGS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; known: {sorted(TILINGS)}")
    TILINGS.update(tilings)


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


@triton.jit
def _dot_acc(a, b, acc, IEEE: tl.constexpr):
    """`acc + a @ b` with fp32 accumulation; fp32 operands in full fp32 (no TF32)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _logits_tile(
    h_ptr, w_ptr, rows_in, cols_in, stride_h, stride_w, hidden_dim,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):
    """fp32 `hidden[rows] @ weight[cols].T` for one [BLOCK_M, BLOCK_N] tile."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows_in.to(tl.int64)[:, None] * stride_h + offs_k[None, :]
    b_ptrs = w_ptr + cols_in.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, hidden_dim, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (offs_k + k) < hidden_dim
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
        acc = _dot_acc(a, tl.trans(b), acc, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _fwd_gemm_stats_kernel(
    h_ptr, w_ptr, tgt_ptr, part_ptr, n_rows, n_vocab, hidden_dim, stride_h, stride_w,
    split_cols, n_splits, inv_t,
    WITH_ENTROPY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_R: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):
    """Softmax statistics of BLOCK_M tokens over one split of `split_cols` vocabulary
    columns, the logits computed tile by tile in registers (no logits in memory).

    Writes `[4, n_splits, n_rows]` partial statistics."""
    # Programs run in groups of GROUP_R row blocks x all splits, row block fastest: those
    # running together share their hidden rows and their weight tiles through L2.
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_M)
    per_group = GROUP_R * n_splits
    first_rb = (pid // per_group) * GROUP_R
    group_r = tl.minimum(n_row_blocks - first_rb, GROUP_R)
    rb = first_rb + (pid % per_group) % group_r
    split = (pid % per_group) // group_r
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rows_in = tl.minimum(rows, n_rows - 1)
    tgt = tl.load(tgt_ptr + rows_in)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    sz = tl.zeros((BLOCK_M,), tl.float32)
    tz = tl.zeros((BLOCK_M,), tl.float32)
    v_begin = split * split_cols
    v_end = tl.minimum(v_begin + split_cols, n_vocab)
    for v0 in range(v_begin, v_end, BLOCK_N):
        cols = v0 + tl.arange(0, BLOCK_N)
        col_ok = cols < v_end
        acc = _logits_tile(
            h_ptr, w_ptr, rows_in, tl.minimum(cols, n_vocab - 1), stride_h, stride_w,
            hidden_dim, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE,
        )
        z = tl.where(col_ok[None, :], acc * inv_t, float("-inf"))
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
    plane = n_splits * n_rows
    out = part_ptr + split * n_rows + rows
    tl.store(out, m, mask=row_ok)
    tl.store(out + plane, s, mask=row_ok)
    tl.store(out + 2 * plane, sz, mask=row_ok)
    tl.store(out + 3 * plane, tz, mask=row_ok)


@triton.jit
def _grouped_tile(pid, n_m, n_n, GROUP_M: tl.constexpr):
    """Tile (pid_m, pid_n) of `pid`, walking GROUP_M row tiles per column sweep so that
    programs running together share operand tiles in L2."""
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _bwd_gemm_grad_kernel(
    h_ptr, w_ptr, g_ptr, n_rows, n_cols, hidden_dim, stride_h, stride_w, stride_g,
    tgt_ptr, col0, lse_ptr, mean_ptr, glp_ptr, gent_ptr, inv_t,
    WITH_ENTROPY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):
    """Logit gradient of one vocabulary chunk (`w_ptr` at its first row, `n_cols` rows),
    the logits recomputed in registers; written once in the dtype of `g_ptr`."""
    pid_m, pid_n = _grouped_tile(
        tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.cdiv(n_cols, BLOCK_N), GROUP_M
    )
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    rows_in = tl.minimum(rows, n_rows - 1)
    acc = _logits_tile(
        h_ptr, w_ptr, rows_in, tl.minimum(cols, n_cols - 1), stride_h, stride_w, hidden_dim,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE,
    )
    z = acc * inv_t
    lse = tl.load(lse_ptr + rows_in)
    glp = tl.load(glp_ptr + rows_in)
    tgt = tl.load(tgt_ptr + rows_in) - col0
    p = tl.exp(z - lse[:, None])
    onehot = tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0)
    g = glp[:, None] * (onehot - p)
    if WITH_ENTROPY:
        mean = tl.load(mean_ptr + rows_in)
        gent = tl.load(gent_ptr + rows_in)
        g -= gent[:, None] * p * (z - mean[:, None])
    g = g * inv_t
    ptrs = g_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
    tl.store(ptrs, g.to(g_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _addmm_fp32_kernel(
    c_ptr, a_ptr, b_ptr, M, N, K, stride_c, stride_a, stride_b,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):
    """`c += a @ b`: fp32 `c` [M, N], 16-bit (or fp32) row-major `a` [M, K] and `b` [K, N].
    The hidden-state gradient summed over vocabulary chunks in fp32 at matmul speed."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N),
                                 GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_in = tl.minimum(rows, M - 1)
    cols_in = tl.minimum(cols, N - 1)
    a_ptrs = a_ptr + rows_in.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
    b_ptrs = b_ptr + offs_k.to(tl.int64)[:, None] * stride_b + cols_in[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (offs_k + k) < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = _dot_acc(a, b, acc, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_b
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_c + cols[None, :]
    tl.store(c_ptrs, tl.load(c_ptrs, mask=ok, other=0.0) + acc, mask=ok)


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


def _stats_cublas(
    hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor, inv_t: float,
    with_entropy: bool, chunk_bytes: int,
) -> Stats:
    """Forward with cuBLAS logits: one fp32 chunk in memory, folded by `_chunk_stats_kernel`."""
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


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 132  # Triton's CPU interpreter: any count gives the same values


def _stats_triton(
    hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor, inv_t: float,
    with_entropy: bool,
) -> Stats:
    """Forward with the logits in registers only: `_fwd_gemm_stats_kernel` over vocabulary
    splits (enough programs for several waves), then the splits merged in torch."""
    n_tokens, v_local, hidden_dim = hidden.shape[0], weight.shape[0], hidden.shape[1]
    dev = hidden.device
    if n_tokens == 0 or v_local == 0:
        zero = torch.zeros(n_tokens, dtype=torch.float32, device=dev)
        return Stats(torch.full_like(zero, float("-inf")), zero, zero, zero)
    cfg = TILINGS["fwd"]
    bm, bn = cfg.block_m, cfg.block_n
    row_blocks = triton.cdiv(n_tokens, bm)
    # About sixteen waves of programs, so that the last, partial wave costs little.
    wanted = triton.cdiv(16 * _sm_count(dev), row_blocks)
    split_cols = triton.cdiv(triton.cdiv(v_local, wanted), bn) * bn
    n_splits = triton.cdiv(v_local, split_cols)
    part = torch.empty(4, n_splits, n_tokens, dtype=torch.float32, device=dev)
    _fwd_gemm_stats_kernel[(row_blocks * n_splits,)](
        hidden, weight, local_targets, part, n_tokens, v_local, hidden_dim, hidden.stride(0),
        weight.stride(0), split_cols, n_splits, inv_t,
        WITH_ENTROPY=with_entropy, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg.block_k,
        GROUP_R=8, EVEN_K=hidden_dim % cfg.block_k == 0, IEEE=hidden.dtype == torch.float32,
        num_warps=cfg.warps, num_stages=cfg.stages_for(hidden.dtype),
    )
    return merge_splits(part[0], part[1], part[2], part[3])


def _grads_cublas(
    hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor,
    lse: torch.Tensor, mean_logit: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor,
    with_entropy: bool, inv_t: float, chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward with cuBLAS logits (fp32 chunk), `_chunk_grad_kernel`, cuBLAS gradients."""
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


def _grads_triton(
    hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor,
    lse: torch.Tensor, mean_logit: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor,
    with_entropy: bool, inv_t: float, chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward with the logits recomputed in registers (`_bwd_gemm_grad_kernel` writes only
    the 16-bit logit gradient of a chunk), the hidden-state gradient accumulated in fp32 by
    `_addmm_fp32_kernel`, and the weight gradient of the chunk by one cuBLAS matmul."""
    n_tokens, v_local, hidden_dim = hidden.shape[0], weight.shape[0], hidden.shape[1]
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.zeros_like(weight) if n_tokens == 0 else torch.empty_like(weight)
    gc, ac = TILINGS["grad"], TILINGS["addmm"]
    ieee = hidden.dtype == torch.float32
    cols = chunk_columns(n_tokens, weight.element_size(), chunk_bytes)
    for v0 in range(0, v_local if n_tokens else 0, cols):
        w = weight[v0 : v0 + cols]
        n = w.shape[0]
        g = torch.empty(n_tokens, n, dtype=weight.dtype, device=hidden.device)
        _bwd_gemm_grad_kernel[
            (triton.cdiv(n_tokens, gc.block_m) * triton.cdiv(n, gc.block_n),)
        ](
            hidden, w, g, n_tokens, n, hidden_dim, hidden.stride(0), w.stride(0), g.stride(0),
            local_targets, v0, lse, mean_logit, g_lp, g_ent, inv_t,
            WITH_ENTROPY=with_entropy, BLOCK_M=gc.block_m, BLOCK_N=gc.block_n,
            BLOCK_K=gc.block_k, GROUP_M=8, EVEN_K=hidden_dim % gc.block_k == 0, IEEE=ieee,
            num_warps=gc.warps, num_stages=gc.stages_for(hidden.dtype),
        )
        _addmm_fp32_kernel[
            (triton.cdiv(n_tokens, ac.block_m) * triton.cdiv(hidden_dim, ac.block_n),)
        ](
            grad_hidden, g, w, n_tokens, hidden_dim, n, grad_hidden.stride(0), g.stride(0),
            w.stride(0), BLOCK_M=ac.block_m, BLOCK_N=ac.block_n, BLOCK_K=ac.block_k,
            GROUP_M=8, EVEN_K=n % ac.block_k == 0, IEEE=ieee, num_warps=ac.warps,
            num_stages=ac.stages_for(hidden.dtype),
        )
        # One matmul over all tokens: fp32 accumulation, rounded once to the weight dtype.
        torch.mm(g.t(), hidden, out=grad_weight[v0 : v0 + n])
        del g
    return grad_hidden, grad_weight


MATMULS = ("triton", "cublas")
"""Where the logits are computed: in the Triton kernels' registers, or by cuBLAS into an
fp32 chunk that a Triton kernel then reads."""


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
        matmul: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_t = 1.0 / temperature
        local_targets = (targets - vocab_start).contiguous()
        if matmul == "triton":
            stats = _stats_triton(hidden, weight, local_targets, inv_t, with_entropy)
        else:
            stats = _stats_cublas(hidden, weight, local_targets, inv_t, with_entropy, chunk_bytes)
        res = finish(all_reduce_stats(stats, group))
        ctx.save_for_backward(hidden, weight, local_targets, res.lse, res.mean_logit)
        ctx.inv_t = inv_t
        ctx.with_entropy = with_entropy
        ctx.group = group
        ctx.chunk_bytes = chunk_bytes
        ctx.reduce_hidden_grad = reduce_hidden_grad
        ctx.matmul = matmul
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
        grads = _grads_triton if ctx.matmul == "triton" else _grads_cublas
        grad_hidden, grad_weight = grads(
            hidden, weight, local_targets, lse, mean_logit, g_lp, g_ent, with_entropy,
            ctx.inv_t, ctx.chunk_bytes,
        )
        if ctx.reduce_hidden_grad and ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)
        return (grad_hidden.to(hidden.dtype), grad_weight) + (None,) * 9


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
    matmul: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `rljob.logprobs_vocab_parallel.vocab_parallel_logprobs` (arguments
    already checked by `token_logprobs`); `chunk_bytes` bounds the working memory; `matmul`
    is one of `MATMULS`."""
    if matmul not in MATMULS:
        raise ValueError(f"matmul must be one of {MATMULS}; got {matmul!r}")
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
        matmul,
    )
    return logprobs, (entropy if with_entropy else None)
