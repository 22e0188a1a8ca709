"""Chunked response-only log-probs equal the naive full-vocabulary computation."""

from __future__ import annotations

import pytest
import torch

from rljob.kernels.logprobs import chunked_logprobs, naive_logprobs, pad_responses, response_index

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_naive_values_and_gradients(chunk: int, temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (23,), generator=g)

    logp, entropy = chunked_logprobs(hidden, weight, targets, chunk_tokens=chunk,
                                     temperature=temperature)
    (logp.sum() + entropy.sum()).backward()
    grads = hidden.grad.clone(), weight.grad.clone()  # type: ignore[union-attr]
    hidden.grad = weight.grad = None

    logits = hidden @ weight.T
    ref = naive_logprobs(logits, targets, temperature)
    probs = torch.softmax(logits / temperature, -1)
    ref_entropy = -(probs * torch.log_softmax(logits / temperature, -1)).sum(-1)
    (ref.sum() + ref_entropy.sum()).backward()

    assert torch.allclose(logp.double(), ref.double(), atol=1e-6)
    assert torch.allclose(entropy.double(), ref_entropy.double(), atol=1e-6)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-6)  # type: ignore[arg-type]
    assert torch.allclose(grads[1], weight.grad, atol=1e-6)  # type: ignore[arg-type]


def test_response_index_points_at_positions_predicting_response_tokens() -> None:
    rows, cols = response_index([3, 2], [2, 3])
    assert rows.tolist() == [0, 0, 1, 1, 1]
    # sample 0: prompt is tokens 0..2, response tokens 3, 4 are predicted at 2, 3
    assert cols.tolist() == [2, 3, 1, 2, 3]


def test_pad_responses_places_each_response_in_its_row() -> None:
    out = pad_responses(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), [2, 3])
    assert out.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]


def test_only_a_chunk_of_logits_is_ever_materialised() -> None:
    """The largest float tensor built is [chunk × vocab], not [tokens × vocab]."""
    sizes: list[int] = []
    original = torch.nn.functional.linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = original(x, w, b)
        sizes.append(out.numel())
        return out

    hidden = torch.randn(100, 8)
    weight = torch.randn(30, 8)
    torch.nn.functional.linear = spy  # type: ignore[assignment]
    try:
        chunked_logprobs(hidden, weight, torch.zeros(100, dtype=torch.long), chunk_tokens=10)
    finally:
        torch.nn.functional.linear = original
    assert sizes and max(sizes) == 10 * 30
