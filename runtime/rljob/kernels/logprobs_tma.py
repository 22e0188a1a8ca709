# Triton kernels take untyped pointer and block arguments (their annotations drive Triton).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The logits matmul with its epilogue in registers, for Hopper and later GPUs: the fp32
logits never reach memory.

`rljob.kernels.logprobs_fused` otherwise computes each vocabulary chunk's logits with a
cuBLAS matmul of fp32 output, then reads them back in a Triton pass. On an H200 at 11,600
tokens x 151,936
vocabulary x 4,096 hidden that matmul takes 22.3 ms where the same matmul with bf16 output
takes 18-20 ms, and the pass 2.7 ms more. Here one persistent Triton kernel per vocabulary
range loads both operands by TMA (tensor memory accelerator), multiplies them on the tensor
cores with fp32 accumulation (warp-specialised: some warps load while others multiply), and
turns each 128 x 256 tile of fp32 logits, still in registers, into

* forward (`stats`): the tile's softmax statistics per token (max, sum of exponentials, their
  logit-weighted sum for the entropy, the target's logit), 16 bytes a token a tile, which
  `_merge_kernel` then folds per token in one read (no temporaries of their size);
* backward (`logit_grad`): the logit gradient `g_lp * (onehot - p) - g_ent * p * (z - E_p[z])`
  (over the temperature) of one vocabulary chunk, written once in the inputs' 16-bit dtype,
  for the two gradient matmuls (cuBLAS) that follow.

Only 16-bit operands take this path (fp32 inputs would multiply in TF32), and only where TMA
can address them: contiguous rows whose byte length is a multiple of 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rljob.kernels.logprobs_stats import Stats

BLOCK_M = 128
BLOCK_N = 256
BLOCK_K = 64
GROUP_M = 8
STAGES = 3
WARPS = 8
"""Tile and pipeline of both kernels. On an H200 (this shape, Triton 3.6) 128 x 256 x 64 with
three stages and eight warps, warp-specialised, took 21.1 ms; without warp specialisation
21.5, 128 x 128 tiles 22.8-22.9, 64 x 256 25.8, and four warps 167."""


def shared_memory_bytes(element_size: int) -> int:
    """Shared memory the kernels' pipeline holds: STAGES tiles of both operands."""
    return STAGES * (BLOCK_M + BLOCK_N) * BLOCK_K * element_size


def gpu_fits(device: torch.device, element_size: int = 2) -> bool:
    """Whether this GPU runs the kernels: TMA (compute capability 9.0 or later) and room for
    their shared memory (a GPU of capability 12, with about 99 KiB a block, has not)."""
    props = torch.cuda.get_device_properties(device)
    return props.major >= 9 and props.shared_memory_per_block_optin >= shared_memory_bytes(
        element_size)


def usable(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the TMA kernels can take these operands: 16-bit, on a GPU that fits them
    (`gpu_fits`), contiguous rows of a multiple of 16 bytes, 16-byte aligned."""
    if not hidden.is_cuda:
        return False
    if hidden.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != hidden.dtype:
        return False
    if not gpu_fits(hidden.device, hidden.element_size()):
        return False
    k = hidden.shape[1]
    return (
        hidden.is_contiguous()
        and weight.is_contiguous()
        and (k * hidden.element_size()) % 16 == 0
        and hidden.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def _sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@triton.jit
def _tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row blocks share each weight tile while it is in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    size = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + tile % size, (tile % in_group) // size


@triton.jit
def _logits_tile(a_desc, b_desc, tile, n_rows, n_cols, k, GROUP_M: tl.constexpr):
    """Tile `tile` of the persistent loop that both kernels run over the logits
    `[n_rows, n_cols]`: its column-tile index, rows, columns, row mask and fp32 logits (before
    the temperature). One helper so that the statistics and the gradient take the same tiles in
    the same order, summed alike; the tile is the descriptors' blocks (`[BLOCK_M, BLOCK_K]` of
    the hidden states, `[BLOCK_N, BLOCK_K]` of the weight). Triton inlines it, so both
    kernels compute what they would with it written out in each (bitwise the same outputs
    on an H200)."""
    BLOCK_M: tl.constexpr = a_desc.block_shape[0]
    BLOCK_K: tl.constexpr = a_desc.block_shape[1]
    BLOCK_N: tl.constexpr = b_desc.block_shape[0]
    pid_m, pid_n = _tile(tile, tl.cdiv(n_rows, BLOCK_M), tl.cdiv(n_cols, BLOCK_N), GROUP_M)
    om = pid_m * BLOCK_M
    on = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(k, BLOCK_K)):
        a = a_desc.load([om, ki * BLOCK_K])
        b = b_desc.load([on, ki * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    rows = om + tl.arange(0, BLOCK_M)
    return pid_n, rows, on + tl.arange(0, BLOCK_N), rows < n_rows, acc


@triton.jit
def _stats_kernel(
    a_desc, b_desc, tgt_ptr, col0, part_ptr, n_rows, n_cols, k, inv_t,
    WITH_ENTROPY: tl.constexpr, NUM_SMS: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Writes (m, s, sz, tz) of tile (i, j) to rows 4j..4j+3 of the partials, columns of i."""
    tiles = tl.cdiv(n_rows, a_desc.block_shape[0]) * tl.cdiv(n_cols, b_desc.block_shape[0])
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True, warp_specialize=True):
        pid_n, rows, cols, row_ok, acc = _logits_tile(a_desc, b_desc, tile, n_rows, n_cols, k,
                                                      GROUP_M)
        col_ok = cols < n_cols
        z = tl.where(col_ok[None, :], acc * inv_t, float("-inf"))
        m = tl.max(z, axis=1)
        e = tl.exp(z - m[:, None])
        s = tl.sum(e, axis=1)
        # 32-bit column of the target in this range (-1 when outside it).
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - col0
        tgt = tl.where((tgt >= 0) & (tgt < n_cols), tgt, -1).to(tl.int32)
        tz = tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        out = part_ptr + (4 * pid_n).to(tl.int64) * n_rows + rows
        tl.store(out, m, mask=row_ok)
        tl.store(out + n_rows, s, mask=row_ok)
        if WITH_ENTROPY:
            sz = tl.sum(e * tl.where(col_ok[None, :], z - m[:, None], 0.0), axis=1)
            tl.store(out + 2 * n_rows, sz, mask=row_ok)
        else:
            tl.store(out + 2 * n_rows, tl.zeros_like(m), mask=row_ok)
        tl.store(out + 3 * n_rows, tz, mask=row_ok)


@triton.jit
def _grad_kernel(
    a_desc, b_desc, g_ptr, tgt_ptr, col0, lse_ptr, mean_ptr, glp_ptr, gent_ptr,
    n_rows, n_cols, k, inv_t,
    WITH_ENTROPY: tl.constexpr, NUM_SMS: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The logit gradient of columns [col0, col0 + n_cols) into `g` (rows x n_cols)."""
    tiles = tl.cdiv(n_rows, a_desc.block_shape[0]) * tl.cdiv(n_cols, b_desc.block_shape[0])
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True, warp_specialize=True):
        _, rows, cols, row_ok, acc = _logits_tile(a_desc, b_desc, tile, n_rows, n_cols, k, GROUP_M)
        z = acc * inv_t
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - col0
        tgt = tl.where((tgt >= 0) & (tgt < n_cols), tgt, -1).to(tl.int32)
        p = tl.exp(z - lse[:, None])
        g = glp[:, None] * (tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0) - p)
        if WITH_ENTROPY:
            mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
            gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
            g -= gent[:, None] * p * (z - mean[:, None])
        g = g * inv_t
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        out = g_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        tl.store(out, g.to(g_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _merge_kernel(part_ptr, tiles, n_rows, out_ptr, BLOCK: tl.constexpr):
    """Merge each token's per-tile statistics (rows 4j..4j+3 of the partials) into rows
    0..3 of `out`, one tile at a time with the online-softmax update: no temporaries the size
    of the partials."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    sz = tl.zeros((BLOCK,), tl.float32)
    tz = tl.zeros((BLOCK,), tl.float32)
    for j in range(tiles):
        base = part_ptr + tl.cast(4 * j, tl.int64) * n_rows + rows
        m_j = tl.load(base, mask=ok, other=0.0)
        s_j = tl.load(base + n_rows, mask=ok, other=0.0)
        sz_j = tl.load(base + 2 * n_rows, mask=ok, other=0.0)
        tz += tl.load(base + 3 * n_rows, mask=ok, other=0.0)
        m_new = tl.maximum(m, m_j)
        a = tl.exp(m - m_new)
        b = tl.exp(m_j - m_new)
        shift = tl.where(s > 0, m - m_new, 0.0)  # 0 * -inf would be NaN before any tile
        sz = (sz + shift * s) * a + (sz_j + (m_j - m_new) * s_j) * b
        s = s * a + s_j * b
        m = m_new
    tl.store(out_ptr + rows, m, mask=ok)
    tl.store(out_ptr + n_rows + rows, s, mask=ok)
    tl.store(out_ptr + 2 * n_rows + rows, sz, mask=ok)
    tl.store(out_ptr + 3 * n_rows + rows, tz, mask=ok)


_MERGE_BLOCK = 256


def _descriptors(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[object, object]:
    return (TensorDescriptor.from_tensor(hidden, [BLOCK_M, BLOCK_K]),
            TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K]))


def _grid(n_rows: int, n_cols: int, sms: int) -> tuple[int]:
    return (max(1, min(sms, triton.cdiv(n_rows, BLOCK_M) * triton.cdiv(n_cols, BLOCK_N))),)


def range_columns(n_tokens: int, vocab: int, chunk_bytes: int) -> int:
    """Vocabulary columns per forward launch: whole tiles whose partial statistics (16 bytes
    a token a tile) fit `chunk_bytes`, at least one tile, the tiles spread evenly over the
    launches (no short last launch that reads all the hidden states for a few columns)."""
    most = max(1, chunk_bytes // max(1, 16 * n_tokens))
    tiles = triton.cdiv(vocab, BLOCK_N)
    launches = triton.cdiv(tiles, most)
    return int(triton.cdiv(tiles, launches)) * BLOCK_N


def grad_columns(n_tokens: int, element_size: int, chunk_bytes: int) -> int:
    """Vocabulary columns per backward chunk: as many 16-bit logit-gradient columns as fit
    `chunk_bytes`, whole tiles once one fits (a part-empty last tile wastes its matmul)."""
    cols = max(1, chunk_bytes // max(1, element_size * n_tokens))
    return cols - cols % BLOCK_N if cols >= BLOCK_N else cols


def stats(
    hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor, col0: int,
    inv_t: float, with_entropy: bool,
) -> Stats:
    """Softmax statistics of this weight's rows (vocabulary columns `col0 + 0..rows`): per
    tile of columns in the matmul's epilogue, then merged per token by `_merge_kernel`."""
    n_tokens, v = hidden.shape[0], weight.shape[0]
    tiles = triton.cdiv(v, BLOCK_N)
    part = torch.empty(4 * tiles, n_tokens, dtype=torch.float32, device=hidden.device)
    a_desc, b_desc = _descriptors(hidden, weight)
    sms = _sms(hidden.device)
    _stats_kernel[_grid(n_tokens, v, sms)](
        a_desc, b_desc, local_targets, col0, part, n_tokens, v, hidden.shape[1], inv_t,
        WITH_ENTROPY=with_entropy, NUM_SMS=sms, GROUP_M=GROUP_M, num_stages=STAGES,
        num_warps=WARPS,
    )
    return merge_partials(part.view(tiles, 4, n_tokens))


def merge_partials(part: torch.Tensor) -> Stats:
    """Fold contiguous partial statistics `[tiles, 4, tokens]` (each tile's over at least one
    column) into each token's, on the GPU."""
    tiles, _, n_tokens = part.shape
    out = torch.empty(4, n_tokens, dtype=torch.float32, device=part.device)
    _merge_kernel[(triton.cdiv(n_tokens, _MERGE_BLOCK),)](
        part, tiles, n_tokens, out, BLOCK=_MERGE_BLOCK)
    return Stats(*out.unbind(0))


def logit_grad(
    hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor, col0: int,
    lse: torch.Tensor, mean_logit: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor,
    with_entropy: bool, inv_t: float,
) -> torch.Tensor:
    """The 16-bit logit gradient `[tokens, rows of weight]` of vocabulary columns from
    `col0`."""
    n_tokens, v = hidden.shape[0], weight.shape[0]
    g = torch.empty((n_tokens, v), dtype=hidden.dtype, device=hidden.device)
    a_desc, b_desc = _descriptors(hidden, weight)
    sms = _sms(hidden.device)
    _grad_kernel[_grid(n_tokens, v, sms)](
        a_desc, b_desc, g, local_targets, col0, lse, mean_logit, g_lp, g_ent,
        n_tokens, v, hidden.shape[1], inv_t,
        WITH_ENTROPY=with_entropy, NUM_SMS=sms, GROUP_M=GROUP_M, num_stages=STAGES,
        num_warps=WARPS,
    )
    return g
