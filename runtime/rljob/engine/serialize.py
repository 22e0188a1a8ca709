"""SGLang's tensor wire format for `/update_weights_from_tensor`.

Each string is base64 of a ForkingPickler dump of `list[(name, tensor)]`: CUDA tensors
travel as IPC handles, CPU tensors as shared-memory files (the `file_system` strategy, so
no file descriptors have to be passed between unrelated processes). Only the handles
cross HTTP; the receiver maps the same memory and copies from it.
"""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing

NamedTensors = list[tuple[str, torch.Tensor]]


def serialize(named: NamedTensors) -> str:
    torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize(text: str) -> NamedTensors:
    """The named tensors of one string; the caller must copy them before the sender frees them."""
    torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    value = pickle.loads(base64.b64decode(text))
    if not isinstance(value, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
        for item in value
    ):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return value
