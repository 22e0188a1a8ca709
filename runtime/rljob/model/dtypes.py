"""The spec's dtype names as torch dtypes, in a module that imports torch alone: the torch
trainer's module, which the driver imports to create its actor, converts with it without
loading transformers' model classes."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """`spec.model.dtype` as torch's dtype (the API model allows these names alone)."""
    return _DTYPES[name]
