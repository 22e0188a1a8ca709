"""The spec's dtype names as torch dtypes, in a module that imports torch alone: the trainer
and engine processes convert with it without loading any model architecture."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]
