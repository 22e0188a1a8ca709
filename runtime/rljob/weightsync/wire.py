"""Tensors handed from the sidecar to its engine process without copying their bytes.

The format is SGLang's `serialized_named_tensors`: base64 of `ForkingPickler.dumps(...)` with
torch's reductions registered, so CUDA tensors travel as CUDA IPC handles and CPU tensors as
shared-memory file names (`file_system` strategy: no file descriptor passing, which HTTP
cannot carry). The receiving process maps the same memory. A CUDA tensor's GPU is named by
its UUID, not by the sender's device index, so a receiver that numbers its GPUs otherwise
(another CUDA_VISIBLE_DEVICES, another container's allocation) opens it on the right one.
An entry holds either a list of (name, tensor), or, with `load_format: "flattened_bucket"`
(SGLang's, since 0.4.10), a dict of one flat tensor and the name, shape, dtype and element
range of every tensor in it: one handle to share and open instead of one a tensor, which is
what a version costs to hand over.
"""

from __future__ import annotations

import base64
import functools
import io
import os
import pickle
from collections.abc import Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as torch_mp
import torch.multiprocessing.reductions as torch_reductions

from rljob.weightsync.nonfinite import SCREEN_ALONE, nonfinite_names
from rljob.weightsync.protocol import gpu_uuid

NamedTensors = list[tuple[str, torch.Tensor]]

# SGLang's `load_format` for one flat tensor plus the layout of the tensors inside it.
FLATTENED = "flattened_bucket"


def use_file_system_sharing() -> None:
    """Shared CPU tensors must be addressable by name, since HTTP cannot pass descriptors."""
    torch_mp.set_sharing_strategy("file_system")


SHARED_MEMORY = Path("/dev/shm")
MIB = 1 << 20


def shared_memory_fits(nbytes: int, where: Path = SHARED_MEMORY) -> None:
    """Refuse, naming the sizes, a CPU staging that `where` cannot hold. Shared CPU tensors
    live there as files whose pages are only taken when written: past a pod's /dev/shm limit
    the write is a SIGBUS that kills the sidecar, where this is a refusal of one version that
    says why (the staging buffers it replaces were freed first)."""
    try:
        free = os.statvfs(where)
    except OSError:
        return  # no such file system here: torch's own error, if any, will say so
    room = free.f_bavail * free.f_frsize
    if nbytes > room:
        raise ValueError(
            f"a weight version of {nbytes / MIB:.0f} MiB does not fit {where} "
            f"({room / MIB:.0f} MiB free): a sidecar staging on the CPU holds the whole "
            "version there; give the engine's pod GPUs (versions then stage on the GPU) or "
            "train a smaller model")


# Position of the device index among the arguments torch's `reduce_tensor` gives
# `rebuild_cuda_tensor` (tensor class, size, stride, offset, storage class, dtype, device, ...).
_CUDA_DEVICE_ARG = 6


@functools.cache
def _gpu_uuids() -> tuple[str, ...]:
    """The UUID of each GPU this process sees, by its device index here, written as SGLang
    writes it in a handle (`str` of torch's device-properties UUID)."""
    return tuple(gpu_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count()))


def device_index(device: int | str, uuids: Sequence[str]) -> int:
    """This process's index of the GPU a handle names: an index as it is, a UUID as the
    index of that GPU among `uuids` (the GPUs this process sees, in its numbering)."""
    if isinstance(device, int):
        return device
    if device in uuids:
        return uuids.index(device)
    raise ValueError(f"a CUDA IPC handle names GPU {device}, which this process does not see "
                     f"(it sees {', '.join(uuids) or 'no GPU'}): sender and receiver must "
                     "run in the container allocated that GPU")


def _reduce_by_uuid(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """torch's reduction of `tensor`, naming a CUDA tensor's GPU by UUID instead of by this
    process's device index, which the receiver may number differently (another
    CUDA_VISIBLE_DEVICES, another container's allocation). SGLang's servers patch torch's
    reductions (`monkey_patch_torch_reductions`) to expect exactly this: a UUID there, never
    an index; `decode_named_tensors` reads either."""
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    if rebuild is torch_reductions.rebuild_cuda_tensor:
        args = (*args[:_CUDA_DEVICE_ARG], _gpu_uuids()[args[_CUDA_DEVICE_ARG]],
                *args[_CUDA_DEVICE_ARG + 1:])
    return rebuild, args


class _Pickler(ForkingPickler):
    """ForkingPickler with torch's tensor reductions, CUDA devices named by UUID."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            return _reduce_by_uuid(obj)
        return NotImplemented


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's `rebuild_cuda_tensor` for a handle whose device is an index or a UUID."""
    device = device_index(args[_CUDA_DEVICE_ARG], _gpu_uuids())
    rebuild: Any = torch_reductions.rebuild_cuda_tensor  # typed by torch as 15 named args
    rebuilt: torch.Tensor = rebuild(*args[:_CUDA_DEVICE_ARG], device,
                                    *args[_CUDA_DEVICE_ARG + 1:])
    return rebuilt


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        return super().find_class(module, name)


def _dumps(obj: Any) -> str:
    buf = io.BytesIO()
    _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _loads(entry: str) -> Any:
    return _Unpickler(io.BytesIO(base64.b64decode(entry))).load()


def _shared(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cpu" and not tensor.is_shared():
        tensor.share_memory_()
    return tensor


def encode_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One `serialized_named_tensors` entry; CPU tensors are moved to shared memory first."""
    use_file_system_sharing()
    return _dumps([(name, _shared(tensor)) for name, tensor in named])


def flat_span(named: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
    """The one flat tensor that `named` are all contiguous views of, in their one dtype and
    in order (the sidecar's staging of a version), or None when they are not.

    Such a version can travel as SGLang's flattened bucket: one shared handle for the lot.
    """
    if not named:
        return None
    first = named[0][1]
    storage = first.untyped_storage().data_ptr()
    end = first.storage_offset()
    for _, tensor in named:
        if (tensor.dtype != first.dtype or tensor.device != first.device
                or not tensor.is_contiguous()
                or tensor.untyped_storage().data_ptr() != storage
                or tensor.storage_offset() < end):
            return None
        end = tensor.storage_offset() + tensor.numel()
    start = first.storage_offset()
    return first.as_strided((end - start,), (1,), start)


def encode_flattened(named: Sequence[tuple[str, torch.Tensor]], flat: torch.Tensor) -> str:
    """One `serialized_named_tensors` entry in SGLang's `flattened_bucket` format.

    SGLang reads `flattened_tensor` and, per tensor, `name`, `shape`, `dtype`, `start_idx`,
    `end_idx` and `numel` of each `metadata` item (by attribute: a SimpleNamespace unpickles
    in any process, where SGLang's own dataclass would need SGLang in the sidecar).
    """
    use_file_system_sharing()
    base = flat.storage_offset()
    metadata = [
        SimpleNamespace(name=name, shape=torch.Size(tensor.shape), dtype=tensor.dtype,
                        start_idx=tensor.storage_offset() - base,
                        end_idx=tensor.storage_offset() - base + tensor.numel(),
                        numel=tensor.numel())
        for name, tensor in named
    ]
    return _dumps({"flattened_tensor": _shared(flat), "metadata": metadata})


def _decoded(obj: Any) -> NamedTensors:
    if isinstance(obj, dict) and isinstance(obj.get("flattened_tensor"), torch.Tensor):
        flat: torch.Tensor = obj["flattened_tensor"].reshape(-1)
        out: NamedTensors = []
        for meta in obj.get("metadata") or []:
            start, end = int(meta.start_idx), int(meta.end_idx)
            if not 0 <= start <= end <= flat.numel() or meta.dtype != flat.dtype:
                raise ValueError(f"flattened bucket: {meta.name} lies outside the flat tensor "
                                 f"or has another dtype ({meta.dtype} in {flat.dtype})")
            out.append((str(meta.name), flat[start:end].view(tuple(meta.shape))))
        return out
    if not isinstance(obj, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)
        for item in obj
    ):
        raise ValueError("serialized_named_tensors entry is not a list of (name, tensor) "
                         f"nor a {FLATTENED}")
    return [(str(name), tensor) for name, tensor in obj]


def decode_named_tensors(entry: str) -> NamedTensors:
    """The inverse of `encode_named_tensors` and `encode_flattened`, run in the engine."""
    use_file_system_sharing()
    return _decoded(_loads(entry))


def copy_into(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy each source into its target: a large tensor by its own copy (which runs at the
    device's copy rate), the small ones together in one multi-tensor copy (one launch where
    a copy each would cost more than its bytes). Not one multi-tensor copy for all: on an
    H200 `torch._foreach_copy_` moves 1 GB of 128 MB tensors at two thirds of the copy rate
    (docs/benchmarks/weight-sync.md)."""
    small: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for target, source in zip(targets, sources, strict=True):
        if target.numel() >= SCREEN_ALONE:
            target.copy_(source)
        else:
            small[0].append(target)
            small[1].append(source)
    if small[0]:
        torch._foreach_copy_(small[0], small[1])


class TensorReceiver:
    """The engine's side of the handoff: decodes entries and keeps the last ones mapped.

    Torch opens a CUDA IPC handle (or a shared-memory file) when it first unpickles it and
    closes it when the last tensor on it goes; it finds an open one again by its handle.
    The sidecar keeps its staging buffers while the layout stays the same, so holding the
    last version's tensors until the next arrives means each version after the first only
    looks its buffers up instead of opening them (about a millisecond for a GPU handle).
    The previous mapping is dropped once the new one is decoded, so a sidecar that
    replaced its staging gets the old memory back after one version.
    """

    def __init__(self) -> None:
        self._held: list[NamedTensors] = []

    def decode(self, entries: Sequence[str]) -> list[NamedTensors]:
        decoded = [decode_named_tensors(e) for e in entries]
        self._held = decoded
        return decoded

    def release(self) -> None:
        """Close every mapping (the engine releases its memory, or stops)."""
        self._held = []


def _unfit(
    current: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]]
) -> dict[int, str]:
    """Index in `named` -> why that tensor does not fit `current`, for those that do not."""
    unfit: dict[int, str] = {}
    for i, (name, tensor) in enumerate(named):
        have = current.get(name)
        if have is None:
            unfit[i] = f"unknown parameter {name}"
        elif tuple(have.shape) != tuple(tensor.shape):
            unfit[i] = f"{name}: shape {tuple(tensor.shape)} != {tuple(have.shape)}"
        elif have.dtype != tensor.dtype:
            unfit[i] = f"{name}: dtype {tensor.dtype} != {have.dtype}"
    return unfit


def fit_problems(
    current: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]]
) -> list[str]:
    """Why tensors do not fit `current`: unknown names, other shapes, other dtypes."""
    return list(_unfit(current, named).values())


def update_problems(
    current: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]]
) -> list[str]:
    """Why an update cannot be installed over `current` (empty when it can).

    Checks names, shapes, dtypes and finiteness, so an engine refuses a bad version whole
    and keeps serving the previous one.
    """
    unfit = _unfit(current, named)
    fitting = [nt for i, nt in enumerate(named) if i not in unfit]
    # One fused scan of the whole update: a check per tensor would synchronise per tensor.
    return [*unfit.values(), *(f"{name}: non-finite values" for name in nonfinite_names(fitting))]
