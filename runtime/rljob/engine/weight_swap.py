"""An engine installs a version beside the weights it serves, then switches to it.

Checking a version before copying it in reads its bytes twice (0.6 of the copy rate at
best); checking while copying into the served weights would leave an engine that refuses a
version with neither v-1 nor v. So a version that arrives as one flat buffer (the sidecar's
staging, sent as SGLang's flattened bucket) is copied, with its NaN/Inf check in the same
pass (`rljob.checked_copy`), into a new buffer laid out like the one it came in, and only a
finite version is switched to: each parameter becomes a view of that buffer, between
requests. The buffer the parameters leave goes back to the allocator (on a GPU, torch's
cache, where the next version's buffer is found again). The price: while a version is
installed the engine holds its weights twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rljob.checked_copy import start_copy_checked
from rljob.engine.tensor_payload import fit_problems, flat_span
from rljob.nonfinite import nonfinite_names


@dataclass
class _Staged:
    # Each target with the view of the new buffer it becomes, made while the copy ran.
    views: list[tuple[torch.Tensor, torch.Tensor]]


class WeightSwap:
    """Installs flat versions into `targets` (name -> the tensor the model computes with:
    its `nn.Parameter`, or a buffer) by copy-and-check into a new buffer, then a switch.

    `stage` does the copy and the check without touching the served weights; `switch`
    repoints the targets and must run where nothing computes with them (the engine's lock).
    """

    def __init__(self, targets: Mapping[str, torch.Tensor]) -> None:
        self._targets = targets
        self._staged: _Staged | None = None

    def flat_of(self, named: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
        """The flat buffer `named` are views of, when this swap can install them: one dtype,
        every name a target on one device in that dtype (anything else is copied in place)."""
        flat = flat_span(named)
        if flat is None or not flat.is_floating_point():
            return None
        devices = {self._targets[n].device for n, _ in named if n in self._targets}
        return flat if len(devices) == 1 else None

    def stage(self, named: Sequence[tuple[str, torch.Tensor]], flat: torch.Tensor) -> list[str]:
        """Copy and check `named` (views of `flat`) into a buffer of their own; the problems
        that refuse the version (empty: `switch` installs it). The served weights are not
        touched either way.

        The copy starts first: the new buffer is not served, so what the host checks next
        (names, shapes, dtypes) and the views it prepares for the switch run beside it.
        """
        self._staged = None
        target = self._targets.get(named[0][0]) if named else None
        buf = torch.empty(flat.numel(), dtype=flat.dtype,
                          device=flat.device if target is None else target.device)
        copying = start_copy_checked(flat.reshape(-1), buf)
        problems = fit_problems(self._targets, named)
        if problems:
            return problems
        base = int(flat.storage_offset())
        views = []
        for name, tensor in named:
            start = int(tensor.storage_offset()) - base
            views.append((self._targets[name],
                          buf[start:start + tensor.numel()].view(tensor.shape)))
        if not copying.finite():
            # The pass read the padding between tensors too: name the tensors at fault, and
            # go on when none is (a non-finite pattern in the padding only).
            bad = nonfinite_names(named)
            if bad:
                return [f"{name}: non-finite values" for name in bad]
        self._staged = _Staged(views)
        return []

    def switch(self) -> None:
        """Make every tensor of the staged version a view of its buffer."""
        staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError("switch without a staged version")
        for target, view in staged.views:
            target.data = view
