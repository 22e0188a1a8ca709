"""The pure parts of a device plan: how a container's allocation is read and named, which
device each rank's entry goes on, what `problems` calls a broken plan, and whether a CPU
staging fits shared memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rljob.cluster.device_plan import ProcessDevices, allocation, physical, problems
from rljob.engine.rank_devices import (
    RankCopies,
    SidecarGpuError,
    entry_devices,
    show_engine_gpus,
)
from rljob.weightsync.wire import shared_memory_fits

pytestmark = pytest.mark.unit


def test_allocation_is_read_as_nvidia_states_it() -> None:
    assert allocation({"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"}) == ["GPU-a", "GPU-b"]
    assert allocation({"NVIDIA_VISIBLE_DEVICES": "void"}) == []
    assert allocation({"NVIDIA_VISIBLE_DEVICES": "all"}) is None
    assert allocation({}) is None


def test_ray_ids_are_named_by_the_allocation() -> None:
    assert physical(["1", "0"], ["GPU-a", "GPU-b"]) == ["GPU-b", "GPU-a"]
    assert physical(["GPU-b"], ["GPU-a", "GPU-b"]) == ["GPU-b"]
    assert physical(["2"], ["GPU-a", "GPU-b"]) == ["unallocated:2"]
    assert physical(["3"], None) == ["3"]


def test_each_rank_entry_goes_on_its_own_gpu_when_the_sidecar_sees_them() -> None:
    assert entry_devices("cuda:0", 4, 4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    # Fewer GPUs shown than ranks: every entry stays where the version was staged.
    assert entry_devices("cuda:0", 2, 1) == ["cuda:0", "cuda:0"]
    assert entry_devices("cpu", 2, 0) == ["cpu", "cpu"]


def test_rank_copies_on_the_cpu_share_the_staging() -> None:
    flat = torch.arange(8, dtype=torch.uint8)
    copies = RankCopies().copies(flat, ["cpu", "cpu"])
    assert all(c.data_ptr() == flat.data_ptr() for c in copies)


def _r(role: str, index: int, gpus: list[str], pod: str = "p",
       allocated: list[str] | None = None, share: str | None = None) -> ProcessDevices:
    """A report; a sidecar's share (what Ray showed it) is its first GPU's unless given."""
    alloc = ["GPU-0", "GPU-1", "GPU-2", "GPU-3"] if allocated is None else allocated
    first = share or (gpus[0] if gpus else None)
    visible = [str(alloc.index(first))] if role == "sidecar" and first else []
    return ProcessDevices(role, index, pod, alloc, visible, "cuda:0", gpus)


def test_a_sound_plan_has_no_problems() -> None:
    assert problems([_r("trainer", 0, ["GPU-0"]), _r("trainer", 1, ["GPU-1"]),
                     _r("engine", 0, ["GPU-2", "GPU-3"]),
                     _r("sidecar", 0, ["GPU-2", "GPU-3"])]) == []


@pytest.mark.parametrize(("reports", "expected"), [
    ([_r("trainer", 0, ["GPU-7"])], "trainer-0 in pod p would use GPU-7"),
    ([_r("trainer", 0, ["GPU-0"]), _r("trainer", 1, ["GPU-0"])], "trainer ranks share"),
    ([_r("engine", 0, ["GPU-0"]), _r("engine", 1, ["GPU-0"])], "engines share"),
    ([_r("engine", 0, ["GPU-2", "GPU-3"]), _r("sidecar", 0, ["GPU-2", "GPU-2"])],
     "sidecar-0 would stage on ['GPU-2', 'GPU-2']"),
    ([_r("engine", 0, ["GPU-2"], pod="a"), _r("sidecar", 0, ["GPU-2"], pod="b")],
     "sidecar-0 is in pod b, its engine in a"),
    ([_r("sidecar", 3, [])], "sidecar-3 has no engine"),
    ([_r("engine", 0, ["GPU-2", "GPU-3"]), _r("sidecar", 0, ["GPU-2", "GPU-3"], share="GPU-1")],
     "sidecar-0 holds its share of ['GPU-1'], its engine's first GPU is ['GPU-2']"),
])
def test_a_broken_plan_is_named(reports: list[ProcessDevices], expected: str) -> None:
    found = problems(reports)
    assert len(found) == 1 and expected in found[0], found


def test_a_cpu_staging_larger_than_shared_memory_is_refused_naming_sizes(tmp_path: Path) -> None:
    """Past /dev/shm's room a written page is a SIGBUS; the sidecar refuses first."""
    room = os.statvfs(tmp_path)
    free = room.f_bavail * room.f_frsize
    shared_memory_fits(1024, tmp_path)
    with pytest.raises(ValueError, match=r"does not fit .* MiB free\): a sidecar staging"):
        shared_memory_fits(free + (1 << 30), tmp_path)


def test_a_sidecar_is_shown_its_engine_s_gpus_only_from_its_engine_s_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's share must be the engine's first GPU; then the sidecar sees them all, in order."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    show_engine_gpus("2,3")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(SidecarGpuError, match="share of GPU 1, its engine's first GPU is 2"):
        show_engine_gpus("2,3")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"  # left as Ray set it
    show_engine_gpus("")  # a CPU engine: nothing to show
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
