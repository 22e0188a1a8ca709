"""An engine installs a version beside the weights it serves, then switches to it.

Checking a version before copying it in reads its bytes twice (0.6 of the copy rate at
best); checking while copying into the served weights would leave an engine that refuses a
version with neither v-1 nor v. So a version that arrives as one flat buffer (the sidecar's
staging, sent as SGLang's flattened bucket) is copied, with its NaN/Inf check in the same
pass (`rljob.weightsync.checked_copy`), into a new buffer laid out like the one it came
in, and only a finite version is switched to: each parameter becomes a view of that buffer, between
requests. The buffer the parameters leave goes back to the allocator once no parameter
views it (a version that leaves a tensor out keeps its old buffer alive); on a GPU it stays
in torch's cache, where the next version's buffer is found again. The price: the engine
holds its weights twice while a version goes in, and on a GPU keeps that memory reserved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rljob.weightsync.checked_copy import start_copy_checked
from rljob.weightsync.nonfinite import nonfinite_names
from rljob.weightsync.wire import fit_problems, flat_span


@dataclass
class StagedVersion:
    """A version copied and checked beside the served weights: `problems` refuse it (the
    served weights were not touched); without any, `switch` installs it."""

    problems: list[str]
    # Each target with the view of the new buffer it becomes, made while the copy ran.
    views: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def switch(self) -> None:
        """Make every tensor of the version a view of its buffer. Run it where nothing
        computes with them (the engine's lock)."""
        if self.problems:
            raise RuntimeError(f"switch to a refused version: {'; '.join(self.problems)}")
        for target, view in self.views:
            target.data = view


def flat_version(targets: Mapping[str, torch.Tensor],
                 named: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
    """The flat buffer `named` are views of, when they can be staged: one floating dtype,
    and the targets they name on one device (anything else is copied in place)."""
    flat = flat_span(named)
    if flat is None or not flat.is_floating_point():
        return None
    devices = {targets[n].device for n, _ in named if n in targets}
    return flat if len(devices) == 1 else None


def stage_version(targets: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]],
                  flat: torch.Tensor) -> StagedVersion:
    """Copy and check `named` (views of `flat`) into a buffer of their own, for `targets`
    (name -> the tensor the model computes with: its `nn.Parameter`, or a buffer).

    Names, shapes and dtypes are checked first; then the copy starts, and the views the
    switch needs are made while it runs. The verdict waits for the copy, so the sender may
    reuse its buffer once it has the answer.
    """
    problems = fit_problems(targets, named) if named else ["no tensors sent"]
    if problems:
        return StagedVersion(problems)
    buf = torch.empty(flat.numel(), dtype=flat.dtype, device=targets[named[0][0]].device)
    copying = start_copy_checked(flat.reshape(-1), buf)
    base = int(flat.storage_offset())
    views = []
    for name, tensor in named:
        start = int(tensor.storage_offset()) - base
        views.append((targets[name], buf[start:start + tensor.numel()].view(tensor.shape)))
    if not copying.finite():
        # The pass read the padding between tensors too: name the tensors at fault, and go
        # on when none is (a non-finite pattern in the padding only).
        bad = nonfinite_names(named)
        if bad:
            return StagedVersion([f"{name}: non-finite values" for name in bad])
    return StagedVersion([], views)
