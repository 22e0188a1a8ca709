"""How far the `hf` engine's running generation has got, watched from outside the engine.

Tests that must act while a generation is surely mid-way (an abort, a partial rollout's
cut) need its progress. The engine keeps no such counter for them: a forward hook on its
real model counts the decoding steps (each feeds back one sampled token per row), and its
`generate` method is wrapped so the count starts at 0 with every generation and goes back
to 0 when one returns.
"""

from __future__ import annotations

from typing import Any

import torch

from rljob.engine.hf_server import HFEngine


class GenerationProgress:
    """`tokens`: tokens per row the engine's running generation has produced (0 while none
    runs). Attach once per engine; the hook and the wrapper stay for the engine's life."""

    def __init__(self, engine: HFEngine) -> None:
        self.tokens = 0
        self._running = False
        engine.model.register_forward_hook(self._forward, with_kwargs=True)
        inner = engine.generate

        def generate(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
            self.tokens, self._running = 0, True
            try:
                return inner(*args, **kwargs)
            finally:
                self.tokens, self._running = 0, False

        # An instance attribute: the server looks `engine.generate` up on every request.
        setattr(engine, "generate", generate)  # noqa: B010

    def _forward(self, _module: torch.nn.Module, args: tuple[Any, ...], kwargs: Any,
                 _output: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        # A prefill reads the whole prompt; a decoding step reads the one token just sampled.
        if self._running and isinstance(ids, torch.Tensor) and ids.shape[1] == 1:
            self.tokens += 1
