"""`rljob run --plan-only`: every worker placed as the job places it, and the devices each of
its processes would use, without starting one.

A GPU job's pods can be checked before they hold GPUs for hours: does each process run in a
container Kubernetes allocated its GPU (docs/gpu-pods.md), does each engine's weight-sync
sidecar stage on its engine's GPUs? The plan is made by the code the job runs: the same
placement group (`Cluster.reserve`), each probe started with the Ray options of the actor it
stands for (`slot_options`, `SlotHolder`, `sidecar_placement`), each device derived by the
function that actor calls (`engine_gpus`, `show_engine_gpus`, `entry_devices`). Only what
the actors would then start (a model, SGLang, NCCL) is left out, so a plan runs on CPUs,
with GPUs as a device plugin allocates them but none behind them.

Each process is reported with its container's allocation (`NVIDIA_VISIBLE_DEVICES`, set by
NVIDIA's device plugin or its container toolkit) and the GPUs it would use, named as the
allocation names them: Ray's GPU ids are indices into what the container sees, which CUDA
numbers in allocation order.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup

from rljob.cluster.placement import Devices, Layout
from rljob.cluster.weight_sync import sidecar_placement
from rljob.engine.launcher import Locality
from rljob.engine.rank_devices import (
    CUDA_VISIBLE_DEVICES,
    SidecarGpuError,
    entry_devices,
    show_engine_gpus,
)
from rljob.engine.slots import SlotDevices, SlotHolder, engine_gpus, here
from rljob_api.spec import RLJobSpec, RolloutBackend

NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
LINE_PREFIX = "device-plan: "
PROBE_TIMEOUT_S = 300.0  # each probe is a fresh Ray worker process


@dataclass(frozen=True)
class ProcessDevices:
    """One process of the job as planned: what its container holds and what it would use."""

    role: str  # trainer | engine | sidecar
    index: int  # trainer rank, or engine index
    pod: str  # the host name: in Kubernetes, the pod's name
    allocation: list[str] | None  # the container's GPUs; None: not stated (no device plugin)
    visible: list[str]  # CUDA_VISIBLE_DEVICES as Ray sets it (a sidecar's: its own share)
    device: str  # the torch device it works on
    gpus: list[str]  # GPUs it would use: a trainer's one; an engine's by rank; a sidecar's
    # entry for each rank

    def line(self) -> str:
        return LINE_PREFIX + json.dumps(asdict(self), sort_keys=True)


def allocation(environ: dict[str, str]) -> list[str] | None:
    """The GPUs of this container as the device plugin stated them; None when it did not
    (no plugin, or `all`, which names no GPU in particular)."""
    raw = environ.get(NVIDIA_VISIBLE_DEVICES)
    if raw is None or raw.strip() == "all":
        return None
    if raw.strip() in ("", "void", "none"):
        return []
    return [d.strip() for d in raw.split(",") if d.strip()]


def physical(ids: Sequence[str], allocated: list[str] | None) -> list[str]:
    """GPU ids as this process numbers them (indices into what its container sees), named as
    the allocation names them; kept as they are where no allocation is stated."""
    if allocated is None:
        return list(ids)
    out = []
    for gpu in ids:
        if gpu in allocated:
            out.append(gpu)  # already a name (a UUID in CUDA_VISIBLE_DEVICES)
        elif gpu.isdigit() and int(gpu) < len(allocated):
            out.append(allocated[int(gpu)])
        else:
            out.append(f"unallocated:{gpu}")
    return out


def _visible() -> list[str]:
    return [d for d in os.environ.get(CUDA_VISIBLE_DEVICES, "").split(",") if d]


def _report(role: str, index: int, device: str, used: Sequence[str],
            visible: list[str] | None = None) -> ProcessDevices:
    allocated = allocation(dict(os.environ))
    return ProcessDevices(role, index, socket.gethostname(), allocated,
                          _visible() if visible is None else visible, device,
                          physical(used, allocated))


class DeviceProbe:
    """Stands in a worker's place with that worker's Ray options and says which devices it
    would use; one probe per process of the job."""

    def trainer(self, rank: int, device: str) -> ProcessDevices:
        """A trainer rank works on its current GPU, the one Ray gave its share of
        (`rank_device("cuda")`, Megatron's `set_device(0)`): cuda:0 of what it sees."""
        if device != "cuda":
            return _report("trainer", rank, "cpu", [])
        return _report("trainer", rank, "cuda:0", _visible()[:1])

    def engine(self, index: int, backend: str, device: str, ranks: int,
               further: list[SlotDevices]) -> tuple[ProcessDevices, Locality]:
        """The GPU each of an engine's ranks computes on, as `EngineProcess` starts it:
        SGLang's rank r on the r-th GPU of its slots, every rank of the built-in `hf` engine
        on the first. Also what the engine reports of itself for its sidecar's placement."""
        gpus = engine_gpus(here(), further) if device == "cuda" else []
        node = str(ray.get_runtime_context().get_node_id())
        computes = gpus if backend == RolloutBackend.sglang else gpus[:1]
        by_rank = computes if backend == RolloutBackend.sglang else computes * ranks
        report = _report("engine", index, "cuda:0" if gpus else "cpu", by_rank)
        return report, Locality(node, ",".join(computes))

    def sidecar(self, index: int, device: str, engine_gpus: str, ranks: int) -> ProcessDevices:
        """A sidecar is shown its engine's GPUs (`SidecarActor`: refused unless Ray gave it
        its share on the engine's first), stages on `device` and puts rank r's entry on
        `entry_devices`' r-th device. `visible` reports the share Ray gave it."""
        share = _visible()
        # A real sidecar refuses to start on a wrong share; the plan names it (`problems`).
        with contextlib.suppress(SidecarGpuError):
            show_engine_gpus(engine_gpus)
        shown = engine_gpus.split(",") if device != "cpu" and engine_gpus else []
        entries = entry_devices(device, ranks, len(shown))
        used = [shown[int(d.split(":")[1])] for d in entries if d.startswith("cuda")]
        return _report("sidecar", index, device, used, visible=share)

    def whereabouts(self) -> str:
        return socket.gethostname()


def probe(pg: PlacementGroup, layout: Layout, devices: Devices, spec: RLJobSpec,
          at: Callable[[int], dict[str, Any]]) -> list[ProcessDevices]:
    """Every process of the job, placed on `pg` as `Cluster.place` and
    `WeightSyncActors.start_sidecars` place them (`at(slot)`: the Ray options of the actor at
    `slot`), reporting its devices: trainer ranks, engines, then sidecars."""
    probe_cls: Any = ray.remote(DeviceProbe)
    holder_cls: Any = ray.remote(SlotHolder)
    started: list[Any] = []

    def start(cls: Any, options: dict[str, Any]) -> Any:
        started.append(cls.options(**options).remote())
        return started[-1]

    try:
        trainers = [start(probe_cls, at(slot)).trainer.remote(rank, devices.trainer)
                    for rank, slot in enumerate(layout.trainer_slots)]
        groups = layout.engine_slot_groups()
        holders = [[start(holder_cls, at(slot)) for slot in group[1:]] for group in groups]
        engines = [start(probe_cls, at(group[0])).engine.remote(
            i, str(spec.rollout.backend), devices.engine, spec.rollout.gpus_per_engine,
            ray.get([h.where.remote() for h in hs], timeout=PROBE_TIMEOUT_S))
            for i, (group, hs) in enumerate(zip(groups, holders, strict=True))]
        reports: list[ProcessDevices] = ray.get(trainers, timeout=PROBE_TIMEOUT_S)
        engine_reports: list[tuple[ProcessDevices, Locality]] = ray.get(
            engines, timeout=PROBE_TIMEOUT_S)
        sidecars = []
        for i, (group, (report, locality)) in enumerate(
                zip(groups, engine_reports, strict=True)):
            reports.append(report)
            device, options = sidecar_placement(pg, group[0], locality.node_id,
                                                bool(locality.gpus), devices.sync_on_gpu)
            sidecars.append(start(probe_cls, options).sidecar.remote(
                i, device, locality.gpus if device != "cpu" else "",
                spec.rollout.gpus_per_engine))
        reports += ray.get(sidecars, timeout=PROBE_TIMEOUT_S)
        return reports
    finally:
        for handle in started:
            ray.kill(handle)


def problems(reports: Sequence[ProcessDevices]) -> list[str]:
    """What breaks the rule of docs/gpu-pods.md in a plan: a process using a GPU its
    container was not allocated, two trainer ranks or two engines on one GPU, a sidecar not
    in its engine's pod, not given its Ray share on its engine's first GPU, or not staging
    on its engine's ranks' GPUs in rank order."""
    out = []
    for r in reports:
        if r.allocation is not None:
            foreign = [g for g in r.gpus if g not in r.allocation]
            if foreign:
                out.append(f"{r.role}-{r.index} in pod {r.pod} would use {', '.join(foreign)}, "
                           f"which its container was not allocated ({r.allocation})")
    trainer_gpus = [g for r in reports if r.role == "trainer" for g in r.gpus]
    if len(set(trainer_gpus)) != len(trainer_gpus):
        out.append(f"trainer ranks share GPUs: {trainer_gpus}")
    engines = {r.index: r for r in reports if r.role == "engine"}
    engine_gpus_all = [g for r in engines.values() for g in set(r.gpus)]
    if len(set(engine_gpus_all)) != len(engine_gpus_all):
        out.append(f"engines share GPUs: {engine_gpus_all}")
    for s in (r for r in reports if r.role == "sidecar"):
        engine = engines.get(s.index)
        if engine is None:
            out.append(f"sidecar-{s.index} has no engine")
            continue
        if s.pod != engine.pod:
            out.append(f"sidecar-{s.index} is in pod {s.pod}, its engine in {engine.pod}")
        if s.gpus and s.gpus != engine.gpus:
            out.append(f"sidecar-{s.index} would stage on {s.gpus}, its engine's ranks use "
                       f"{engine.gpus}")
        share = physical(s.visible[:1], s.allocation)
        if s.gpus and s.visible and share != engine.gpus[:1]:  # as `show_engine_gpus`
            out.append(f"sidecar-{s.index} holds its share of {share}, its engine's first "
                       f"GPU is {engine.gpus[:1]}")
    return out
