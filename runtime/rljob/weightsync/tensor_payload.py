"""Tensors handed from the sidecar to its engine process without copying their bytes.

The format is SGLang's `serialized_named_tensors`: base64 of `ForkingPickler.dumps(list of
(name, tensor))` with torch's reductions registered, so CUDA tensors travel as CUDA IPC
handles and CPU tensors as shared-memory file names (`file_system` strategy: no file
descriptor passing, which HTTP cannot carry). The receiving process maps the same memory.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Mapping, Sequence
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp

from rljob.weightsync.protocol import nonfinite_names

NamedTensors = list[tuple[str, torch.Tensor]]


def use_file_system_sharing() -> None:
    """Shared CPU tensors must be addressable by name, since HTTP cannot pass descriptors."""
    torch_mp.set_sharing_strategy("file_system")


def encode_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One `serialized_named_tensors` entry; CPU tensors are moved to shared memory first."""
    use_file_system_sharing()
    shared: NamedTensors = []
    for name, tensor in named:
        if tensor.device.type == "cpu" and not tensor.is_shared():
            tensor.share_memory_()
        shared.append((name, tensor))
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(shared)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_named_tensors(entry: str) -> NamedTensors:
    """The inverse of `encode_named_tensors`, run in the engine process."""
    use_file_system_sharing()
    obj = pickle.loads(base64.b64decode(entry))
    if not isinstance(obj, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)
        for item in obj
    ):
        raise ValueError("serialized_named_tensors entry is not a list of (name, tensor)")
    return [(str(name), tensor) for name, tensor in obj]


def update_problems(
    current: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]]
) -> list[str]:
    """Why an update cannot be installed over `current` (empty when it can).

    Checks names, shapes, dtypes and finiteness, so an engine refuses a bad version whole
    and keeps serving the previous one.
    """
    problems: list[str] = []
    fitting: NamedTensors = []
    for name, tensor in named:
        if name not in current:
            problems.append(f"unknown parameter {name}")
            continue
        have = current[name]
        if tuple(have.shape) != tuple(tensor.shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)} != {tuple(have.shape)}")
        elif have.dtype != tensor.dtype:
            problems.append(f"{name}: dtype {tensor.dtype} != {have.dtype}")
        else:
            fitting.append((name, tensor))
    # One fused scan of the whole update: a check per tensor would synchronise per tensor.
    problems += [f"{name}: non-finite values" for name in nonfinite_names(fitting)]
    return problems
