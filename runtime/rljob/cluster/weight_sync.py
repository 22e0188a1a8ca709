"""Weight sync inside a Ray job: where the coordination store runs, and the sidecars.

The store needs an address every pod can reach. On a cluster the driver is a pod of its
own, but the Ray head pod sits behind KubeRay's stable Service `<job>-head-svc` (whose
ports are the head container's ports), so the driver starts the store as an actor pinned
to the Ray head node on a fixed port. The actor is the driver's: it ends with the driver.
On one machine every actor reaches the driver, so the driver serves the store from its own
process (the same `StoreHost`, not made an actor): no actor process is started for it, which
would import torch (seconds of CPU while every other worker starts too).

Sidecars: the driver starts one sidecar per engine as an actor on the engine's node, on a
laptop and in pods alike, so it runs in the container that holds the engine's GPUs (a
process of another container could not be allocated the same GPU: docs/gpu-pods.md). When
weights travel GPU to GPU (trainer and engines on GPUs, `placement.Devices.sync_on_gpu`) a
GPU engine's sidecar asks Ray for `placement.SIDECAR_SHARE` of the placement-group bundle of
the engine's first slot: Ray then shows it exactly that GPU, where it joins the NCCL group
(or reads the trainer's buckets by CUDA IPC) and stages what the engine loads. Otherwise (a
CPU engine, or a CPU trainer, whose group is gloo) it stages on the CPU next to its engine
and holds no GPU. Ray restarts a sidecar that dies (up to `SIDECAR_MAX_RESTARTS` times, in
the same bundle); the restarted one registers again and is sent the next version. Ray ends
them with the driver, on exit, Ctrl-C or a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from rljob.cluster.engine_group import EngineGroup
from rljob.cluster.placement import SIDECAR_SHARE
from rljob.engine.launcher import Locality
from rljob.reporting.locatable import Locatable
from rljob_api import env, layout
from rljob_api.layout import HEAD_RESOURCE

if TYPE_CHECKING:
    from rljob.engine.sidecar import SidecarConfig

PORT_ENV = env.WEIGHT_SYNC_PORT
ENGINE_PORT_ENV = env.ENGINE_PORT
BIND_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# A sidecar that dies (its process killed, e.g. by the container's OOM killer) is started
# again by Ray this many times per attempt; after that the attempt ends with
# `WeightSyncSidecarLost` and the job restarts as for any lost worker, counted against
# spec.recovery.maxRestarts, so a sidecar that keeps dying cannot loop.
SIDECAR_MAX_RESTARTS = 3
HEALTH_TIMEOUT_S = 10.0
# How long `acked` waits for an answer: a running sidecar answers within it.
ACK_ANSWER_WAIT_S = 0.2


@dataclass(frozen=True)
class SyncSettings:
    """What the environment says about the pods: the operator sets these on the driver."""

    store_port: int = 0  # 0: any free port
    engine_port: int = 0  # 0: any free port; else the first engine port of each pod

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SyncSettings:
        def port(name: str) -> int:
            raw = env.get(name, "0")
            if not raw.isdigit() or int(raw) > 65535:
                raise ValueError(f"{name} must be a port number (0 for any), got {raw!r}")
            return int(raw)

        return cls(port(PORT_ENV), port(ENGINE_PORT_ENV))


class StoreHost(Locatable):
    """The weight-sync coordination store, served from this process on `port` (0: any free
    one) until this object is dropped: an actor on the Ray head on a cluster, the driver
    itself on one machine (which imported torch already, with the trainer backend)."""

    def __init__(self, port: int, bind_timeout_s: float) -> None:
        from rljob.weightsync.group import open_store  # torch: imported where the store runs

        deadline = time.monotonic() + bind_timeout_s
        while True:
            try:
                self.store = open_store("0.0.0.0", port, server=True, timeout_s=30.0)
                break
            except RuntimeError:
                # The previous driver's store may hold the fixed port until Ray reaps it.
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    def address(self) -> tuple[str, int]:
        return str(ray.util.get_node_ip_address()), int(self.store.port)


@dataclass(frozen=True)
class ToCome:
    """What a sidecar started beside a still-loading engine reads once its own process is up
    (Ray object refs, so its start-up runs beside the engine's): the engine's address and
    locality, and the store's address. A sidecar Ray starts again reads the same answers."""

    engine_url: Any  # ObjectRef[str]
    locality: Any  # ObjectRef[Locality]
    store: Any  # ObjectRef[tuple[str, int]]

    def complete(self, config: SidecarConfig) -> SidecarConfig:
        url, locality, (host, port) = ray.get([self.engine_url, self.locality, self.store])
        return dataclasses.replace(
            config, engine_url=url, trainer_host=host, trainer_port=int(port),
            engine_gpus=locality.gpus if config.device != "cpu" else "")


class SidecarActor(Locatable):
    """`rljob-weight-sync` as a Ray actor: the sidecar loop on a thread of this process."""

    def __init__(self, config: SidecarConfig, to_come: ToCome | None = None) -> None:
        # Imported in the actor: the driver starts it without importing torch.
        from rljob.engine.rank_devices import show_engine_gpus
        from rljob.engine.sidecar import Sidecar

        if to_come is not None:
            config = to_come.complete(config)
        if not config.advertise_host:
            config = dataclasses.replace(config, advertise_host=ray.util.get_node_ip_address())
        # Before CUDA starts in this process: rank r's GPU becomes cuda:r.
        show_engine_gpus(config.engine_gpus)
        self.sidecar = Sidecar(config)
        threading.Thread(target=self.sidecar.run, name="weight-sync", daemon=True).start()

    def health(self) -> dict[str, Any]:
        return self.sidecar.health()

    def stop(self) -> None:
        self.sidecar.stop()


def sidecar_options(
    pg: PlacementGroup, slot: int, node_id: str, on_gpu: bool
) -> dict[str, Any]:
    """Ray options of the sidecar of the engine whose first slot is `slot` on `node_id`.

    A GPU engine's sidecar takes `SIDECAR_SHARE` of that slot's bundle, so Ray accounts for
    it and sets its CUDA_VISIBLE_DEVICES to the engine's GPU; a CPU engine's needs no slot.
    """
    if on_gpu:
        return {
            "max_restarts": SIDECAR_MAX_RESTARTS,
            "num_cpus": 0,
            "num_gpus": SIDECAR_SHARE,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=slot
            ),
        }
    return {
        "max_restarts": SIDECAR_MAX_RESTARTS,
        "num_cpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
    }


def sidecar_device(engine_on_gpu: bool, sync_on_gpu: bool) -> str:
    """Where the sidecar of an engine (on GPUs or not) stages: that engine's first GPU when
    weights travel GPU to GPU (Ray gives the sidecar a share of it, and `show_engine_gpus`
    keeps it at index 0), else the CPU (a CPU engine, or a gloo group, which takes CPU
    buffers only)."""
    return "cuda:0" if sync_on_gpu and engine_on_gpu else "cpu"


def sidecar_placement(
    pg: PlacementGroup, slot: int, node_id: str, engine_on_gpu: bool, sync_on_gpu: bool
) -> tuple[str, dict[str, Any]]:
    """The device the sidecar of an engine stages on, and the Ray options that start it
    there: `slot` is the engine's first slot, on `node_id`. The one rule for the start, a
    replacement and `--plan-only` alike."""
    device = sidecar_device(engine_on_gpu, sync_on_gpu)
    return device, sidecar_options(pg, slot, node_id, on_gpu=device != "cpu")


def engine_name(index: int) -> str:
    """The name engine `index` has in weight sync (its sidecar registers under it)."""
    return f"engine-{index}"


@dataclass
class SidecarCheck:
    """Sidecars lost since the last check, by engine index: for good (why), or being started
    or started again by Ray."""

    dead: dict[int, str] = field(default_factory=dict)
    restarted: list[int] = field(default_factory=list)
    # Of `dead`: those Ray cannot start again because their node is gone (with their engine).
    node_gone: set[int] = field(default_factory=set)

    def of_engines(self, names: Iterable[str]) -> SidecarCheck:
        """Only what happened to the sidecars of the engines named (those left stale)."""
        engines = {i for i in [*self.dead, *self.restarted] if engine_name(i) in set(names)}
        return SidecarCheck({i: why for i, why in self.dead.items() if i in engines},
                            [i for i in self.restarted if i in engines],
                            {i for i in self.node_gone if i in engines})

    def describe(self) -> str:
        return "; ".join([*(f"{engine_name(i)}: {why}" for i, why in self.dead.items()),
                          *(f"{engine_name(i)}: its sidecar died and Ray started it again"
                            for i in self.restarted)])


class WeightSyncActors:
    """The store (an actor on the Ray head, or served by the driver) and the sidecar actors
    of one driver."""

    def __init__(self, settings: SyncSettings) -> None:
        self.settings = settings
        self.store: Any = None  # the store's actor, when it runs in one
        self.driver_store: StoreHost | None = None  # or the store this process serves
        self._store_address: Any = None  # ObjectRef[tuple[str, int]]: where it serves
        self.sidecars: list[Any] = []
        self.incarnations: dict[int, str] = {}  # by engine index, as last checked
        # `health` questions a replacement's sidecar has not answered yet (its process still
        # starts): read at the next `acked`, never waited for; and each sidecar's last answer,
        # which `acked` gives while a newer question is open.
        self.asked: dict[int, ray.ObjectRef[Any]] = {}
        self.answered: dict[int, int | None] = {}
        self.to_come: dict[int, ToCome] = {}  # what each first sidecar read at its start

    def start_store(self, in_driver: bool) -> None:
        """Start the store: served by this process when `in_driver` (one machine: every
        actor runs on this host, as the engines' and sidecars' loopback addresses assume
        too), else as an actor on the Ray head node (`store_address` says where it serves)."""
        if in_driver:
            self.driver_store = StoreHost(self.settings.store_port, BIND_TIMEOUT_S)
            # An object ref like the actor's answer: sidecars read it when their process is up,
            # and one Ray starts again reads it again (this driver owns it while it runs).
            self._store_address = ray.put(self.driver_store.address())
            return
        self.store = (
            ray.remote(StoreHost)
            .options(num_cpus=0, resources={HEAD_RESOURCE: 0.001})
            .remote(self.settings.store_port, BIND_TIMEOUT_S)
        )
        self._store_address = self.store.address.remote()

    def store_address(self) -> tuple[str, int]:
        """The address the trainer and the sidecars join, once the store serves."""
        host, port = ray.get(self._store_address, timeout=BIND_TIMEOUT_S + 60)
        return str(host), int(port)

    def store_whereabouts(self) -> Any:
        """An object ref to where the store runs (`Whereabouts`): its actor's answer, or this
        process's."""
        if self.store is not None:
            return self.store.whereabouts.remote()
        assert self.driver_store is not None, "the store started first"
        return ray.put(self.driver_store.whereabouts())

    def start_sidecars(
        self,
        engines: EngineGroup,
        ports: list[int],
        loopback: bool,
        placement: tuple[PlacementGroup, list[int]],
        sync_on_gpu: bool,
        engine_on_gpu: bool,
    ) -> None:
        """One sidecar per engine, named `engine-<i>`, started while its engine still loads
        (each reads its engine's and the store's address when they come, `ToCome`): on the
        engine's node, and when it stages on its GPU engine's GPU (`sidecar_options`) in the
        bundle of the engine's first slot (`placement`: the group and each engine's first
        slot) holding a share of that GPU. `ports`: each engine's port (0: any free one)."""
        pg, slots = placement
        self._where = (loopback, placement, sync_on_gpu)
        nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        store = self._store_address
        for i, engine in enumerate(engines.handles):
            device, options = sidecar_placement(pg, slots[i], nodes[slots[i]], engine_on_gpu,
                                                sync_on_gpu)
            config = self._config(i, ports[i], device)
            to_come = ToCome(engine.address.remote(), engine.locality.remote(), store)
            # Held here: a sidecar Ray starts again reads the same answers, which live only
            # while their owner (this driver) holds a reference.
            self.to_come[i] = to_come
            self.sidecars.append(
                ray.remote(SidecarActor).options(**options).remote(config, to_come))

    def _config(self, i: int, port: int, device: str, url: str = "", engine_gpus: str = "",
                store: tuple[str, int] = ("", 0)) -> SidecarConfig:
        """The sidecar of engine `i`, whose engine serves on `port`."""
        from rljob.engine.sidecar import SidecarConfig

        loopback = self._where[0]
        # In pods: the port the pod declares for the sidecar of the engine at this port.
        listen_port = (layout.weight_sync_health_port(port - self.settings.engine_port)
                       if self.settings.engine_port else 0)
        return SidecarConfig(
            engine_name=engine_name(i),
            engine_url=url,
            trainer_host=store[0],
            trainer_port=store[1],
            listen_host="127.0.0.1" if loopback else "0.0.0.0",
            listen_port=listen_port,
            advertise_host="127.0.0.1" if loopback else "",
            device=device,
            engine_gpus=engine_gpus,
        )

    def _start_sidecar(self, i: int, url: str, loc: Locality) -> Any:
        _, (pg, slots), sync_on_gpu = self._where
        device, options = sidecar_placement(pg, slots[i], loc.node_id, bool(loc.gpus),
                                            sync_on_gpu)
        config = self._config(i, int(url.rsplit(":", 1)[1]), device, url,
                              loc.gpus if device != "cpu" else "", self.store_address())
        return ray.remote(SidecarActor).options(**options).remote(config)

    def replace_sidecar(self, i: int, url: str, loc: Locality) -> None:
        """A new sidecar for the replacement of engine `i` (at `url`, where `loc` says):
        the old one is killed; the new one registers under the same name, as a new
        incarnation that the next delivery targets."""
        with contextlib.suppress(ray.exceptions.RayError):
            ray.kill(self.sidecars[i])
        self.sidecars[i] = self._start_sidecar(i, url, loc)
        self.to_come.pop(i, None)
        self.incarnations.pop(i, None)
        self.asked.pop(i, None)
        self.answered.pop(i, None)

    def kill_sidecar(self, i: int) -> None:
        """The sidecar of a lost engine: it has nothing left to install into."""
        with contextlib.suppress(ray.exceptions.RayError):
            ray.kill(self.sidecars[i])
        self.asked.pop(i, None)
        self.answered.pop(i, None)

    def acked(self, i: int) -> int | None:
        """The version engine `i`'s sidecar last installed and acknowledged, once it has
        registered; None while it starts. The driver asks this between steps, so it never
        waits: while a question is open (its sidecar's process may still start), the last
        answer stands."""
        ref = self.asked.pop(i, None) or self.sidecars[i].health.remote()
        ready, _ = ray.wait([ref], timeout=ACK_ANSWER_WAIT_S)
        if not ready:
            self.asked[i] = ref
            return self.answered.get(i)
        try:
            health = ray.get(ref)
        except ray.exceptions.RayError:
            self.answered.pop(i, None)
            return None
        if health["state"] in ("starting", "disconnected"):
            self.answered.pop(i, None)
            return None
        self.incarnations[i] = health["incarnation"]
        version = health.get("last_acked_version")
        self.answered[i] = int(version) if version is not None else -1
        return self.answered[i]

    def health(self) -> list[dict[str, Any]]:
        """Each sidecar's `/health` answer, by engine index."""
        return list(ray.get([s.health.remote() for s in self.sidecars]))

    def check(self) -> SidecarCheck:
        """Which sidecars died since the last check: Ray gave up on them, or is starting or
        started them again (a new incarnation, which missed what was sent meanwhile and
        registers anew; `wait_registered` waits for it)."""
        check = SidecarCheck()
        for i, sidecar in enumerate(self.sidecars):
            try:
                health = ray.get(sidecar.health.remote(), timeout=HEALTH_TIMEOUT_S)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                check.restarted.append(i)  # Ray is starting it again (or it is busy)
                self.incarnations.pop(i, None)
                continue
            except ray.exceptions.RayActorError as err:
                check.dead[i] = (f"its sidecar died and was not started again "
                                 f"({SIDECAR_MAX_RESTARTS} restarts an attempt): "
                                 f"{str(err).splitlines()[0]}")
                continue
            except ray.exceptions.ActorUnschedulableError as err:
                # Bound to its engine's node, which is gone: so is the engine.
                check.dead[i] = f"its node is gone: {str(err).splitlines()[0][:300]}"
                check.node_gone.add(i)
                continue
            known = self.incarnations.get(i)
            if known is not None and known != health["incarnation"]:
                check.restarted.append(i)
            self.incarnations[i] = health["incarnation"]
        return check

    def wait_registered(self, engines: list[int], timeout_s: float) -> bool:
        """Whether the sidecars of `engines` answer and registered with the store within
        `timeout_s` (one Ray is starting again answers once started, then registers on its
        own); False when one is gone for good or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                states = ray.get([self.sidecars[i].health.remote() for i in engines],
                                 timeout=HEALTH_TIMEOUT_S)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                states = None  # still starting
            except ray.exceptions.RayError:
                return False
            if states is not None and all(h["state"] not in ("starting", "disconnected")
                                          for h in states):
                for i, h in zip(engines, states, strict=True):
                    self.incarnations[i] = h["incarnation"]
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the sidecars (each within a deadline, unless not `graceful`), then kill them
        and the store."""
        for sidecar in self.sidecars if graceful else []:
            # One already gone needs no stopping: killing it below is all that is left.
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(sidecar.stop.remote(), timeout=STOP_TIMEOUT_S)
        for handle in [*self.sidecars, *([self.store] if self.store is not None else [])]:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(handle)
        self.sidecars, self.store, self.driver_store = [], None, None
