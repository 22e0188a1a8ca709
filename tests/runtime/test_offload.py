"""Trainer and engine give their memory back and take it again, in place (colocated turns).

On the CPU (`Offload("cpu")`) the moves are the GPU's: storages shrunk to nothing and
refilled; the GPU figures come from benchmarks/colocated_memory_gpu.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rljob.engine.client import EngineClient, EngineError
from rljob.engine.hf_server import HFEngine, ServerThread
from rljob.model.offload import Offload, TakesTurns, device_bytes, module_tensors, optimizer_tensors
from rljob.model.tiny_model import write_tiny
from rljob_api.spec import TinyModel

pytestmark = pytest.mark.runtime


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=False)  # gradients kept: they must survive the moves too
    model(x).square().sum().backward()
    opt.step()


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(5, 8)
    _step(model, opt, x)
    return model, opt, x


def test_offload_empties_every_storage_and_brings_the_same_objects_back() -> None:
    """Parameters, gradients and Adam state leave and come back bit for bit, as the same
    objects: training goes on exactly as without the round trip."""
    model, opt, x = _trained()
    twin, twin_opt, _ = _trained()
    params = list(model.parameters())
    held = [*module_tensors([model]), *optimizer_tensors([opt])]
    before = device_bytes(held, "cpu")
    moves = Offload("cpu")
    assert moves.offload(held) == before > 0
    assert device_bytes(held, "cpu") == 0 and moves.offloaded
    assert all(t.untyped_storage().nbytes() == 0 for t in held)
    with pytest.raises(RuntimeError):
        model(x)  # an offloaded tensor fails loudly, never reads stale memory
    assert moves.reload() == before and not moves.offloaded
    assert list(model.parameters()) == params  # same Parameter objects: optimizer keys hold
    for a, b in zip([*module_tensors([model]), *optimizer_tensors([opt])],
                    [*module_tensors([twin]), *optimizer_tensors([twin_opt])], strict=True):
        assert torch.equal(a, b)
    _step(model, opt, x)
    _step(twin, twin_opt, x)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(),
                                                  strict=True))


def test_a_trainer_comes_back_on_first_use() -> None:
    class Trainer(TakesTurns):
        def __init__(self) -> None:
            self.model = torch.nn.Linear(4, 4)
            self._turns = Offload("cpu")

        def _held_tensors(self) -> Iterator[torch.Tensor]:
            yield from module_tensors([self.model])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.on_device()
            out: torch.Tensor = self.model(x)
            return out

    trainer = Trainer()
    x = torch.ones(1, 4)
    want = trainer.forward(x)
    size = trainer.gpu_bytes()
    assert trainer.offload() == size > 0 and trainer.gpu_bytes() == 0
    assert torch.equal(trainer.forward(x), want) and trainer.gpu_bytes() == size


def test_an_hf_engine_releases_its_memory_and_serves_the_same_after(tmp_path: Path) -> None:
    """SGLang's release/resume endpoints on the hf engine: while released it refuses to
    generate, install or read weights (never serves emptied tensors); after resuming it
    generates exactly what it did before."""
    model = write_tiny(tmp_path / "m", TinyModel(), "0123456789+=", 1, "float32")
    engine = HFEngine(str(model), "float32", "cpu", "0")
    # As on a GPU: weights in memory torch allocated (loaded on the CPU, they are mapped).
    engine.model.load_state_dict({k: v.clone() for k, v in engine.model.state_dict().items()},
                                 assign=True)
    srv = ServerThread(engine)
    params = {"max_new_tokens": 5, "sampling_seed": 3, "temperature": 1.0}
    http = EngineClient(srv.url)

    async def generate() -> dict[str, object]:
        async with EngineClient(srv.url) as c:
            return await c.generate([4, 5, 6], params)

    try:
        before = asyncio.run(generate())
        weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
        http.release_memory(60)
        assert device_bytes(module_tensors([engine.model]), "cpu") == 0
        with pytest.raises(EngineError, match="memory is released"):
            asyncio.run(generate())
        with pytest.raises(RuntimeError, match="memory is released"):
            engine.install(list(weights.items()), "1")
        http.resume_memory(60)
        assert asyncio.run(generate()) == before
        assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in weights.items())
    finally:
        srv.stop()


def test_the_next_turn_reuses_the_host_buffers_of_the_last() -> None:
    """Pinning host memory costs more than the copy: the second offload writes into the
    host buffers of the first."""
    model, opt, x = _trained()
    moves = Offload("cpu")
    moves.offload([*module_tensors([model]), *optimizer_tensors([opt])])
    first = {host.data_ptr() for _, host in moves._held}
    moves.reload()
    moves.offload([*module_tensors([model]), *optimizer_tensors([opt])])
    assert {host.data_ptr() for _, host in moves._held} == first
    moves.reload()
    _step(model, opt, x)  # still trains after two round trips
