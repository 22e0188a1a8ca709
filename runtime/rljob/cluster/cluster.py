"""Start-up and placement: this run's Ray (joined, connected to or started), the placement
group, and every worker on it — trainer ranks, engines, the rollout worker — and their
shutdown. The driver (`rljob.driver`) gets the workers from here and places nothing itself.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rljob.cluster import device_plan, ray_node, whereabouts
from rljob.cluster.device_plan import ProcessDevices
from rljob.cluster.engine_group import EngineGroup
from rljob.cluster.placement import (
    DeviceError,
    Devices,
    Layout,
    choose_devices,
    engine_port,
    plan,
    port_clashes,
    trainer_world,
)
from rljob.cluster.rollout_pipeline import RolloutPipeline
from rljob.cluster.trainer_group import TrainerGroup
from rljob.cluster.weight_sync import SidecarCheck, SyncSettings, WeightSyncActors
from rljob.cluster.whereabouts import Placed
from rljob.engine.launcher import EngineProcess
from rljob.engine.slots import SlotHolder
from rljob.reporting.locatable import Whereabouts
from rljob.reporting.startup import StartupClock
from rljob.rollout.worker import RolloutWorker
from rljob.trainer.select import trainer_class
from rljob.weightsync.auth import peer_key
from rljob_api import env, exits
from rljob_api.exits import JobError
from rljob_api.layout import COLOCATED, DRIVER, DRIVER_RESOURCE, HEAD, ROLLOUT, TRAINER
from rljob_api.spec import Placement, RLJobSpec

PLACEMENT_TIMEOUT_S = 300.0
# How long a driver on a cluster waits for Ray to count the GPUs its pods requested.
GPU_WAIT_S = 60.0
STOP_TIMEOUT_S = 30.0  # what each engine and trainer rank gets to stop cleanly


@dataclass(frozen=True)
class RunOptions:
    workdir: Path
    max_steps: int | None = None
    ray_address: str | None = None  # a cluster this machine already is a node of
    join: str | None = None  # HOST:PORT of a head to join as a node of our own (pods)
    plan_only: bool = False  # place and report each process's devices, start none
    # When this run began (wall clock): the `rljob` process's start, so start-up is timed
    # from there (`rljob.reporting.startup`); None: when the attempt begins.
    started_at: float | None = None

    @property
    def on_cluster(self) -> bool:
        """Workers run in other pods: placement asks for the operator's Ray resources."""
        return bool(self.ray_address or self.join)


def worker_env(local: bool = True) -> dict[str, str]:
    """Environment of Ray workers: the run's peer key, and, on one machine, what this
    process imports (its sys.path, e.g. a source checkout); in pods each image has its own
    installation, which the driver's paths must not shadow."""
    quiet = {
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # The run's peer key (`rljob.weightsync.auth`): engines, sidecars, the publisher
        # and the rollout worker all use this driver's, derived from the job's Ray token in
        # pods, made for this run on one machine.
        env.PEER_KEY: peer_key(),
    }
    if not local:
        return quiet
    paths = [p for p in sys.path if p and Path(p).is_dir()]
    existing = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([*paths, *([existing] if existing else [])]),
            **quiet}


def attempt_number(environ: dict[str, str]) -> int:
    """Which attempt this run is: the operator's restart count when it created the driver
    (RLJOB_RESTARTS), 0 outside a cluster."""
    raw = environ.get(env.RESTARTS, "0")
    return int(raw) if raw.isdigit() else 0


def expected_group(role: str, colocated: bool) -> str:
    """The kind of pod an actor of `role` is meant to run on, on a cluster."""
    if role in (whereabouts.TRAINER, whereabouts.ENGINE, whereabouts.SIDECAR):
        if colocated:
            return COLOCATED
        return TRAINER if role == whereabouts.TRAINER else ROLLOUT
    return {whereabouts.ROLLOUT_WORKER: DRIVER, whereabouts.STORE: HEAD}[role]


def slot_options(pg: PlacementGroup, layout: Layout, devices: Devices, slot: int
                 ) -> dict[str, Any]:
    """Ray options of the trainer rank, engine or slot holder at `slot`: in that slot's
    bundle, with a share of its GPU (Ray shows the actor that GPU alone) or of its CPU."""
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=slot), **layout.actor_resources(slot, devices)}


def rendezvous_address() -> str:
    """`tcp://<this node's IP>:<free port>`, run where trainer rank 0 will run."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


def _ray_nodes(timeout_s: float) -> list[dict[str, Any]] | None:
    """`ray.nodes()`, or None when the GCS does not answer in time (its client retries for
    a minute when the head is gone, and a failing attempt must not hang on that)."""
    box: list[list[dict[str, Any]]] = []

    def ask() -> None:
        with contextlib.suppress(Exception):
            box.append(ray.nodes())

    thread = threading.Thread(target=ask, name="ray-nodes", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return box[0] if box else None


@dataclass(frozen=True)
class Roles:
    """The handles of one attempt's placed workers, each role as one object."""

    trainers: TrainerGroup
    engines: EngineGroup
    rollout: RolloutPipeline
    # Colocated on GPUs: trainer and engines take turns on the memory (`Job`'s turns).
    offload: bool
    # Each role's device; weight sync travels GPU to GPU only when both are GPUs.
    devices: Devices


class Cluster:
    """This attempt's Ray and everything it placed on it. What exists is filled in as it is
    placed, so that a failed start-up shuts down exactly what it started."""

    def __init__(self, options: RunOptions, on_ray_started: Callable[[], None],
                 startup: StartupClock | None = None) -> None:
        self.options = options
        self.startup = startup or StartupClock(time.time())
        # `ray.init` replaces the SIGTERM handler with an exit that saves nothing: the
        # driver's own handlers go back in through this.
        self.on_ray_started = on_ray_started
        self.started_ray = False
        self.node: ray_node.JoinedNode | None = None
        self.pg: PlacementGroup | None = None
        self.trainers: TrainerGroup | None = None
        self.engines: EngineGroup | None = None
        self.rollout: Any = None  # the RolloutWorker actor
        self.weight_sync: WeightSyncActors | None = None
        self.placed: list[Placed] = []  # where this attempt's actors run, from Ray
        self.spared: frozenset[str] = frozenset()  # roles whose lost pods end no attempt

    def start_ray(self, layout: Layout) -> None:
        runtime_env = {"env_vars": worker_env(local=not self.options.on_cluster)}
        if ray.is_initialized():
            return  # an embedding program (a test, a notebook) owns Ray
        if self.options.join:
            # This host becomes a Ray node first: a driver needs a local raylet (ray_node).
            try:
                self.node = ray_node.join(self.options.join)
            except (ray_node.JoinError, ValueError) as err:
                raise JobError(exits.FAILED, f"RayJoinFailed: {err}") from None
            ray.init(**self.node.init_kwargs(), runtime_env=runtime_env, log_to_driver=False)
            self.started_ray = True
            print(f"ray: joined {self.options.join} as node "
                  f"{ray.get_runtime_context().get_node_id()} (resource {DRIVER_RESOURCE}, "
                  f"temp dir {self.node.temp_dir})", flush=True)
        elif self.options.ray_address:
            ray.init(address=self.options.ray_address, runtime_env=runtime_env,
                     log_to_driver=False)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, layout.slots), include_dashboard=False,
                     runtime_env=runtime_env, log_to_driver=False)
            self.started_ray = True
        self.startup.mark("ray started")
        self.on_ray_started()

    def stop_stale_drivers(self) -> None:
        """Stop the Ray node of any other live driver of this cluster. The operator starts a
        driver only once the previous driver pod is gone, but a pod force-deleted from a node
        Kubernetes lost (a kubelet cut off from the API server) may still run there, still
        reach Ray and the checkpoint storage, and hold the trainers, the engines and the
        store's lease: its node is stopped (Ray's GCS stops the raylet and every process of
        the old driver's job with it), which frees them for this attempt."""
        own = ray.get_runtime_context().get_node_id()
        stale = [n for n in ray.nodes() if n.get("Alive") and n.get("NodeID") != own
                 and DRIVER_RESOURCE in (n.get("Resources") or {})]
        if not stale:
            return
        # Ray's own client of its GCS (what its autoscaler stops nodes with).
        gcs: Any = getattr(ray._private.worker.global_worker, "gcs_client")  # noqa: B009
        gcs.drain_nodes(node_ids=[bytes.fromhex(str(n["NodeID"])) for n in stale])
        for node in stale:
            print(f"ray: stopped the Ray node of an earlier driver "
                  f"({node.get('NodeManagerHostname')}, node {node['NodeID']}): a driver left "
                  "behind by a restart", flush=True)

    def choose_devices(self, spec: RLJobSpec) -> Devices:
        """Each role's device (`placement.choose_devices`) from the GPUs Ray reports. On a
        cluster the GPUs of pods Ray has not counted yet are waited for, up to GPU_WAIT_S;
        then, or at once on one machine, a shortfall stops the run with the fields to change
        (INVALID on one machine, which will not grow; FAILED on a cluster, where replaced
        pods may bring the GPUs)."""
        on_cluster = self.options.on_cluster
        deadline = time.monotonic() + (GPU_WAIT_S if on_cluster else 0.0)
        while True:
            gpus = float(ray.cluster_resources().get("GPU", 0.0))
            try:
                devices = choose_devices(spec, gpus, on_cluster)
            except DeviceError as err:
                if time.monotonic() >= deadline:
                    code = exits.FAILED if on_cluster else exits.INVALID
                    raise JobError(code, str(err)) from None
                time.sleep(2.0)
                continue
            if not on_cluster and gpus < 1 and spec.trainer.gpus_per_replica > 0:
                print("devices: no GPU on this machine: spec.trainer.gpusPerReplica and "
                      "spec.rollout.gpusPerEngine count CPU slots here", flush=True)
            print(devices.describe(spec.weight_sync.mode), flush=True)
            return devices

    def reserve(self, layout: Layout, devices: Devices) -> PlacementGroup:
        """The placement group of `layout`, each slot a GPU or a CPU as `devices` says, once
        Ray has placed every bundle (JobError after PLACEMENT_TIMEOUT_S)."""
        pg: PlacementGroup = placement_group(layout.bundles(devices, self.options.on_cluster),
                                             strategy="PACK")
        self.pg = pg
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            have = ray.cluster_resources()
            kind = "colocated" if layout.colocated else "disaggregated"
            raise JobError(exits.FAILED, (
                f"placement: {layout.slots} slots ({layout.gpus(devices)} of them GPUs, "
                f"{kind}) not available after {PLACEMENT_TIMEOUT_S:.0f}s; the cluster has "
                f"{have}. Lower trainer/rollout GPU counts or add nodes."))
        self.startup.mark("placement group ready")
        return pg

    def place(self, spec: RLJobSpec, model_dir: Path, settings: SyncSettings) -> Roles:
        """Every worker of the job on its slot of one placement group, and the weight-sync
        store; `settings.engine_port` is 0 on one machine (any free port) and the
        operator's engine port in pods. Every actor is created before any is waited for, so
        their processes start (each importing for seconds) side by side."""
        engine_port_base = settings.engine_port
        layout = plan(spec)
        self.start_ray(layout)
        devices = self.choose_devices(spec)
        try:
            actor = trainer_class(spec, devices.trainer_gpu)
        except ValueError as err:
            raise JobError(exits.INVALID, str(err)) from None
        on_cluster = self.options.on_cluster
        pg = self.reserve(layout, devices)
        # Colocated on GPUs: trainer and engines take turns on each GPU's memory.
        offload = layout.colocated and devices.trainer_gpu

        def at(slot: int) -> dict[str, Any]:
            return slot_options(pg, layout, devices, slot)

        engine_cls = ray.remote(EngineProcess)
        bind = "0.0.0.0" if on_cluster else "127.0.0.1"
        ports = [engine_port(spec, engine_port_base, s) for s in layout.engine_slots]
        if engine_port_base:
            nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
            clashes = port_clashes([nodes[s] for s in layout.engine_slots], ports)
            if clashes:
                raise JobError(exits.FAILED, "placement: " + "; ".join(clashes) + ": Ray "
                               "did not keep each pod's slots together; retry the job")
        holder_cls = ray.remote(SlotHolder)
        groups = layout.engine_slot_groups()

        def start_engine(i: int) -> tuple[Any, list[Any]]:
            holders: list[Any] = [holder_cls.options(**at(s)).remote() for s in groups[i][1:]]
            return engine_cls.options(**at(groups[i][0])).remote(
                spec.rollout.backend, str(model_dir), spec.model.dtype, devices.engine, "0",
                spec.rollout.gpus_per_engine, dict(spec.rollout.sglang_args), bind, ports[i],
                [h.where.remote() for h in holders], offload), holders

        # Stopped and killed on a failure from here on, whatever was started of them.
        self.engines = EngineGroup(start_engine)
        self.engines.start(len(groups))
        for i, engine in enumerate(self.engines.handles):
            self.startup.watch(f"{whereabouts.ENGINE}-{i}", engine)
        # Rank 0 hosts the trainer group's store, so its address comes from rank 0's node.
        init = "" if trainer_world(spec) == 1 else ray.get(
            ray.remote(rendezvous_address).options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=layout.trainer_slots[0]),
                num_cpus=0).remote())
        spec_json = spec.model_dump_json(by_alias=True)
        self.trainers = TrainerGroup.start(actor, at, list(layout.trainer_slots), spec_json,
                                           str(model_dir), init, devices.trainer)
        for i, trainer in enumerate(self.trainers.handles):
            self.startup.watch(f"{whereabouts.TRAINER}-{i}", trainer)
        # The weight-sync store, and a sidecar beside each engine (its engine's and the
        # store's addresses reach it when they come).
        self.weight_sync = WeightSyncActors(settings)
        self.weight_sync.start_store(in_driver=not on_cluster)
        if self.weight_sync.store is not None:
            self.startup.watch(whereabouts.STORE, self.weight_sync.store)
        else:
            self.startup.mark(f"{whereabouts.STORE} ready")
        self.weight_sync.start_sidecars(
            self.engines, ports, loopback=not on_cluster,
            placement=(pg, list(layout.engine_slots)), sync_on_gpu=devices.sync_on_gpu,
            engine_on_gpu=devices.engine_gpu)
        for i, sidecar in enumerate(self.weight_sync.sidecars):
            self.startup.watch(f"{whereabouts.SIDECAR}-{i}", sidecar)
        # The rollout worker (prompts, engine calls, reward hooks) holds no slot: on a
        # joined cluster it runs next to the driver, on the driver pod's own Ray node. It
        # is given the engines' addresses as they come (it waits for them itself).
        worker_cls = ray.remote(RolloutWorker)
        next_to_driver = {"resources": {DRIVER_RESOURCE: 0.01}} if self.node else {}
        self.rollout = worker_cls.options(num_cpus=0, **next_to_driver).remote(
            spec_json, str(model_dir), self.engines.addresses())
        self.startup.watch(whereabouts.ROLLOUT_WORKER, self.rollout)
        rollout = RolloutPipeline(self.rollout)
        problems = rollout.setup()
        if problems:
            raise JobError(exits.INVALID, "\n".join(problems))
        return Roles(self.trainers, self.engines, rollout, offload, devices)

    def plan_devices(self, spec: RLJobSpec) -> list[ProcessDevices]:
        """Every process of the job placed as `place` places them, each reporting the devices
        it would use (`rljob.cluster.device_plan`); nothing starts."""
        layout = plan(spec)
        self.start_ray(layout)
        devices = self.choose_devices(spec)
        pg = self.reserve(layout, devices)
        return device_plan.probe(pg, layout, devices, spec,
                                 lambda slot: slot_options(pg, layout, devices, slot))

    def store_address(self) -> tuple[str, int]:
        """Where the weight-sync store `place` started serves (on the Ray head, or from this
        process on one machine: `rljob.cluster.weight_sync`): the address trainer rank 0
        joins as the publisher."""
        assert self.weight_sync is not None, "placed first"
        return self.weight_sync.store_address()

    def check_sidecars(self) -> SidecarCheck:
        """Sidecars that died since the last check (`WeightSyncActors.check`); none before
        weight sync starts."""
        return self.weight_sync.check() if self.weight_sync is not None else SidecarCheck()

    def sidecars_registered(self, engines: list[int], timeout_s: float) -> bool:
        """Whether the sidecars of `engines` registered with the store within `timeout_s`."""
        return self.weight_sync is not None and self.weight_sync.wait_registered(
            engines, timeout_s)

    def report_placement(self, spec: RLJobSpec, roles: Roles) -> None:
        """Print where Ray runs every actor (whereabouts); on a cluster, stop if one is not on
        the kind of pod it is meant for."""
        weight_sync = self.weight_sync
        assert weight_sync is not None, "weight sync started first"
        # (role, index, an object ref to its whereabouts); the store's is its actor's answer
        # or this process's (`store_whereabouts`).
        actors: list[tuple[str, int, Any]] = [
            *((whereabouts.TRAINER, i, t.whereabouts.remote())
              for i, t in enumerate(roles.trainers.handles)),
            *((whereabouts.ENGINE, i, e.whereabouts.remote())
              for i, e in enumerate(roles.engines.handles)),
            (whereabouts.ROLLOUT_WORKER, 0, roles.rollout.rollout.whereabouts.remote()),
            (whereabouts.STORE, 0, weight_sync.store_whereabouts()),
            *((whereabouts.SIDECAR, i, s.whereabouts.remote())
              for i, s in enumerate(weight_sync.sidecars)),
        ]
        facts: list[Whereabouts] = ray.get([ref for _, _, ref in actors], timeout=120)
        # Each engine's node, kept by the engine group: a lost engine's recovery reads which
        # node it ran on.
        roles.engines.localities()
        # Kinds of pod exist on a cluster only; on one machine every actor shares one node.
        checked = self.options.on_cluster
        groups = whereabouts.node_groups(ray.nodes()) if checked else {}
        colocated = spec.placement == Placement.colocated
        # The rollout worker is pinned next to the driver only when the driver is a node.
        rows = [
            Placed(role, index, fact.node_id, fact.host, groups.get(fact.node_id, ""),
                   expected_group(role, colocated)
                   if checked and (role != whereabouts.ROLLOUT_WORKER or self.node) else None)
            for (role, index, _), fact in zip(actors, facts, strict=True)
        ]
        self.placed = rows
        # Engines lost under this attempt are replaced, not fatal: their pods never name what
        # ended it (and a replaced engine's old node stays dead in Ray's table).
        self.spared = (frozenset({whereabouts.ENGINE, whereabouts.SIDECAR})
                       if spec.replaces_engines() else frozenset())
        print(whereabouts.table(rows), flush=True)
        print(whereabouts.json_line(rows), flush=True)
        wrong = [f"{r.role}-{r.index} on {r.host} ({r.group or 'no rljob pod'}), meant for "
                 f"{r.expected}" for r in rows if not r.ok]
        if wrong:
            raise JobError(exits.FAILED, "PlacementMismatch: " + "; ".join(wrong))

    def lost_pods(self, wait_s: float) -> dict[str, str]:
        """Pods whose Ray node died under this attempt (pod → Ray's reason), waiting up to
        `wait_s` for Ray to notice. A worker's death shows first as an error in whichever
        call touched it (often a collective on a surviving peer); which pod went away is what
        the operator needs to name the cause (a lost node, a deleted pod). Empty on one
        machine, before placement, and when no node of the attempt died."""
        if not self.options.on_cluster or not self.placed:
            return {}
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            nodes = _ray_nodes(max(1.0, min(10.0, left)))
            dead = whereabouts.dead_hosts(
                [p for p in self.placed if p.role not in self.spared], nodes or [])
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(1.0)

    def shutdown(self, graceful: bool) -> None:
        """Stop sidecars, engines and trainers (only when `graceful`: otherwise, or when a
        signal arrives meanwhile, every actor is killed at once), free the slots; stop Ray
        if this run started it."""
        if graceful:
            try:
                if self.weight_sync is not None:
                    self.weight_sync.shutdown()
                if self.engines is not None:
                    self.engines.stop(STOP_TIMEOUT_S)
                if self.trainers is not None:
                    self.trainers.shutdown(STOP_TIMEOUT_S)
            except KeyboardInterrupt:
                pass  # a second signal (Aborted, or as ray.get re-raises it): kill the rest
        if self.weight_sync is not None:
            self.weight_sync.shutdown(graceful=False)
        if self.engines is not None:
            self.engines.kill()
        if self.trainers is not None:
            self.trainers.kill()
        if self.rollout is not None:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(self.rollout)
        if self.pg is not None:
            remove_placement_group(self.pg)
        if self.started_ray:
            ray.shutdown()
        if self.node is not None:
            self.node.stop()
