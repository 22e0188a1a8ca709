"""The fused log-prob kernels against a float64 full-logits reference, over awkward shapes.

Runs on a CUDA GPU; on a machine without one it runs under Triton's CPU interpreter when
`TRITON_INTERPRET=1` is set (the small shapes only), and skips otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="needs Triton (pip install .[gpu])"
    ),
    pytest.mark.skipif(
        not (HAS_CUDA or INTERPRET),
        reason="needs a CUDA GPU (or TRITON_INTERPRET=1 for Triton's CPU interpreter)",
    ),
]

DEVICE = "cuda" if HAS_CUDA else "cpu"
too_large_for_interpreter = pytest.mark.skipif(
    not HAS_CUDA, reason="too large for Triton's interpreter"
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="the fused path serves CUDA tensors only")


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False


def _tma_runs() -> bool:
    """Whether `rljob.kernels.logprobs_tma` can run on this GPU (Hopper or later, with the shared
    memory its pipeline holds)."""
    if not HAS_CUDA:
        return False
    from rljob.kernels import logprobs_tma

    return logprobs_tma.gpu_fits(torch.device(DEVICE))


@pytest.fixture(params=["tma", "cublas"])
def logits_path(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """Each 16-bit case on both logits paths: the TMA kernels with their epilogues in
    registers (skipped on GPUs that cannot run them) and cuBLAS logits with a Triton pass.
    The test fails if the path it names did not run, forward and backward."""
    import rljob.kernels.logprobs_fused as lf
    from rljob.kernels import logprobs_tma

    tma = request.param == "tma"
    if tma and not _tma_runs():
        pytest.skip("the TMA kernels need a GPU of compute capability 9.0 or later")
    monkeypatch.setattr(lf, "_USE_TMA", tma)
    calls: list[str] = []
    for name in ("stats", "logit_grad"):
        real = getattr(logprobs_tma, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(logprobs_tma, name, spy)
    yield str(request.param)
    if tma:
        assert {"stats", "logit_grad"} <= set(calls), f"the TMA path did not run: {calls}"
    else:
        assert not calls, f"the TMA path ran with _USE_TMA off: {calls}"


def _inputs(
    n: int, v: int, h: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device=DEVICE).to(dtype)
    weight = (torch.randn(v, h, generator=g, device=DEVICE) * (2.0 / h**0.5)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g, device=DEVICE)
    g_lp = torch.randn(n, generator=g, device=DEVICE)
    g_ent = torch.randn(n, generator=g, device=DEVICE)
    return hidden, weight, targets, g_lp, g_ent


def _reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    temperature: float,
    rows: int = 4096,
) -> dict[str, torch.Tensor]:
    """float64 log-probs, entropies and gradients, a block of tokens at a time."""
    hr = hidden.double().requires_grad_(True)
    wr = weight.double().requires_grad_(True)
    lps, ents = [], []
    for s in range(0, hidden.shape[0], rows):
        z = torch.log_softmax(hr[s : s + rows] @ wr.t() / temperature, dim=-1)
        lp = z.gather(1, targets[s : s + rows, None]).squeeze(1)
        ent = -(z.exp() * z).sum(-1)
        loss = (lp * g_lp[s : s + rows].double()).sum()
        if g_ent is not None:
            loss = loss + (ent * g_ent[s : s + rows].double()).sum()
        loss.backward()
        lps.append(lp.detach())
        ents.append(ent.detach())
    assert hr.grad is not None and wr.grad is not None
    return {"lp": torch.cat(lps), "ent": torch.cat(ents), "gh": hr.grad, "gw": wr.grad}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def _assert_16bit_close(
    ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    """16-bit inputs: log-probs at fp32 rounding, entropies near it, and gradients within a
    small multiple of what rounding the exact gradient to `dtype` costs."""
    torch.testing.assert_close(ours["lp"].double(), ref["lp"], atol=5e-5, rtol=0)
    if "ent" in ours:
        torch.testing.assert_close(ours["ent"].double(), ref["ent"], atol=5e-5, rtol=0)
    for key in ("gh", "gw"):
        floor = _rel(ref[key].to(dtype), ref[key])
        assert _rel(ours[key], ref[key]) < 3 * floor + 1e-4, key


def _run(
    n: int,
    v: int,
    h: int,
    *,
    dtype: torch.dtype,
    temperature: float,
    with_entropy: bool,
    chunk_bytes: int | None = None,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from rljob.kernels.logprobs_fused import DEFAULT_CHUNK_BYTES, fused_logprobs

    hidden, weight, targets, g_lp, g_ent = _inputs(n, v, h, dtype, seed)
    hl = hidden.clone().requires_grad_(True)
    wl = weight.clone().requires_grad_(True)
    lp, ent = fused_logprobs(
        hl, wl, targets, temperature=temperature, with_entropy=with_entropy,
        chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES,
    )
    assert lp.dtype == torch.float32 and lp.shape == (n,)
    assert (ent is not None) == with_entropy
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if ent is not None else 0.0)
    loss.backward()
    assert hl.grad is not None and wl.grad is not None
    assert hl.grad.dtype == dtype and wl.grad.dtype == dtype
    ours = {"lp": lp.detach(), "gh": hl.grad, "gw": wl.grad}
    if ent is not None:
        ours["ent"] = ent.detach()
    ref = _reference(hidden, weight, targets, g_lp, g_ent if with_entropy else None, temperature)
    return ours, ref


# (tokens, vocab, hidden, temperature, entropy, chunk bytes): vocabularies that no tile divides,
# hidden sizes over several K tiles of the matmul (200: a ragged last one), one token,
# temperatures either side of 1, chunks so small that the vocabulary takes many
# ragged chunks (the running statistics cross chunk boundaries), and more tokens than the
# kernels' row blocks divide.
SHAPES = [
    (37, 1000, 64, 1.0, True, None),
    (300, 2053, 200, 1.0, True, None),
    (257, 3001, 1024, 0.9, False, None),
    (1, 517, 32, 1.0, True, None),
    (19, 777, 48, 0.7, True, 19 * 4 * 100),
    (23, 1301, 40, 1.3, False, 23 * 6 * 300),
    (300, 2053, 64, 0.9, True, 300 * 6 * 257),
    (1100, 300, 32, 1.0, True, None),
]
IDS = ["v1000", "hidden200-ragged-k", "hidden1024", "one-token", "t0.7-chunks",
       "t1.3-logp-only", "ragged-chunks", "row-groups"]


@pytest.mark.parametrize(("n", "v", "h", "temp", "ent", "chunk"), SHAPES, ids=IDS)
def test_fp32_inputs_match_float64(
    n: int, v: int, h: int, temp: float, ent: bool, chunk: int | None
) -> None:
    """With fp32 inputs nothing is rounded to 16 bits: values and gradients agree with the
    float64 reference to fp32 rounding, which checks the kernels' algebra tightly."""
    ours, ref = _run(n, v, h, dtype=torch.float32, temperature=temp, with_entropy=ent,
                     chunk_bytes=chunk)
    torch.testing.assert_close(ours["lp"].double(), ref["lp"], atol=2e-5, rtol=0)
    if ent:
        torch.testing.assert_close(ours["ent"].double(), ref["ent"], atol=2e-5, rtol=0)
    assert _rel(ours["gh"], ref["gh"]) < 1e-5
    assert _rel(ours["gw"], ref["gw"]) < 1e-5


@pytest.mark.parametrize(("n", "v", "h", "temp", "ent", "chunk"), SHAPES, ids=IDS)
def test_bf16_inputs_match_float64(
    n: int, v: int, h: int, temp: float, ent: bool, chunk: int | None, logits_path: str
) -> None:
    """bf16 inputs, as the trainers pass them: logits stay fp32 (log-prob error at fp32
    rounding); the gradients carry only the 16-bit rounding of the logit gradient and of the
    outputs, within a small multiple of what rounding the exact gradient to bf16 costs."""
    ours, ref = _run(n, v, h, dtype=torch.bfloat16, temperature=temp, with_entropy=ent,
                     chunk_bytes=chunk)
    torch.testing.assert_close(ours["lp"].double(), ref["lp"], atol=2e-5, rtol=0)
    _assert_16bit_close(ours, ref, torch.bfloat16)


@pytest.mark.parametrize(("n", "v", "h", "temp", "ent", "chunk"),
                         [SHAPES[1], SHAPES[3]], ids=[IDS[1], IDS[3]])
def test_fp16_inputs_match_float64(
    n: int, v: int, h: int, temp: float, ent: bool, chunk: int | None, logits_path: str
) -> None:
    """fp16 inputs take the same paths as bf16 ones, with fp16's finer rounding."""
    ours, ref = _run(n, v, h, dtype=torch.float16, temperature=temp, with_entropy=ent,
                     chunk_bytes=chunk)
    torch.testing.assert_close(ours["lp"].double(), ref["lp"], atol=2e-5, rtol=0)
    _assert_16bit_close(ours, ref, torch.float16)


@pytest.mark.parametrize(
    ("split", "parts", "ent"), [(128, 1, True), (256, 4, True), (100, 2, False), (100, 5, True)]
)
def test_statistics_pieces_and_gradient_pieces(
    split: int, parts: int, ent: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Statistics split across programs (pieces not a multiple of the column tile, ragged last
    pieces) and backward chunks filled from several fp32 logit pieces give the same results."""
    import rljob.kernels.logprobs_fused as lf

    monkeypatch.setattr(lf, "_STATS_SPLIT", split)
    monkeypatch.setattr(lf, "_GRAD_Z_PARTS", parts)
    ours, ref = _run(300, 2053, 64, dtype=torch.float32, temperature=0.9, with_entropy=ent,
                     chunk_bytes=300 * 10 * 257)
    torch.testing.assert_close(ours["lp"].double(), ref["lp"], atol=2e-5, rtol=0)
    if ent:
        torch.testing.assert_close(ours["ent"].double(), ref["ent"], atol=2e-5, rtol=0)
    assert _rel(ours["gh"], ref["gh"]) < 1e-5
    assert _rel(ours["gw"], ref["gw"]) < 1e-5


def test_backward_ignores_stale_memory(logits_path: str) -> None:
    """The hidden-gradient accumulator is not zero-filled (the first chunk's matmul overwrites
    it): NaNs left in the memory it reuses must not reach the gradients."""
    n, v, h = 300, 2053, 64
    # Fill the allocator's small blocks (the accumulator is 75 KiB) with NaN and free them, so
    # the run's buffers, the accumulator among them, reuse NaN-filled memory.
    poison = [torch.full((1 << 17,), float("nan"), device=DEVICE) for _ in range(64)]
    del poison
    ours, ref = _run(n, v, h, dtype=torch.bfloat16, temperature=1.0, with_entropy=True,
                     chunk_bytes=n * 10 * 257)
    assert bool(ours["gh"].isfinite().all())
    _assert_16bit_close(ours, ref, torch.bfloat16)


@pytest.mark.parametrize("ent", [True, False])
def test_tma_forward_ranges_merge(ent: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Partial statistics bounded to one tile of columns per launch: the vocabulary takes nine
    launches (the last ragged) whose statistics merge, and the backward's chunks are 8
    columns (narrower than one tile); the TMA path must really run."""
    if not _tma_runs():
        pytest.skip("the TMA kernels need a GPU of compute capability 9.0 or later")
    from rljob.kernels import logprobs_tma

    launches: list[int] = []
    real = logprobs_tma.stats

    def counted(*args: Any, **kwargs: Any) -> Any:
        launches.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(logprobs_tma, "stats", counted)
    n = 300
    ours, ref = _run(n, 2053, 64, dtype=torch.bfloat16, temperature=0.8, with_entropy=ent,
                     chunk_bytes=16 * n)
    assert len(launches) == 9
    torch.testing.assert_close(ours["lp"].double(), ref["lp"], atol=2e-5, rtol=0)
    _assert_16bit_close(ours, ref, torch.bfloat16)


def test_merge_kernel_agrees_with_the_statistics_algebra() -> None:
    """`logprobs_tma.merge_partials` folds per-tile statistics as `logprobs_stats.merge` does
    pairwise (maxima far apart, a tile whose sums underflow beside the others)."""
    if not _tma_runs():
        pytest.skip("the TMA kernels need a GPU of compute capability 9.0 or later")
    from rljob.kernels import logprobs_tma
    from rljob.kernels.logprobs_stats import Stats, merge

    g = torch.Generator(device=DEVICE).manual_seed(3)
    tiles, n = 7, 300
    m = torch.randn(tiles, n, generator=g, device=DEVICE) * 30
    m[3] -= 200.0  # a tile far below the others: its terms vanish
    s = torch.rand(tiles, n, generator=g, device=DEVICE) * 50 + 1
    sz = torch.randn(tiles, n, generator=g, device=DEVICE) * 5
    tz = torch.zeros(tiles, n, device=DEVICE)
    tz[torch.randint(0, tiles, (n,), generator=g, device=DEVICE), torch.arange(n)] = 1.5
    got = logprobs_tma.merge_partials(torch.stack([m, s, sz, tz], dim=1).contiguous())
    want = Stats(m[0], s[0], sz[0], tz[0])
    for j in range(1, tiles):
        want = merge(want, Stats(m[j], s[j], sz[j], tz[j]))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@too_large_for_interpreter
def test_tokens_times_vocab_over_2_pow_31(logits_path: str) -> None:
    """16,500 tokens x 131,075 columns = 2.16e9 logits: no index may wrap at 32 bits."""
    n, v = 16_500, 131_075
    assert n * v > 2**31
    # On the TMA path a chunk of 8 GiB makes the backward's logit gradient one buffer of all
    # 2.16e9 elements, so its offsets pass 2^31 too.
    chunk = 1 << 33 if logits_path == "tma" else None
    ours, ref = _run(n, v, 32, dtype=torch.bfloat16, temperature=1.0, with_entropy=True,
                     chunk_bytes=chunk)
    _assert_16bit_close(ours, ref, torch.bfloat16)


@needs_cuda
def test_trainer_entry_point_takes_the_fused_path() -> None:
    """`token_logprobs` on CUDA tensors runs the fused autograd function."""
    from rljob.kernels.logprobs_vocab_parallel import token_logprobs

    hidden, weight, targets, _, _ = _inputs(8, 300, 16, torch.bfloat16, 1)
    lp, _ = token_logprobs(hidden.requires_grad_(True), weight, targets)
    assert lp.grad_fn is not None and "FusedLogProbs" in type(lp.grad_fn).__name__


@needs_cuda
def test_torch_trainer_on_gpu_takes_the_fused_path() -> None:
    """The torch backend's response log-probs on CUDA run the fused kernels and agree with the
    tiled reference function on the same bf16 model: values, entropies, parameter gradients."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rljob.kernels.logprobs import pad_responses, response_index
    from rljob.kernels.logprobs_vocab_parallel import vocab_parallel_logprobs
    from rljob.trainer.batch import PaddedBatch
    from rljob.trainer.torch.actor import response_logprobs

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=1001, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    torch.nn.Module.to(model, device="cuda", dtype=torch.bfloat16)
    prompts, responses = [5, 3, 7], [9, 12, 4]
    width = max(p + r for p, r in zip(prompts, responses, strict=True))
    ids = torch.randint(0, 1001, (3, width), device="cuda")
    attn = torch.zeros_like(ids)
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        attn[row, : p + r] = 1
    t_max = max(responses)
    batch = PaddedBatch(ids, attn, prompts, responses, torch.ones(3, t_max, device="cuda"),
                        torch.zeros(3, t_max, device="cuda"))
    g_lp = torch.randn(3, t_max, device="cuda")
    g_ent = torch.randn(3, t_max, device="cuda")

    def grads_of(lp: torch.Tensor, ent: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad()
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return [p.grad.float().clone() for p in model.parameters() if p.grad is not None]

    lp, ent = response_logprobs(model, batch, 4, 0.8)
    assert any("FusedLogProbs" in type(f).__name__ for f in _graph(lp.grad_fn))
    fused_grads = grads_of(lp, ent)

    hidden = model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state
    rows, cols = response_index(prompts, responses)
    rows, cols = rows.cuda(), cols.cuda()
    lp_t, ent_t = vocab_parallel_logprobs(
        hidden[rows, cols], model.lm_head.weight, ids[rows, cols + 1], temperature=0.8,
        with_entropy=True,
    )
    assert ent_t is not None
    lp_t, ent_t = pad_responses(lp_t, responses), pad_responses(ent_t, responses)
    torch.testing.assert_close(lp, lp_t, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent, ent_t, atol=5e-5, rtol=0)
    for a, b in zip(fused_grads, grads_of(lp_t, ent_t), strict=True):
        assert float((a - b).norm()) <= 1e-2 * float(b.norm()) + 1e-6


def _graph(fn: Any) -> list[Any]:
    """Every node of an autograd graph from `fn` down."""
    seen: list[Any] = []
    stack = [fn]
    while stack:
        node = stack.pop()
        if node is None or any(node is n for n in seen):
            continue
        seen.append(node)
        stack.extend(f for f, _ in node.next_functions)
    return seen


def _shard_worker(rank: int, world: int, port: int, path: str, dtype_name: str,
                  tma: bool) -> None:
    try:
        import rljob.kernels.logprobs_fused as lf
        from rljob.kernels import logprobs_tma
        from rljob.kernels.logprobs_fused import fused_logprobs

        lf._USE_TMA = tma
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # gloo reduces CUDA tensors too: two ranks can share the one GPU.
        dist.init_process_group("gloo", rank=rank, world_size=world)
        hidden, weight, targets, g_lp, g_ent = _inputs(29, 1003, 40, getattr(torch, dtype_name),
                                                       5)
        # Uneven shards, as when padding rows are cut from the last one.
        bounds = [0, 611, 1003]
        lo, hi = bounds[rank], bounds[rank + 1]
        h = hidden.clone().requires_grad_(True)
        w = weight[lo:hi].clone().requires_grad_(True)
        if tma:
            assert logprobs_tma.usable(h, w), "the TMA path would not run"
        lp, ent = fused_logprobs(
            h, w, targets, vocab_start=lo, temperature=0.8, with_entropy=True,
            group=dist.group.WORLD, chunk_bytes=29 * 6 * 200,
        )
        assert ent is not None
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        assert h.grad is not None and w.grad is not None
        torch.save(
            {"lp": lp.detach().cpu(), "ent": ent.detach().cpu(), "gh": h.grad.cpu(),
             "gw": w.grad.cpu()},
            f"{path}.{rank}",
        )
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.parametrize(("dtype_name", "path_name"),
                         [("float32", "cublas"), ("bfloat16", "cublas"), ("bfloat16", "tma")])
def test_vocab_shards_over_two_ranks_match_float64(
    tmp_path: Any, dtype_name: str, path_name: str
) -> None:
    """Two ranks, each holding an uneven vocabulary shard (the second starting at 611, so
    its local targets run negative), on each path; fp32 to fp32 rounding, bf16 within its
    rounding floor."""
    tma = path_name == "tma"
    if tma and not _tma_runs():
        pytest.skip("the TMA kernels need a GPU of compute capability 9.0 or later")
    path = str(tmp_path / "out")
    mp.start_processes(  # type: ignore[attr-defined, no-untyped-call]
        _shard_worker, args=(2, _free_port(), path, dtype_name, tma), nprocs=2,
        start_method="spawn"
    )
    dtype = getattr(torch, dtype_name)
    hidden, weight, targets, g_lp, g_ent = _inputs(29, 1003, 40, dtype, 5)
    ref = _reference(hidden, weight, targets, g_lp, g_ent, 0.8)
    outs = [torch.load(f"{path}.{r}") for r in range(2)]
    exact = dtype == torch.float32
    for out in outs:
        torch.testing.assert_close(out["lp"].double(), ref["lp"].cpu(), atol=2e-5, rtol=0)
        torch.testing.assert_close(out["ent"].double(), ref["ent"].cpu(),
                                   atol=2e-5 if exact else 5e-5, rtol=0)
    for key, got in (("gh", outs[0]["gh"]), ("gh", outs[1]["gh"]),
                     ("gw", torch.cat([o["gw"] for o in outs]))):
        want = ref[key].cpu()
        bound = 1e-5 if exact else 3 * _rel(want.to(dtype), want) + 1e-4
        assert _rel(got, want) < bound, key
