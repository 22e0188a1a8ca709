"""The tiled log-prob function against the plain full-logits computation in float64."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rljob.kernels.logprobs_vocab_parallel import vocab_parallel_logprobs

pytestmark = pytest.mark.unit


def _reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hidden.double() @ weight.double().t() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy


def _inputs(n: int, v: int, h: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.3
    targets = torch.randint(0, v, (n,), generator=g)
    g_lp = torch.randn(n, generator=g)
    g_ent = torch.randn(n, generator=g)
    return hidden, weight, targets, g_lp, g_ent


@pytest.mark.parametrize(
    ("tile", "temperature"), [(7, 1.0), (64, 0.7), (10_000, 1.3)], ids=["tiny", "t0.7", "one"]
)
def test_values_and_gradients_match_full_logits(tile: int, temperature: float) -> None:
    hidden, weight, targets, g_lp, g_ent = _inputs(n=13, v=37, h=8, seed=tile)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(
        h, w, targets, temperature=temperature, with_entropy=True, tile_elements=tile
    )
    assert ent is not None
    torch.autograd.backward((lp * g_lp).sum() + (ent * g_ent).sum())

    hr = hidden.double().requires_grad_(True)
    wr = weight.double().requires_grad_(True)
    lp_ref, ent_ref = _reference(hr, wr, targets, temperature)
    torch.autograd.backward(
        (lp_ref * g_lp.double()).sum() + (ent_ref * g_ent.double()).sum()
    )

    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), lp_ref.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ent_ref.detach(), atol=2e-5, rtol=0)
    assert h.grad is not None and w.grad is not None
    torch.testing.assert_close(h.grad.double(), hr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad.double(), wr.grad, atol=1e-4, rtol=1e-4)


def test_logprobs_only_gradients() -> None:
    hidden, weight, targets, g_lp, _ = _inputs(n=9, v=21, h=5, seed=3)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(h, w, targets, tile_elements=20)
    assert ent is None
    torch.autograd.backward((lp * g_lp).sum())
    hr = hidden.double().requires_grad_(True)
    wr = weight.double().requires_grad_(True)
    lp_ref, _ = _reference(hr, wr, targets, 1.0)
    torch.autograd.backward((lp_ref * g_lp.double()).sum())
    assert h.grad is not None and w.grad is not None
    torch.testing.assert_close(h.grad.double(), hr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad.double(), wr.grad, atol=1e-4, rtol=1e-4)


def test_bad_shapes_name_the_argument() -> None:
    with pytest.raises(ValueError, match="targets must be"):
        vocab_parallel_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2).long())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vocab_parallel_logprobs(
            torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3).long(), temperature=0.0
        )


def _shard_worker(rank: int, world: int, port: int, path: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        hidden, weight, targets, g_lp, g_ent = _inputs(n=10, v=30, h=6, seed=11)
        shard = weight.shape[0] // world
        h = hidden.clone().requires_grad_(True)
        w = weight[rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(
            h,
            w,
            targets,
            vocab_start=rank * shard,
            with_entropy=True,
            group=dist.group.WORLD,
            tile_elements=17,
        )
        assert ent is not None
        torch.autograd.backward((lp * g_lp).sum() + (ent * g_ent).sum())
        assert h.grad is not None and w.grad is not None
        torch.save(
            {"lp": lp.detach(), "ent": ent.detach(), "gh": h.grad, "gw": w.grad},
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


def test_vocab_sharded_over_two_ranks_matches_full(tmp_path: Any) -> None:
    world = 2
    path = str(tmp_path / "out")
    # torch's stubs neither export nor type start_processes.
    mp.start_processes(  # type: ignore[attr-defined, no-untyped-call]
        _shard_worker, args=(world, _free_port(), path), nprocs=world, start_method="spawn"
    )
    hidden, weight, targets, g_lp, g_ent = _inputs(n=10, v=30, h=6, seed=11)
    hr = hidden.double().requires_grad_(True)
    wr = weight.double().requires_grad_(True)
    lp_ref, ent_ref = _reference(hr, wr, targets, 1.0)
    torch.autograd.backward(
        (lp_ref * g_lp.double()).sum() + (ent_ref * g_ent.double()).sum()
    )
    outs = [torch.load(f"{path}.{r}") for r in range(world)]
    assert wr.grad is not None and hr.grad is not None
    for out in outs:
        torch.testing.assert_close(out["lp"].double(), lp_ref.detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(out["ent"].double(), ent_ref.detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(out["gh"].double(), hr.grad, atol=1e-4, rtol=1e-4)
    gw = torch.cat([o["gw"] for o in outs]).double()
    torch.testing.assert_close(gw, wr.grad, atol=1e-4, rtol=1e-4)
