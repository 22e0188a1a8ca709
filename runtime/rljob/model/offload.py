"""Moving what a process holds on its GPU to host memory and back, in place.

Colocated trainer and engines take turns on one GPU: during rollout the trainer's parameters,
gradients and optimizer state leave it, during training the engine's weights do. Each tensor's
storage is copied to pinned host memory and shrunk to nothing (`resize_(0)`), and on the way
back grown and filled again. The storage objects stay the same, so every view of them (a
parameter inside Megatron's contiguous buffer, an optimizer state keyed by its parameter, a
gradient bucket) is valid again without being told: nothing has to rebuild its references.
Touching an offloaded tensor fails loudly (its storage holds no bytes), never silently.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor


def module_tensors(modules: Iterable[torch.nn.Module | None]) -> Iterator[Tensor]:
    """Parameters, their gradients (also Megatron's `main_grad`) and buffers of `modules`,
    and the contiguous parameter and gradient buffers of Megatron's DDP wrapper."""
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            yield p
            for grad in (p.grad, getattr(p, "main_grad", None)):
                if isinstance(grad, Tensor):
                    yield grad
        # named_buffers: Megatron's DDP wrapper shadows `buffers()` with its list of
        # contiguous parameter/gradient buffers, read below.
        yield from (b for _, b in module.named_buffers())
        for group in ("buffers", "expert_parallel_buffers"):
            held = getattr(module, group, None)
            if isinstance(held, list):
                for b in held:
                    for name in ("param_data", "grad_data"):
                        t = getattr(b, name, None)
                        if isinstance(t, Tensor):
                            yield t


def optimizer_tensors(optimizers: Iterable[Any]) -> Iterator[Tensor]:
    """Every tensor of an optimizer's state and parameter groups: a torch optimizer, or
    Megatron's wrappers around one (`.optimizer`, `.chained_optimizers`), whose fp32 main
    parameters are the inner optimizer's parameters."""
    for opt in optimizers:
        if opt is None:
            continue
        chained = getattr(opt, "chained_optimizers", None)
        if chained:
            yield from optimizer_tensors(chained)
            continue
        inner = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, Tensor))
        for group in inner.param_groups:
            for p in group["params"]:
                yield p
                if isinstance(p.grad, Tensor):
                    yield p.grad


def _storages(tensors: Iterable[Tensor], device_type: str) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type != device_type:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _movable(storage: torch.UntypedStorage) -> bool:
    # Memory torch allocated itself; a file mapping (weights loaded on the CPU) is not.
    return bool(storage.resizable())


def device_bytes(tensors: Iterable[Tensor], device_type: str = "cuda") -> int:
    """Bytes of the distinct storages of `tensors` that are on `device_type` now."""
    return sum(s.nbytes() for s in _storages(tensors, device_type))


class Offload:
    """Offloads a set of tensors' storages to host memory, and brings them back.

    `device_type` is "cuda" in use; tests give "cpu" to exercise the same moves without a
    GPU (the "host" copy is then ordinary memory).
    """

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self._held: list[tuple[torch.UntypedStorage, Tensor]] = []
        # Host buffers of the last turn, by size, for the next: pinning fresh host memory
        # every turn costs more than the copy. The price is host memory the size of what
        # was offloaded, kept while the tensors are back on the device.
        self._spare: dict[int, list[Tensor]] = {}
        self.offloaded = False

    def _host(self, nbytes: int, pin: bool) -> Tensor:
        spare = self._spare.get(nbytes)
        if spare:
            return spare.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def offload(self, tensors: Iterable[Tensor]) -> int:
        """Move the storages of `tensors` off the device; returns the bytes moved (storages
        torch cannot resize, such as a file mapping on the CPU, stay)."""
        if self.offloaded:
            return 0
        self.offloaded = True
        pin = self.device_type == "cuda"
        for storage in filter(_movable, _storages(tensors, self.device_type)):
            host = self._host(storage.nbytes(), pin)
            host.untyped_storage().copy_(storage, non_blocking=pin)
            self._held.append((storage, host))
        if pin and self._held:
            torch.cuda.synchronize()  # the copies must land before the memory goes
        for storage, _ in self._held:
            storage.resize_(0)
        if pin and self._held:
            torch.cuda.empty_cache()  # back to the driver, so the other process can have it
        return sum(host.numel() for _, host in self._held)

    def reload(self) -> int:
        """Bring every offloaded storage back, same objects, same bytes; returns the bytes."""
        moved = 0
        for storage, host in self._held:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=self.device_type == "cuda")
            moved += host.numel()
        if self._held and self.device_type == "cuda":
            torch.cuda.synchronize()
        self._spare = {}
        for _, host in self._held:
            self._spare.setdefault(host.numel(), []).append(host)
        self._held = []
        self.offloaded = False
        return moved


class TakesTurns(ABC):
    """A trainer's side of sharing its GPU with engines (colocated placement).

    The driver calls `offload()` before each rollout; the trainer's own methods that need
    its tensors call `on_device()` first, so it comes back on first use (training, saving,
    publishing) and nothing can read an emptied tensor.
    """

    _turns: Offload | None = None

    @abstractmethod
    def _held_tensors(self) -> Iterator[Tensor]:
        """Everything the trainer keeps on its GPU: models, gradients, optimizer state."""

    def _offloader(self) -> Offload:
        if self._turns is None:
            self._turns = Offload("cuda")
        return self._turns

    def offload(self) -> int:
        """Parameters, gradients and optimizer state to host memory; returns the bytes."""
        return self._offloader().offload(self._held_tensors())

    def on_device(self) -> int:
        """Back on the GPU if offloaded; returns the bytes moved (0 when already there)."""
        return self._offloader().reload()

    def gpu_bytes(self) -> int:
        """What the trainer's tensors take on the GPU now (0 while offloaded)."""
        return device_bytes(self._held_tensors(), self._offloader().device_type)
