"""The slime-style loop: generate → reward → train → publish weights → checkpoint.

The driver owns no model and runs no user code: it places the workers (Ray placement
group), moves samples from the rollout worker to the trainer ranks, decides when to
publish and save, and reports. Everything it needs to continue after a crash — step,
weight version, data cursor, buffer, RNG — is in the latest verified checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rljob import exit_codes, metrics_log, ray_node, whereabouts
from rljob.checkpoint import (
    CheckpointConflict,
    CheckpointStore,
    LeaseHeld,
    LeaseLost,
    Verified,
)
from rljob.engine.launcher import EngineProcess
from rljob.engine.slots import SlotHolder
from rljob.placement import Layout, engine_port, plan, port_clashes, trainer_world
from rljob.progress_bar import ProgressBar
from rljob.report import Reporter
from rljob.rollout import RolloutWorker
from rljob.stop import StopSignals
from rljob.store_lease import writer_identity
from rljob.tasks import DatasetError, load_task
from rljob.tiny_model import BUILTIN_TINY, write_tiny
from rljob.trainer.select import trainer_class
from rljob.weightsync.publisher import NonFiniteWeights, SyncResult
from rljob.weightsync.wiring import SyncSettings, WeightSyncActors
from rljob.whereabouts import Placed
from rljob_api import env, exits
from rljob_api.layout import COLOCATED, DRIVER, DRIVER_RESOURCE, HEAD, ROLLOUT, TRAINER
from rljob_api.spec import RLJobSpec
from rljob_api.status import (
    CheckpointRecord,
    CheckpointStatus,
    Progress,
    ResumeReport,
    RuntimeFailure,
    RuntimeStop,
    timestamp,
)

EXIT_OK = exit_codes.OK
EXIT_FAILED = exit_codes.FAILED
EXIT_INVALID = exit_codes.INVALID
EXIT_NONFINITE = exit_codes.NONFINITE
EXIT_INTERRUPTED = exit_codes.INTERRUPTED
EXIT_TERMINATED = exit_codes.TERMINATED
PLACEMENT_TIMEOUT_S = 300.0
STATE_FILE = "state.json"
ROLLOUT_FILE = "rollout_state.json"
DRIVER_RNG_FILE = "driver_rng.pt"
WEIGHT_SYNC_LOG = "weight_sync.jsonl"
ENGINE_JOIN_TIMEOUT_S = 300.0
# How long a failed attempt waits for Ray to say whether a node of it died: Ray's GCS marks a
# node dead at once when its raylet exits, and after its health checks fail (about 15-30 s
# with Ray's defaults) when the node's host vanished.
NODE_DEATH_WAIT_S = 45.0


class JobError(Exception):
    """Stops the run with an exit code and a message (no traceback)."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


@dataclass
class LoopState:
    step: int = 0  # rollout steps completed
    train_step: int = 0
    samples: int = 0
    weight_version: int = 0
    skipped_steps: int = 0
    consecutive_nonfinite: int = 0


@dataclass(frozen=True)
class RunOptions:
    workdir: Path
    max_steps: int | None = None
    ray_address: str | None = None  # a cluster this machine already is a node of
    join: str | None = None  # HOST:PORT of a head to join as a node of our own (pods)

    @property
    def on_cluster(self) -> bool:
        """Workers run in other pods: placement asks for the operator's Ray resources."""
        return bool(self.ray_address or self.join)


def worker_env(local: bool = True) -> dict[str, str]:
    """Environment of Ray workers. On one machine they import what this process imports
    (its sys.path, e.g. a source checkout); in pods each image has its own installation,
    which the driver's paths must not shadow."""
    quiet = {
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
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


def _mtime(path: Path) -> str:
    return timestamp(datetime.fromtimestamp(path.stat().st_mtime, UTC))


def rendezvous_address() -> str:
    """`tcp://<this node's IP>:<free port>`, run where trainer rank 0 will run."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


class Job:
    def __init__(self, name: str, spec: RLJobSpec, options: RunOptions, reporter: Reporter):
        self.name = name
        self.spec = spec
        self.options = options
        self.reporter = reporter
        self.workdir = options.workdir
        self.store = CheckpointStore(self.workdir / "checkpoints", spec.checkpoint.keep_last,
                                     writer=writer_identity(attempt_number(dict(os.environ))))
        self.metrics_path = self.workdir / metrics_log.METRICS_FILE
        self.state = LoopState()
        self.pg: PlacementGroup | None = None
        self.engines: list[Any] = []
        self.slot_holders: list[Any] = []  # the further slots of multi-GPU engines
        self.trainers: list[Any] = []
        self.rollout: Any = None
        self.urls: list[str] = []
        self.started_ray = False
        self.node: ray_node.JoinedNode | None = None
        self.sync_settings = SyncSettings()
        self.weight_sync = WeightSyncActors(self.sync_settings)
        self.stop = StopSignals()
        self.loop_started = False
        self.checkpoint_step: int | None = None  # the latest verified one: resumed or saved
        self.placed: list[Placed] = []  # where this attempt's actors run, from Ray
        # Colocated on GPUs: trainer and engines take turns on the memory (`one_step`).
        self.offload = False

    # ---- setup -------------------------------------------------------------------------

    def model_dir(self) -> Path:
        spec = self.spec
        if spec.model.source != BUILTIN_TINY:
            source = Path(spec.model.source)
            if not (source / "config.json").is_file():
                raise JobError(EXIT_INVALID, f"spec.model.source: {source} is not an HF model "
                               "directory (no config.json); give one or use builtin:tiny")
            return source
        data = spec.data
        try:
            alphabet = load_task(data.dataset, data.prompt_key, data.label_key).alphabet
            if data.eval_dataset:
                alphabet += load_task(data.eval_dataset, data.prompt_key, data.label_key).alphabet
        except DatasetError as err:
            raise JobError(EXIT_INVALID, str(err)) from None
        try:
            return write_tiny(self.workdir / "model", spec.model.tiny, alphabet,
                              spec.algorithm.seed, spec.model.dtype)
        except ValueError as err:
            raise JobError(EXIT_INVALID, str(err)) from None

    def start_ray(self, layout: Layout) -> None:
        runtime_env = {"env_vars": worker_env(local=not self.options.on_cluster)}
        if ray.is_initialized():
            return  # an embedding program (a test, a notebook) owns Ray
        if self.options.join:
            # This host becomes a Ray node first: a driver needs a local raylet (ray_node).
            try:
                self.node = ray_node.join(self.options.join)
            except (ray_node.JoinError, ValueError) as err:
                raise JobError(EXIT_FAILED, f"RayJoinFailed: {err}") from None
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
        self.stop.install()  # ray.init replaced the SIGTERM handler with an exit that saves nothing

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

    def place(self, model_dir: Path) -> None:
        spec = self.spec
        layout = plan(spec)
        self.start_ray(layout)
        use_gpu = (spec.trainer.gpus_per_replica > 0
                   and ray.cluster_resources().get("GPU", 0) >= layout.slots)
        on_cluster = self.options.on_cluster
        pg = self.pg = placement_group(layout.bundles(use_gpu, on_cluster), strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            have = ray.cluster_resources()
            raise JobError(EXIT_FAILED, (
                f"placement: {layout.slots} slots of {'GPU' if use_gpu else 'CPU'} "
                f"({spec.placement}) not available after {PLACEMENT_TIMEOUT_S:.0f}s; the "
                f"cluster has {have}. Lower trainer/rollout GPU counts or add nodes."))
        device = "cuda" if use_gpu else "cpu"
        self.offload = use_gpu and spec.placement == "colocated"
        res = {"num_gpus": layout.share, "num_cpus": 0} if use_gpu else {
            "num_cpus": layout.share}

        def at(slot: int) -> dict[str, Any]:
            return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=slot), **res}

        engine_cls = ray.remote(EngineProcess)
        bind = "0.0.0.0" if on_cluster else "127.0.0.1"
        ports = [engine_port(spec, self.sync_settings.engine_port, s)
                 for s in layout.engine_slots]
        if self.sync_settings.engine_port:
            nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
            clashes = port_clashes([nodes[s] for s in layout.engine_slots], ports)
            if clashes:
                raise JobError(EXIT_FAILED, "placement: " + "; ".join(clashes) + ": Ray did "
                               "not keep each pod's slots together; retry the job")
        holder_cls = ray.remote(SlotHolder)
        groups = layout.engine_slot_groups()
        holders: list[list[Any]] = [[holder_cls.options(**at(s)).remote() for s in group[1:]]
                                    for group in groups]
        self.slot_holders = [h for hs in holders for h in hs]
        self.engines = [
            engine_cls.options(**at(group[0])).remote(
                spec.rollout.backend, str(model_dir), spec.model.dtype, device, "0",
                spec.rollout.gpus_per_engine, dict(spec.rollout.sglang_args), bind, port,
                ray.get([h.where.remote() for h in hs]), self.offload)
            for group, hs, port in zip(groups, holders, ports, strict=True)
        ]
        world = trainer_world(spec)
        # Rank 0 hosts the trainer group's store, so its address comes from rank 0's node.
        init = "" if world == 1 else ray.get(ray.remote(rendezvous_address).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=layout.trainer_slots[0]), num_cpus=0).remote())
        try:
            trainer_cls: Any = ray.remote(trainer_class(spec, use_gpu))
        except ValueError as err:
            raise JobError(EXIT_INVALID, str(err)) from None
        spec_json = spec.model_dump_json(by_alias=True)
        self.trainers = [
            trainer_cls.options(**at(slot)).remote(spec_json, str(model_dir), rank, world, init,
                                                   device)
            for rank, slot in enumerate(layout.trainer_slots)
        ]
        self.urls = ray.get([e.address.remote() for e in self.engines])
        # The rollout worker (prompts, engine calls, reward hooks) holds no slot: on a
        # joined cluster it runs next to the driver, on the driver pod's own Ray node.
        worker_cls = ray.remote(RolloutWorker)
        next_to_driver = {"resources": {DRIVER_RESOURCE: 0.01}} if self.node else {}
        self.rollout = worker_cls.options(num_cpus=0, **next_to_driver).remote(
            spec_json, str(model_dir), self.urls)
        problems = ray.get(self.rollout.setup.remote())
        if problems:
            raise JobError(EXIT_INVALID, "\n".join(problems))

    # ---- checkpoints -------------------------------------------------------------------

    def take_store(self) -> None:
        """Become the checkpoint store's only writer before reading or writing it: a driver
        of an earlier attempt that still runs is waited for, then this attempt gives up
        (retryable: the next attempt finds the store free)."""
        try:
            self.store.acquire(on_wait=lambda why: print(f"checkpoints: {why}",
                                                         file=sys.stderr, flush=True))
        except LeaseHeld as err:
            raise JobError(EXIT_FAILED, f"CheckpointStoreBusy: {err}") from None

    def resume(self) -> Verified | None:
        latest = self.store.latest()
        if latest is None:
            return None
        ray.get([t.load.remote(str(latest.path)) for t in self.trainers])
        self.state = LoopState(**json.loads((latest.path / STATE_FILE).read_text()))
        ray.get(self.rollout.load.remote(json.loads((latest.path / ROLLOUT_FILE).read_text())))
        rng = torch.load(latest.path / DRIVER_RNG_FILE, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        metrics_log.keep_until(self.metrics_path, self.state.step)
        self.checkpoint_step = latest.step
        return latest

    def save(self) -> Verified:
        tmp = self.store.begin(self.state.step)
        hf = self.spec.checkpoint.format == "hf"
        ray.get([t.save.remote(str(tmp), hf) for t in self.trainers])
        (tmp / STATE_FILE).write_text(json.dumps(asdict(self.state), indent=1))
        (tmp / ROLLOUT_FILE).write_text(json.dumps(ray.get(self.rollout.state.remote())))
        torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state()}, tmp / DRIVER_RNG_FILE)
        verified = self.store.commit(tmp, self.state.step)
        self.checkpoint_step = verified.step
        history = [CheckpointRecord(step=s, path=str(p), saved_at=_mtime(p))
                   for s, p in self.store.published()[-16:]]
        self.reporter.checkpoint(CheckpointStatus(
            step=verified.step, path=str(verified.path), saved_at=timestamp(),
            size_bytes=verified.size_bytes, checksum=verified.checksum, verified=True,
            history=history))
        return verified

    def save_evidence(self, samples: list[dict[str, Any]], reason: str) -> Path:
        """The offending batch and the trainer state, to reproduce a non-finite stop (only by
        the store's writer: a driver left behind writes nothing, nor the failure after it)."""
        self.store.lease.check()
        target = self.workdir / "nonfinite" / f"step_{self.state.step + 1:08d}"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        (target / "batch.json").write_text(json.dumps(samples, default=str))
        (target / "state.json").write_text(json.dumps({**asdict(self.state), "reason": reason}))
        ray.get([t.save.remote(str(target), False) for t in self.trainers])
        return target

    # ---- the loop ----------------------------------------------------------------------

    def start_weight_sync(self) -> None:
        """The store on the Ray head, a sidecar per engine (unless the pods run them), and
        trainer rank 0 joined as the publisher; versions continue from the checkpoint."""
        store = self.weight_sync.start_store()
        assert self.pg is not None
        self.weight_sync.start_sidecars(self.engines, self.urls, store,
                                        loopback=not self.options.on_cluster,
                                        placement=(self.pg, list(plan(self.spec).engine_slots)))
        # Every actor exists now: show where, before waiting on anything they must do.
        self.report_placement()
        trainer = self.trainers[0]
        ray.get(trainer.set_publisher.remote(*store, str(self.workdir / "weights"),
                                             self.state.weight_version))
        try:
            ray.get(trainer.wait_for_engines.remote(len(self.engines), ENGINE_JOIN_TIMEOUT_S))
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, TimeoutError):
                raise JobError(EXIT_FAILED, f"WeightSyncFailed: {err.cause}; every engine needs "
                               "its weight-sync sidecar (in a pod: a weight-sync container)"
                               ) from None
            raise

    def publish(self, again: bool = False) -> None:
        """Deliver `state.weight_version` to every engine, or stop the run.

        Engines that reject a version keep serving the previous one and are resynced by
        the publisher within the deadline; one still stale after that fails the run
        (retryable: a restart resyncs every engine from the checkpoint). `again` sends the
        version to engines that already had it (they dropped their weights).
        """
        version = self.state.weight_version
        try:
            result: SyncResult = ray.get(self.trainers[0].publish.remote(version, again))
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, NonFiniteWeights):
                message = f"{err.cause}; nothing was sent to the engines"
                self.store.lease.check()  # a driver left behind reports no terminal failure
                self.fail("NonFiniteWeights", message, retryable=False)
                raise JobError(EXIT_NONFINITE, f"NonFiniteWeights: {message}") from None
            raise
        metrics_log.append(self.workdir / WEIGHT_SYNC_LOG, {
            "version": result.version, "acked": result.acked, "stale": result.stale,
            "attempts": result.attempts, "seconds": result.seconds,
            "bytes_per_engine": result.bytes_per_engine, "rejections": list(result.rejections),
        })
        for rejection in result.rejections:
            print(f"weight sync: version {version}: {rejection}", file=sys.stderr, flush=True)
        if result.stale:
            reasons = "; ".join(f"{name}: {why}" for name, why in sorted(result.stale.items()))
            raise JobError(EXIT_FAILED, f"WeightSyncFailed: engines did not install weight "
                           f"version {version}: {reasons}")

    def report_resume(self, loaded: Verified | None) -> None:
        """Tell the RLJob what this attempt loaded (the operator derives resumedFromStep and
        lostSteps from it): the checkpoint's step, path and verified manifest digest, or that
        there was none and the attempt starts at step 0."""
        self.reporter.resumed(ResumeReport(
            attempt=attempt_number(dict(os.environ)), found=loaded is not None,
            step=self.state.step, path=str(loaded.path) if loaded else None,
            checksum=loaded.checksum if loaded else None, at=timestamp(),
            driver_pod_uid=os.environ.get(env.POD_UID) or None))

    def report_placement(self) -> None:
        """Print where Ray runs every actor (whereabouts); on a cluster, stop if one is not on
        the kind of pod it is meant for."""
        actors: list[tuple[str, int, Any]] = [
            *((whereabouts.TRAINER, i, t) for i, t in enumerate(self.trainers)),
            *((whereabouts.ENGINE, i, e) for i, e in enumerate(self.engines)),
            (whereabouts.ROLLOUT_WORKER, 0, self.rollout),
            (whereabouts.STORE, 0, self.weight_sync.store),
            *((whereabouts.SIDECAR, i, s) for i, s in enumerate(self.weight_sync.sidecars)),
        ]
        facts = ray.get([handle.whereabouts.remote() for _, _, handle in actors], timeout=120)
        # Kinds of pod exist on a cluster only; on one machine every actor shares one node.
        checked = self.options.on_cluster
        groups = whereabouts.node_groups(ray.nodes()) if checked else {}
        colocated = self.spec.placement == "colocated"
        # The rollout worker is pinned next to the driver only when the driver is a node.
        rows = [
            Placed(role, index, fact["node_id"], fact["host"], groups.get(fact["node_id"], ""),
                   expected_group(role, colocated)
                   if checked and (role != whereabouts.ROLLOUT_WORKER or self.node) else None)
            for (role, index, _), fact in zip(actors, facts, strict=True)
        ]
        self.placed = rows
        print(whereabouts.table(rows), flush=True)
        print(whereabouts.json_line(rows), flush=True)
        wrong = [f"{r.role}-{r.index} on {r.host} ({r.group or 'no rljob pod'}), meant for "
                 f"{r.expected}" for r in rows if not r.ok]
        if wrong:
            raise JobError(EXIT_FAILED, "PlacementMismatch: " + "; ".join(wrong))

    def fail(self, reason: str, message: str, retryable: bool,
             lost_pods: list[str] | None = None) -> None:
        self.reporter.failure(RuntimeFailure(reason=reason, message=message, retryable=retryable,
                                             step=self.state.step, time=timestamp(),
                                             lost_pods=lost_pods or []))

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
            dead = whereabouts.dead_hosts(self.placed, nodes or [])
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(1.0)

    def report_stop(self, aborted: bool) -> None:
        """Tell the RLJob this attempt stopped on a signal (not a failure): where it was,
        the checkpoint the next attempt resumes from, and whether it stopped at once."""
        signum = self.stop.signum or 0
        checkpoint = self.checkpoint_step
        if checkpoint is None:  # stopped before it resumed: what the store has published
            published = self.store.published()
            checkpoint = published[-1][0] if published else None
        self.reporter.stopped(RuntimeStop(
            signal=self.stop.name, attempt=attempt_number(dict(os.environ)),
            step=self.state.step, checkpoint_step=checkpoint, aborted=aborted,
            exit_code=exit_codes.for_signal(signum), time=timestamp()))

    def run(self) -> int:
        try:  # set by the operator on a cluster; defaults for `rljob run` on one machine
            self.sync_settings = SyncSettings.from_env(os.environ)
        except ValueError as err:
            raise JobError(EXIT_INVALID, str(err)) from None
        self.weight_sync = WeightSyncActors(self.sync_settings)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.options.join:
            # On a cluster this driver's Ray node comes first: a driver left behind by a
            # restart is stopped through Ray before this one waits for the store it holds.
            self.start_ray(plan(self.spec))
            self.stop_stale_drivers()
        self.take_store()
        model_dir = self.model_dir()
        self.place(model_dir)
        resumed = self.resume()
        if resumed is not None:
            print(f"resumed from {resumed.path} (step {resumed.step}, weight version "
                  f"{self.state.weight_version})", file=sys.stderr, flush=True)
        self.report_resume(resumed)
        self.start_weight_sync()
        self.publish()
        algo = self.spec.algorithm
        end = algo.total_steps
        if self.options.max_steps is not None:
            end = min(end, self.state.step + self.options.max_steps)
        saved_at = self.state.step if resumed is not None else -1
        bar = ProgressBar(self.state.step, end)
        started = time.monotonic()
        # A first signal from here on lets the step in progress finish and be saved.
        self.loop_started = True
        with self.stop.deferred():
            while self.state.step < end and not self.stop.requested:
                self.one_step(bar)
                if self.state.step % self.spec.checkpoint.interval == 0 or self.state.step == end:
                    self.save()
                    saved_at = self.state.step
            bar.close()
            if saved_at != self.state.step:
                self.save()
        code = EXIT_OK
        if self.stop.requested and self.state.step < end:  # stopped before its end: not done
            code = exit_codes.for_signal(self.stop.signum or 0)
            self.report_stop(aborted=False)
        rows = metrics_log.read(self.metrics_path)
        if rows:
            metrics_log.plot(rows, self.workdir / metrics_log.PLOT_FILE)
        self.summary(rows, time.monotonic() - started, code)
        return code

    def one_step(self, bar: ProgressBar) -> None:
        step = self.state.step
        t0 = time.monotonic()
        if self.offload:  # the trainers' parameters, gradients and optimizer state leave
            ray.get([t.offload.remote() for t in self.trainers])
        samples, rstats = ray.get(self.rollout.generate.remote(step))
        t1 = time.monotonic()
        if self.offload:  # the engines' weights and caches leave; the trainers come back
            ray.get([e.release_memory.remote() for e in self.engines])
        results = ray.get([t.train.remote(samples, step == 0) for t in self.trainers])
        weights_kept = True
        if self.offload:
            weights_kept = all(ray.get([e.resume_memory.remote() for e in self.engines]))
        t2 = time.monotonic()
        m = results[0]
        for skipped in m["step_skipped"]:
            self.state.consecutive_nonfinite = (
                self.state.consecutive_nonfinite + 1 if skipped else 0)
        self.state.skipped_steps += m["skipped_steps"]
        self.state.train_step += m["optimizer_steps"]
        limit = self.spec.algorithm.max_consecutive_nonfinite
        if self.state.consecutive_nonfinite >= limit:
            reasons = "; ".join(m["nonfinite"])
            where = self.save_evidence(samples, reasons)
            message = (f"{self.state.consecutive_nonfinite} optimizer steps in a row had "
                       f"non-finite loss or gradients ({reasons}); batch and state saved in "
                       f"{where}")
            self.fail("NonFiniteLoss", message, retryable=False)
            raise JobError(EXIT_NONFINITE, f"NonFiniteLoss: {message}")
        bad = ray.get(self.trainers[0].nonfinite_weights.remote())
        if bad:
            where = self.save_evidence(samples, f"non-finite weights {bad[:5]}")
            message = f"weights became non-finite ({', '.join(bad[:5])}); not sent to engines; " \
                      f"evidence in {where}"
            self.fail("NonFiniteWeights", message, retryable=False)
            raise JobError(EXIT_NONFINITE, f"NonFiniteWeights: {message}")
        self.state.step += 1
        self.state.samples += len(samples)
        if m["optimizer_steps"]:
            self.state.weight_version += 1
            self.publish()
        elif not weights_kept:  # SGLang dropped its released weights: the same version again
            self.publish(again=True)
        row: dict[str, Any] = {
            "step": self.state.step,
            **{k: v for k, v in m.items() if k not in ("step_skipped", "nonfinite", "skipped")},
            "tokens_per_second": rstats["tokens_per_second"],
            "rollout_seconds": rstats["rollout_seconds"],
            "train_seconds": t2 - t1,
            "step_seconds": time.monotonic() - t0,
            "weight_version": self.state.weight_version,
            "total_skipped_steps": self.state.skipped_steps,
        }
        interval = self.spec.data.eval_interval
        if self.spec.data.eval_dataset and interval and self.state.step % interval == 0:
            row["eval_reward"] = ray.get(self.rollout.evaluate.remote())
        # A driver left behind by a restart (a partitioned node) learns here that another
        # took the store over, and stops before it writes metrics or status again.
        self.store.lease.check()
        metrics_log.append(self.metrics_path, row)
        self.reporter.progress(Progress(
            rollout_step=self.state.step, train_step=self.state.train_step,
            total_steps=self.spec.algorithm.total_steps, samples=self.state.samples,
            mean_reward=m["reward"], tokens_per_second=rstats["tokens_per_second"],
            weight_version=self.state.weight_version, skipped_steps=self.state.skipped_steps,
            updated_at=timestamp()))
        bar.update(self.state.step, m["reward"], rstats["tokens_per_second"])

    def summary(self, rows: list[dict[str, Any]], seconds: float, code: int) -> None:
        rewards = [float(r["reward"]) for r in rows if isinstance(r.get("reward"), int | float)]
        head = rewards[:5]
        tail = rewards[-5:]
        latest = self.store.latest()
        lines = [
            "done" if code == EXIT_OK else
            "interrupted; state saved" if code == EXIT_INTERRUPTED else
            f"stopped by {self.stop.name}; state saved",
            f"  steps        {self.state.step}/{self.spec.algorithm.total_steps} "
            f"({self.state.train_step} optimizer steps, {self.state.skipped_steps} skipped)",
        ]
        if rewards:
            lines.append(f"  mean reward  first {len(head)} steps {np.mean(head):.3f} → "
                         f"last {len(tail)} steps {np.mean(tail):.3f}")
        lines += [
            f"  wall time    {seconds:.1f}s this run",
            f"  checkpoint   {latest.path if latest else '-'}",
            f"  metrics      {self.metrics_path}",
            f"  curves       {self.workdir / metrics_log.PLOT_FILE}",
        ]
        print("\n".join(lines), flush=True)

    def shutdown(self) -> None:
        """Stop sidecars, engines and trainers, free the slots; stop Ray if this run started it;
        then let the next writer of the checkpoint store in. After an abort (or when a signal
        arrives meanwhile) nothing is waited for: every actor is killed at once."""
        try:
            if not self.stop.aborted:
                try:
                    self.weight_sync.shutdown()
                    for handle, method in [*((e, "stop") for e in self.engines),
                                           *((t, "shutdown") for t in self.trainers)]:
                        with contextlib.suppress(ray.exceptions.RayError):  # dead: nothing to stop
                            ray.get(getattr(handle, method).remote(), timeout=30)
                except KeyboardInterrupt:
                    pass  # a second signal (Aborted, or as ray.get re-raises it): kill the rest
            self.weight_sync.shutdown(graceful=False)
            for handle in [*self.engines, *self.slot_holders, *self.trainers,
                           *([self.rollout] if self.rollout else [])]:
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.kill(handle)
            if self.pg is not None:
                remove_placement_group(self.pg)
            if self.started_ray:
                ray.shutdown()
            if self.node is not None:
                self.node.stop()
        finally:
            self.store.release()


def _run(job: Job) -> int:
    """`job.run()`, its failures and stops turned into exit codes and status reports."""
    try:
        return job.run()
    except KeyboardInterrupt:  # Aborted, or what ray.get raises in its place
        if not job.stop.aborted:
            # Ctrl-C where the stop handler could not be installed (not the main thread):
            # nothing saved here; the latest checkpoint, if any, is untouched.
            print("rljob run: interrupted; nothing was saved", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        # During start-up, or a second signal: the step and save in progress are abandoned;
        # published checkpoints are whole (a save appears only by its final rename).
        if job.loop_started:
            what = (f"at once; the next run resumes from the checkpoint of step "
                    f"{job.checkpoint_step}" if job.checkpoint_step is not None else
                    "at once; no checkpoint was saved yet")
        else:
            what = "during start-up; nothing was trained"
        print(f"rljob run: stopped by {job.stop.name} {what}", file=sys.stderr, flush=True)
        job.report_stop(aborted=True)
        return exit_codes.for_signal(job.stop.signum or 0)
    except JobError as err:
        print(f"rljob run: {err}", file=sys.stderr, flush=True)
        if err.code == EXIT_FAILED:
            job.fail(str(err).split(":", 1)[0], str(err), retryable=True)
        elif err.code == EXIT_INVALID:
            # The status says why (the field and the fix), not only the exit code.
            job.fail(exits.TERMINAL_REASONS[EXIT_INVALID], str(err), retryable=False)
        return err.code
    except (LeaseLost, CheckpointConflict) as err:
        # Another driver of this job owns the checkpoint store, and the job's status with it:
        # this one stops without publishing or reporting anything more (a report queued
        # before it lost the store may still be written).
        print(f"rljob run: CheckpointStoreLost: {err}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except ray.exceptions.RayError as err:
        # A worker or engine died or raised: a restart from the checkpoint may help.
        print(f"rljob run: a worker failed: {err}", file=sys.stderr, flush=True)
        # A stop (SIGTERM) takes compute away too: no time to spend asking Ray what died.
        lost = {} if job.stop.requested else job.lost_pods(NODE_DEATH_WAIT_S)
        if lost:
            pods = "; ".join(f"{pod} ({why})" for pod, why in sorted(lost.items()))
            print(f"rljob run: Ray lost the node of {pods}", file=sys.stderr, flush=True)
            job.fail("WorkerLost", f"Ray lost the node of {pods}; first error: {str(err)[:3000]}",
                     retryable=True, lost_pods=sorted(lost))
        else:
            job.fail("WorkerFailed", str(err)[:4000], retryable=True)
        return EXIT_FAILED
    except OSError as err:
        # Storage failed under the run (full, read-only, gone), or another I/O error reached
        # the loop: published checkpoints are whole, so a restart resumes from the latest.
        name = str(err.filename or "")
        in_workdir = bool(name) and Path(name).resolve().is_relative_to(job.workdir.resolve())
        reason = "StorageError" if in_workdir else "IOError"
        what = (f"a file operation in the workdir {job.workdir} failed" if in_workdir
                else "an I/O operation failed")
        where = f" ({name})" if name else ""
        message = f"{what}: {err.strerror or err}{where}; published checkpoints are unaffected"
        print(f"rljob run: {reason}: {message}", file=sys.stderr, flush=True)
        job.fail(reason, message, retryable=True)
        return EXIT_FAILED


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


def run_job(name: str, spec: RLJobSpec, options: RunOptions, reporter: Reporter) -> int:
    """Run `spec` to its end (or max_steps); return the process exit code (rljob.exit_codes).
    SIGTERM and SIGINT stop it as `rljob.stop` describes."""
    try:
        job = Job(name, spec, options, reporter)
    except OSError as err:
        # The workdir (on a cluster: the checkpoint volume) cannot be written: a restart on
        # the same volume cannot help, so the reason is reported as not retryable.
        message = (f"the workdir {options.workdir} cannot be written ({err.strerror}: "
                   f"{err.filename}); on a cluster, spec.checkpoint's volume must be writable "
                   "by the pods' user")
        print(f"rljob run: {message}", file=sys.stderr, flush=True)
        reporter.failure(RuntimeFailure(reason="WorkdirNotWritable", message=message,
                                        retryable=False, step=0, time=timestamp()))
        return EXIT_INVALID
    with job.stop.installed():
        try:
            try:
                return _run(job)
            finally:
                job.shutdown()
        except KeyboardInterrupt:
            # A first signal while a failure was being handled, or during the shutdown.
            return exit_codes.for_signal(job.stop.signum or signal.SIGINT)
