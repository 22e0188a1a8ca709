"""The broadcast group: one torch.distributed process group per membership epoch.

Groups are built directly on a prefixed view of the trainer's TCP store rather than through
`init_process_group`, so the trainer may still use the default group for its own training,
and a group can be dropped and rebuilt (new epoch) when an engine dies or rejoins.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    Store,
    TCPStore,
)


def open_store(host: str, port: int, *, server: bool, timeout_s: float) -> TCPStore:
    """The trainer hosts the store (`server=True`); sidecars connect, failing after `timeout_s`.

    The libuv store serves many clients from one thread; a torch built without libuv (e.g.
    Debian's CPU-only python3-torch, in the offline CPU images) uses the classic one.
    """
    def store(libuv: bool) -> TCPStore:
        return TCPStore(host, port, is_master=server, wait_for_workers=False,
                        timeout=timedelta(seconds=timeout_s), use_libuv=libuv)

    try:
        return store(True)
    except RuntimeError as err:
        if "libuv" not in str(err):
            raise
        return store(False)


def rank_device(device: str | torch.device) -> torch.device:
    """The device one group member moves its buffers on, with the GPU index made explicit
    (`cuda` alone means the process's current GPU), so devices compare equal when they are
    the same GPU."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


class BroadcastGroup:
    """Rank 0 is the trainer; ranks 1..n are the engines' sidecars, in roster order.

    Each member states the device it works on: NCCL is handed only CUDA tensors on that
    GPU (a CPU tensor or one on another GPU fails inside NCCL, with an error of no fixed
    exception type, or silently uses the wrong GPU's communicator), gloo only CPU tensors.
    """

    def __init__(
        self,
        store: Store,
        *,
        epoch_prefix: str,
        rank: int,
        size: int,
        backend: str,
        device: str | torch.device,
        timeout_s: float,
    ) -> None:
        self.device = rank_device(device)
        want = {"gloo": "cpu", "nccl": "cuda"}.get(backend)
        if want is None:
            raise ValueError(f"weight-sync backend must be gloo or nccl, got {backend!r}")
        if self.device.type != want:
            raise ValueError(
                f"a weight-sync {backend} group needs {want} buffers, but rank {rank} stages "
                f"on {self.device}"
            )
        prefixed = PrefixStore(epoch_prefix, store)
        timeout = timedelta(seconds=timeout_s)
        self.rank = rank
        self.size = size
        self.backend = backend
        self._pg: Any
        if backend == "gloo":
            self._pg = ProcessGroupGloo(prefixed, rank, size, timeout)
        else:
            # Looked up at run time: CPU-only builds of torch have no NCCL class.
            nccl: Any = getattr(dist, "ProcessGroupNCCL")  # noqa: B009
            options = nccl.Options()
            options._timeout = timeout
            with torch.cuda.device(self.device):
                self._pg = nccl(prefixed, rank, size, options)

    def broadcast(self, buf: torch.Tensor, root: int = 0) -> None:
        """Blocking broadcast of `buf` from `root`; raises when a peer fails or times out,
        and refuses (ValueError) a buffer on another device than this member's."""
        if buf.device != self.device:
            raise ValueError(
                f"weight-sync {self.backend} rank {self.rank} works on {self.device}; "
                f"refusing to hand it a buffer on {buf.device}"
            )
        opts = BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        if buf.is_cuda:
            with torch.cuda.device(self.device):
                self._pg.broadcast([buf], opts).wait()
                torch.cuda.current_stream(self.device).synchronize()
        else:
            self._pg.broadcast([buf], opts).wait()

    def close(self) -> None:
        """Release the group's connections (NCCL communicators are aborted, not waited on)."""
        if self.backend == "nccl":
            self._pg.abort()
        del self._pg


class Checks(Protocol):
    """What `poll_key` asks of a store: a TCP store, or a `SignedStore` over one."""

    def check(self, __keys: list[str]) -> bool: ...


def poll_key(store: Checks, key: str, timeout_s: float, interval_s: float = 0.05) -> bool:
    """True once `key` exists, False after `timeout_s`.

    Polls `check` instead of calling `wait`: a timed-out `wait` is logged by c10d as a
    warning, and these waits time out routinely (idle sidecars, slow acknowledgements).
    """
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(interval_s, remaining))
    return True
