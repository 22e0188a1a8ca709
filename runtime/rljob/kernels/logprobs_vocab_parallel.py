"""Memory-lean token log-probabilities (and entropy) straight from hidden states.

The usual recipe materialises the full `[tokens x vocab]` logits, upcasts them to fp32 and runs
`log_softmax`: for one 11,600-token micro-batch of a 152k-vocabulary model that is ~7 GB per
fp32 copy, and autograd keeps several. Here the output projection is fused with the softmax
statistics and processed in tiles, so at most one `tile_elements`-sized fp32 tile (plus a few
of its temporaries) exists at a time:

* forward walks over token tiles, keeping per token only the log-sum-exp, the target logit and
  (for the entropy) the expected logit;
* backward walks over vocabulary tiles, recomputing each tile's logits from the saved hidden
  states, so that the weight gradient of a tile is one matmul over all tokens (exact fp32
  accumulation) and the hidden-state gradient is accumulated in one fp32 buffer.

The weight may be a tensor-parallel shard of the vocabulary (Megatron's `output_layer`): the
softmax statistics and the hidden-state gradient are then all-reduced over `group`.

Logits are computed as bf16/fp16 matmuls with fp32 output on CUDA (full fp32 accumulation, no
rounding of the logits to 16 bits), and in fp32 elsewhere.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TILE_ELEMENTS = 1 << 25
"""fp32 elements of one logits tile (128 MiB): big enough for efficient matmuls on an H200."""


def _logits_fp32(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """`a @ b_t.T` with fp32 output, without rounding 16-bit products to 16 bits."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b_t.t(), out_dtype=torch.float32)
    return a.float() @ b_t.float().t()


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` with fp32 output; operands keep their (16-bit) dtype on CUDA."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _all_reduce(t: torch.Tensor, op: Any, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelLogProbs(torch.autograd.Function):
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
        tile_elements: int,
        reduce_hidden_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_tokens = hidden.shape[0]
        v_local = weight.shape[0]
        inv_t = 1.0 / temperature
        lse = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        target_logit = torch.empty_like(lse)
        mean_logit = torch.empty_like(lse)
        local_target = targets - vocab_start
        in_shard = (local_target >= 0) & (local_target < v_local)
        safe_target = torch.where(in_shard, local_target, torch.zeros_like(local_target))
        rows = max(1, tile_elements // max(1, v_local))
        for t0 in range(0, n_tokens, rows):
            t1 = min(n_tokens, t0 + rows)
            z = _logits_fp32(hidden[t0:t1], weight)
            if inv_t != 1.0:
                z.mul_(inv_t)
            zmax = z.amax(dim=-1)
            _all_reduce(zmax, dist.ReduceOp.MAX, group)
            z.sub_(zmax[:, None])
            stats = torch.empty(3, t1 - t0, dtype=torch.float32, device=z.device)
            stats[1] = torch.where(
                in_shard[t0:t1],
                z.gather(1, safe_target[t0:t1, None]).squeeze(1),
                torch.zeros((), dtype=torch.float32, device=z.device),
            )
            if with_entropy:
                e = z.exp()
                stats[2] = (e * z).sum(dim=-1)
                stats[0] = e.sum(dim=-1)
                del e
            else:
                stats[0] = z.exp_().sum(dim=-1)
                stats[2] = 0.0
            del z
            _all_reduce(stats, dist.ReduceOp.SUM, group)
            log_sum = stats[0].log()
            lse[t0:t1] = zmax + log_sum
            target_logit[t0:t1] = stats[1] + zmax
            # E_p[z] with z shifted by zmax: sum(e*z')/sum(e) + zmax.
            mean_logit[t0:t1] = stats[2] / stats[0] + zmax
        logprobs = target_logit - lse
        entropy = lse - mean_logit if with_entropy else torch.zeros_like(lse)
        ctx.save_for_backward(hidden, weight, safe_target, in_shard, lse, mean_logit)
        ctx.inv_t = inv_t
        ctx.with_entropy = with_entropy
        ctx.group = group
        ctx.tile_elements = tile_elements
        ctx.reduce_hidden_grad = reduce_hidden_grad
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, safe_target, in_shard, lse, mean_logit = ctx.saved_tensors
        n_tokens, v_local = hidden.shape[0], weight.shape[0]
        inv_t: float = ctx.inv_t
        zeros = torch.zeros(n_tokens, dtype=torch.float32, device=hidden.device)
        g_lp = zeros if grad_logprobs is None else grad_logprobs.float()
        g_ent = grad_entropy.float() if (ctx.with_entropy and grad_entropy is not None) else None
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty_like(weight)
        cols = max(1, ctx.tile_elements // max(1, n_tokens))
        token_idx = torch.arange(n_tokens, device=hidden.device)
        for v0 in range(0, v_local, cols):
            v1 = min(v_local, v0 + cols)
            z = _logits_fp32(hidden, weight[v0:v1])
            if inv_t != 1.0:
                z.mul_(inv_t)
            p = (z - lse[:, None]).exp_()
            # d logp_target / dz = onehot - p ;  d entropy / dz = -p * (z - E_p[z])
            if g_ent is not None:
                z.sub_(mean_logit[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None])
                g = p.mul_(z).neg_()
            else:
                g = p.mul_(g_lp[:, None]).neg_()
            del z
            # + g_lp at each token's target column, for targets inside this tile (no host sync).
            hit = in_shard & (safe_target >= v0) & (safe_target < v1)
            col = (safe_target - v0).clamp_(0, v1 - v0 - 1)
            g.index_put_((token_idx, col), torch.where(hit, g_lp, 0.0), accumulate=True)
            if inv_t != 1.0:
                g.mul_(inv_t)
            g16 = g.to(hidden.dtype)
            del g
            grad_hidden.add_(_mm_fp32(g16, weight[v0:v1]))
            # One matmul over all tokens: fp32 accumulation, rounded once to the weight dtype.
            torch.mm(g16.t(), hidden, out=grad_weight[v0:v1])
            del g16
        if ctx.reduce_hidden_grad:
            _all_reduce(grad_hidden, dist.ReduceOp.SUM, ctx.group)
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None, None


def _check_args(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [tokens, h] and weight [vocab, h]; got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [{hidden.shape[0]}]; got {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    temperature: float = 1.0,
    with_entropy: bool = False,
    group: dist.ProcessGroup | None = None,
    tile_elements: int = DEFAULT_TILE_ELEMENTS,
    reduce_hidden_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of `targets` (and entropy) under `softmax(hidden @ weight.T / temperature)`.

    hidden: `[tokens, hidden]`; weight: `[local_vocab, hidden]`, this rank's rows
    `[vocab_start, vocab_start + local_vocab)` of the output projection; targets: `[tokens]`
    global token ids. Returns fp32 `[tokens]` log-probs and, when `with_entropy`, entropies.

    Every rank of `group` gets the full hidden-state gradient (summed over the vocabulary
    shards) unless `reduce_hidden_grad` is False: with sequence parallelism the caller's
    all-gather of the hidden states already reduce-scatters that gradient.
    """
    _check_args(hidden, weight, targets, temperature)
    if tile_elements < 1:
        raise ValueError(f"tile_elements must be >= 1; got {tile_elements}")
    logprobs, entropy = _VocabParallelLogProbs.apply(
        hidden,
        weight,
        targets,
        vocab_start,
        temperature,
        with_entropy,
        group,
        tile_elements,
        reduce_hidden_grad,
    )
    return logprobs, (entropy if with_entropy else None)



def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    temperature: float = 1.0,
    with_entropy: bool = False,
    group: dist.ProcessGroup | None = None,
    reduce_hidden_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`vocab_parallel_logprobs`, on CUDA through the fused kernels of
    `rljob.kernels.logprobs_fused`.

    The trainers call this. CUDA tensors take the fused path (same values to fp32 rounding,
    about 3x faster: on Hopper the logits matmul fused with its epilogue, elsewhere cuBLAS
    matmuls with Triton passes); CPU tensors, or a CUDA machine without Triton, take the
    tiled torch function above, which stays the reference.
    """
    _check_args(hidden, weight, targets, temperature)
    if hidden.is_cuda and importlib.util.find_spec("triton") is not None:
        from rljob.kernels.logprobs_fused import fused_logprobs

        return fused_logprobs(
            hidden,
            weight,
            targets,
            vocab_start=vocab_start,
            temperature=temperature,
            with_entropy=with_entropy,
            group=group,
            reduce_hidden_grad=reduce_hidden_grad,
        )
    return vocab_parallel_logprobs(
        hidden,
        weight,
        targets,
        vocab_start=vocab_start,
        temperature=temperature,
        with_entropy=with_entropy,
        group=group,
        reduce_hidden_grad=reduce_hidden_grad,
    )
