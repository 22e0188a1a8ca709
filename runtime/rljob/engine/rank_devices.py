"""Which GPU each tensor-parallel rank's weight entry lives on, for an engine's sidecar.

An SGLang engine of `gpusPerEngine` = N runs rank r on the r-th GPU of its slots and reads
entry r of an `update_weights_from_tensor` body. An entry staged on another rank's GPU would
still open there (handles name GPUs by UUID), but rank r would then create a CUDA context on
that GPU (hundreds of MiB of another rank's memory) and every rank would read one GPU's
memory at once. So the sidecar sees every GPU of its engine, in the engine's order
(`show_engine_gpus`), receives on the first (the GPU Ray gave it a share of), and copies the
verified version to each further rank's own GPU (`entry_devices`, `RankCopies`).

`rljob run --plan-only` derives each sidecar's devices through these same functions.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


class SidecarGpuError(RuntimeError):
    """Ray gave a sidecar its share of a GPU other than its engine's first."""


def show_engine_gpus(engine_gpus: str) -> None:
    """Make this process see its engine's GPUs (Ray's ids, comma-separated, first slot
    first), so that `cuda:r` is rank r's GPU; nothing changes for a CPU engine ("").

    Must run before CUDA is initialised in the process. Ray has set CUDA_VISIBLE_DEVICES to
    the sidecar's own share, which must be the engine's first GPU (`cuda:0` stays the GPU
    Ray accounts the sidecar on): SidecarGpuError otherwise. All of them are GPUs of the one
    container Kubernetes allocated to the engine's pod."""
    if not engine_gpus:
        return
    share = os.environ.get(CUDA_VISIBLE_DEVICES, "")
    if share and share.split(",")[0] != engine_gpus.split(",")[0]:
        raise SidecarGpuError(
            f"Ray gave the sidecar a share of GPU {share}, its engine's first GPU is "
            f"{engine_gpus.split(',')[0]}: the sidecar must stage on its engine's GPU")
    os.environ[CUDA_VISIBLE_DEVICES] = engine_gpus


def entry_devices(staging: str, ranks: int, visible: int) -> list[str]:
    """The device of each rank's entry: rank r's own GPU (`cuda:<staging index + r>`) when
    the version is staged on a GPU and the process sees a GPU for every rank; the staging
    device for every rank otherwise (on the CPU every rank maps the same shared memory)."""
    import torch  # here: `--plan-only` and the driver call this without torch loaded

    device = torch.device(staging)
    if device.type != "cuda":
        return [str(device)] * ranks
    first = device.index or 0
    if first + ranks > visible:
        return [str(device)] * ranks
    return [f"cuda:{first + r}" for r in range(ranks)]


class RankCopies:
    """One flat buffer per further rank's GPU, kept across versions (like the staging), that
    holds a copy of the staged version for that rank's entry."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copies(self, flat: torch.Tensor, devices: list[str]) -> list[torch.Tensor]:
        """`flat` as each rank's entry sees it: itself on its own device, a copy elsewhere.
        Returns once every copy is complete (the engine reads them through handles that
        carry no event to wait on)."""
        import torch

        out = []
        for device in devices:
            if torch.device(device) == flat.device:
                out.append(flat)
                continue
            buf = self._buffers.get(device)
            if buf is None or buf.numel() != flat.numel():
                self._buffers.pop(device, None)  # the old size's memory goes first
                buf = torch.empty_like(flat, device=device)
                self._buffers[device] = buf
            buf.copy_(flat, non_blocking=True)
            out.append(buf)
        for device in {str(t.device) for t in out if t.device.type == "cuda"}:
            torch.cuda.synchronize(device)
        return out

    def clear(self) -> None:
        self._buffers.clear()
