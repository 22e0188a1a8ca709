"""On a real GPU: the non-finite screen of a staged version, and memory given back by
offloading.

- `nonfinite_names` over views of one staging buffer screens the buffer as one span and
  names exactly the tensors holding NaN/Inf, in every 16/32-bit float format, a NaN in the
  padding refusing nothing.
- `Offload` frees what it moves (torch's allocated bytes drop by that much and the driver
  gets it back) and restores it bit for bit; the `hf` engine's release/resume does the same
  for its weights.

Skips (with the reason) where there is no CUDA GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rljob.engine.hf_server import HFEngine
from rljob.model.offload import Offload, device_bytes, module_tensors, optimizer_tensors
from rljob.model.tiny_model import write_tiny
from rljob.weightsync.nonfinite import nonfinite_names
from rljob.weightsync.protocol import plan_buckets, unpack_bucket
from rljob_api.spec import TinyModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_span_screen_names_exactly_the_non_finite_tensors(dtype: torch.dtype) -> None:
    shapes = [(1000, 37), (3,), (513, 1025), (7, 7)]
    plan = plan_buckets([(f"t{i}", torch.empty(s, dtype=dtype)) for i, s in enumerate(shapes)],
                        1 << 30)
    buf = torch.zeros(plan[0].nbytes, dtype=torch.uint8, device="cuda")
    views = unpack_bucket(plan[0], buf)
    for _, t in views:
        t.copy_(torch.randn(t.shape, device="cuda").to(dtype))
    assert nonfinite_names(views) == []
    buf.view(dtype)[37000] = float("nan")  # padding after t0 (37,000 values)
    assert nonfinite_names(views) == []
    views[2][1][512, 1024] = float("inf")
    views[3][1][0, 0] = float("nan")
    assert nonfinite_names(views) == ["t2", "t3"]


def test_offloaded_memory_is_given_back_and_comes_back_the_same() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    opt.step()
    held = [*module_tensors([model]), *optimizer_tensors([opt])]
    saved = [t.detach().clone().cpu() for t in held]
    torch.cuda.synchronize()
    before, (free_before, _) = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()
    moves = Offload("cuda")
    moved = moves.offload(held)
    assert device_bytes(held, "cuda") == 0  # nothing of it left on the GPU
    assert moved >= 4 * 4096 * 4096 * 4  # weight, its gradient, two Adam moments
    assert before - torch.cuda.memory_allocated() >= moved  # blocks round up to 512 bytes
    # Back to the driver (small tensors share 2 MB segments that may stay cached).
    assert torch.cuda.mem_get_info()[0] - free_before >= 0.9 * moved
    assert moves.reload() == moved
    assert all(torch.equal(t.cpu(), s) for t, s in zip(held, saved, strict=True))


def test_the_hf_engine_releases_its_weights_on_the_gpu(tmp_path: Path) -> None:
    model = write_tiny(tmp_path / "m", TinyModel(hidden_size=512, num_layers=4,
                                                 intermediate_size=2048),
                       "0123456789+=", 1, "bfloat16")
    engine = HFEngine(str(model), "bfloat16", "cuda", "0")
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    on_gpu = device_bytes(module_tensors([engine.model]))
    before = torch.cuda.memory_allocated()
    assert engine.release_memory() == on_gpu > 0
    assert before - torch.cuda.memory_allocated() >= on_gpu
    assert engine.resume_memory() == on_gpu
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in weights.items())
