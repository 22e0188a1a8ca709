"""Log-probs and entropy of response tokens only, computed a chunk of tokens at a time.

The logits of a long batch are the largest tensor in RL training ([tokens × vocab] in
fp32, ~11 GB for 12k tokens of a 250k vocabulary). Here only the hidden states of
positions that predict a response token are projected, `chunk_tokens` rows at a time, and
each chunk is recomputed in the backward pass instead of kept, so peak memory is one
[chunk × vocab] block however long the batch is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _chunk(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    probs = torch.softmax(logits, dim=-1)
    entropy = lse - (probs * logits).sum(-1)
    return logp, entropy


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob of `targets` [N] and entropy [N] from `hidden` [N, H] and `weight` [V, H]."""
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    logps: list[Tensor] = []
    entropies: list[Tensor] = []
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        t = targets[start : start + chunk_tokens]
        if needs_grad:
            out = checkpoint(_chunk, h, weight, bias, t, temperature, use_reentrant=False)
            logp, ent = out[0], out[1]
        else:
            logp, ent = _chunk(h, weight, bias, t, temperature)
        logps.append(logp)
        entropies.append(ent)
    return torch.cat(logps), torch.cat(entropies)


def response_index(prompt_lengths: list[int], response_lengths: list[int]) -> tuple[Tensor, Tensor]:
    """(row, position) of every hidden state that predicts a response token, row-major.

    Position `p` predicts token `p + 1`, so response token `t` of a sample whose prompt
    has `P` tokens is predicted at position `P - 1 + t`.
    """
    rows: list[int] = []
    cols: list[int] = []
    for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        rows += [row] * r
        cols += range(p - 1, p - 1 + r)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)


def pad_responses(flat: Tensor, response_lengths: list[int]) -> Tensor:
    """[sum R] values → [B, max R], zero after each response's end (mask it)."""
    width = max(response_lengths, default=0)
    out = flat.new_zeros(len(response_lengths), width)
    offset = 0
    for row, r in enumerate(response_lengths):
        out[row, :r] = flat[offset : offset + r]
        offset += r
    return out


def naive_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """The full-vocabulary reference computation the chunked path must match (tests)."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(
        -1, targets.unsqueeze(-1)
    ).squeeze(-1)
