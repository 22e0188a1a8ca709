"""Random-number generator states saved with a checkpoint and restored on resume, so a
resumed run draws what the uninterrupted run would have drawn."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def save(path: Path, *, cuda: bool, **extra: Any) -> None:
    """Python's, NumPy's and torch's states into `path`; with `cuda`, every visible GPU's too
    (asked only then: asking initialises CUDA in the process). `extra` is stored alongside
    (a backend's own generators)."""
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if cuda else [], **extra}, path)


def load(path: Path) -> dict[str, Any]:
    """Restore what `save` wrote (the generators it holds); returns it, `extra` included."""
    state: dict[str, Any] = torch.load(path, weights_only=False)
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if isinstance(cuda, torch.Tensor):  # one GPU's state (`torch.cuda.get_rng_state()`)
        torch.cuda.set_rng_state(cuda)
    elif cuda:
        torch.cuda.set_rng_state_all(cuda)
    return state
