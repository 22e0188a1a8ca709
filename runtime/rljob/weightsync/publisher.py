"""The trainer's side of weight sync: publish version v to every engine, wait for their acks.

`publish(version, named_tensors)` scans the weights, announces the bucket layout, sends the
buckets (one broadcast group, or a safetensors directory), publishes the digest, and waits
until every targeted engine acknowledged or the deadline passed. Engines that rejected the
version, died, or stayed silent are reported as stale with the reason; within the same
deadline they get another full delivery (from disk when a disk directory is configured), and
`resync` tries again later, e.g. once a lost engine came back.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from rljob.weightsync import disk
from rljob.weightsync.auth import SignedStore, UnauthenticatedValue, peer_key
from rljob.weightsync.group import BroadcastGroup, open_store, poll_key, rank_device
from rljob.weightsync.nonfinite import nonfinite_report
from rljob.weightsync.protocol import (
    Announcement,
    BucketMeta,
    Keys,
    Registration,
    Transport,
    bucket_digest,
    decode_ack,
    decode_registration,
    encode,
    gpu_uuid,
    layout_to_json,
    pack_bucket,
    plan_buckets,
    version_digest,
)
from rljob.weightsync.results import NonFiniteWeights, SyncResult
from rljob.weightsync.wire import encode_named_tensors
from rljob_api.spec import WeightSyncMode, WeightSyncSpec

log = logging.getLogger(__name__)


@dataclass
class EngineRecord:
    registration: Registration
    acked_version: int | None = None
    stale_reason: str = ""


@dataclass(frozen=True)
class PublisherConfig:
    port: int
    # Empty: this publisher hosts the coordination store. Otherwise the store runs elsewhere
    # (e.g. where every pod can reach it) and the publisher joins it as a client.
    store_host: str = ""
    transport: Transport = "broadcast"
    backend: str = "gloo"
    # Where the packed buckets live: the CPU for gloo, this rank's own GPU for NCCL, so the
    # group never sees a tensor anywhere else whatever device the weights come from.
    device: str = "cpu"
    bucket_bytes: int = 512 << 20
    ack_timeout_s: float = 300.0
    verify_digest: bool = True
    scan_nonfinite: bool = True
    disk_dir: Path | None = None
    keep_disk_versions: int = 2
    join_timeout_s: float = 120.0
    probe_timeout_s: float = 2.0
    # How long a sidecar may go unanswering before its engine counts as unreachable: one slow
    # answer on a loaded node is not a lost engine.
    probe_grace_s: float = 10.0
    max_attempts: int = 2
    config_json: str | None = None

    @classmethod
    def from_spec(
        cls,
        spec: WeightSyncSpec,
        *,
        port: int,
        backend: str,
        device: str,
        disk_dir: Path | None,
        store_host: str = "",
        config_json: str | None = None,
    ) -> PublisherConfig:
        """The publisher settings `spec.weightSync` asks for."""
        return cls(
            port=port,
            store_host=store_host,
            config_json=config_json,
            transport="disk" if spec.mode == WeightSyncMode.disk.value else "broadcast",
            backend=backend,
            device=device,
            bucket_bytes=spec.bucket_size_mb << 20,
            ack_timeout_s=float(spec.ack_timeout_seconds),
            verify_digest=spec.verify_digest,
            scan_nonfinite=spec.scan_nonfinite,
            disk_dir=disk_dir,
        )


def _described(err: BaseException) -> str:
    """An exception as the reason an engine stayed stale: its type and its message."""
    return f"{type(err).__name__}: {err}"


class WeightPublisher:
    """Rank 0 of the broadcast group; hosts the coordination store unless told where it is."""

    def __init__(self, config: PublisherConfig, *, start_version: int = 0,
                 key: str | None = None) -> None:
        if config.transport == "disk" and config.disk_dir is None:
            raise ValueError("weightSync.mode disk needs a directory for the versions (disk_dir)")
        self.device = rank_device(config.device)
        if (config.backend == "nccl") != (self.device.type == "cuda"):
            raise ValueError(
                f"weight-sync backend {config.backend} cannot stage on {self.device}: NCCL "
                "needs this rank's GPU, gloo the CPU"
            )
        self.gpu = gpu_uuid(self.device)
        self.config = config
        self.version = start_version
        hosted = not config.store_host
        # Every value is signed with the job's peer key, and every one read is checked
        # before it is parsed (`rljob.weightsync.auth`).
        self._store = SignedStore(open_store(
            "0.0.0.0" if hosted else config.store_host,
            config.port,
            server=hosted,
            timeout_s=config.join_timeout_s,
        ), peer_key() if key is None else key)
        self.port = int(self._store.port)
        self.incarnation = uuid.uuid4().hex
        self._store.set(Keys.trainer, self.incarnation)
        self._disk_ready: Path | None = None  # the disk_dir cleared of earlier attempts
        self._store.add(Keys.members, 0)
        self._members_seen = 0
        self._engines: dict[str, EngineRecord] = {}
        # A store that outlived an earlier publisher keeps its announcements: continue after.
        self._seq = (
            int(self._store.get(Keys.latest_seq)) if self._store.check([Keys.latest_seq]) else 0
        )
        self._epoch = self._seq  # epochs never outnumber announcements: prefixes stay fresh
        self._group: BroadcastGroup | None = None
        self._group_roster: dict[str, str] = {}
        self._send_buffers: dict[int, tuple[BucketMeta, torch.Tensor]] = {}

    # --- membership -------------------------------------------------------------------------

    def _refresh_members(self) -> None:
        count = int(self._store.add(Keys.members, 0))
        for i in range(self._members_seen, count):
            try:
                reg = decode_registration(self._store.get(Keys.member(i)))
            except UnauthenticatedValue as err:
                log.warning("ignoring registration %d: %s", i, err)
                continue
            old = self._engines.get(reg.engine)
            if old is None or old.registration.incarnation != reg.incarnation:
                self._engines[reg.engine] = EngineRecord(reg)
        self._members_seen = count

    def engines(self) -> dict[str, EngineRecord]:
        self._refresh_members()
        return dict(self._engines)

    def wait_for_engines(self, count: int, timeout_s: float) -> list[str]:
        """Block until `count` distinct engines registered, or raise TimeoutError naming them."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._refresh_members()
            if len(self._engines) >= count:
                return sorted(self._engines)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{len(self._engines)} of {count} rollout engines joined weight sync within "
                    f"{timeout_s:.0f}s: {sorted(self._engines)}"
                )
            poll_key(self._store, Keys.member(self._members_seen), min(1.0, remaining))

    def _probe(self, names: Iterable[str]) -> dict[str, bool]:
        """Which of these engines' sidecars answer their own /health (the weight-sync
        sidecar's HTTP server, the address it registered): a lost sidecar is not waited for.
        No engine is called here; engines are spoken to through `rljob.engine.client`."""

        def answers(url: str) -> bool:
            try:
                with urllib.request.urlopen(url, timeout=self.config.probe_timeout_s) as resp:
                    return int(resp.status) == 200
            except (urllib.error.URLError, OSError):
                return False

        def alive(name: str) -> bool:
            url = self._engines[name].registration.health_url + "/health"
            give_up = time.monotonic() + self.config.probe_grace_s
            while not answers(url):
                if time.monotonic() >= give_up:
                    return False
                time.sleep(0.5)
            return True

        names = list(names)
        if not names:
            return {}
        with ThreadPoolExecutor(max_workers=min(32, len(names))) as pool:
            return dict(zip(names, pool.map(alive, names), strict=True))

    def forget(self, name: str) -> None:
        """Drop engine `name` until a sidecar registers under it again (a replacement): a
        delivery neither probes nor waits for an engine known to be gone."""
        self._refresh_members()
        self._engines.pop(name, None)

    # --- publishing -------------------------------------------------------------------------

    def publish(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> SyncResult:
        """Deliver `version` to every registered engine; see the module docstring."""
        if version <= self.version:
            raise ValueError(
                f"weight version {version} must be greater than the last published "
                f"version {self.version}"
            )
        named = self._checked(named_tensors)
        self.version = version
        return self._deliver(named)

    def resync(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncResult:
        """Deliver the current version again to every engine that has not acknowledged it."""
        return self._deliver(self._checked(named_tensors))

    def redeliver(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncResult:
        """Deliver the current version again to every engine, acknowledged or not: an engine
        that released its memory while the trainer ran (SGLang drops the weights) holds
        nothing to serve until it gets the version whole again."""
        named = self._checked(named_tensors)
        self._refresh_members()
        for record in self._engines.values():
            record.acked_version = None
        return self._deliver(named)

    def _checked(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        named = [(name, t.detach()) for name, t in named_tensors]
        if self.config.scan_nonfinite:
            problems = nonfinite_report(named)
            if problems:
                raise NonFiniteWeights(
                    "refusing to publish weights with non-finite values: " + "; ".join(problems)
                )
        return named

    def _deliver(self, named: list[tuple[str, torch.Tensor]]) -> SyncResult:
        start = time.monotonic()
        deadline = start + self.config.ack_timeout_s
        plan = plan_buckets(named, self.config.bucket_bytes)
        reasons: dict[str, str] = {}
        rejections: list[str] = []
        acked: list[str] = []
        attempts = 0
        self._refresh_members()
        while attempts < self.config.max_attempts and time.monotonic() < deadline:
            self._refresh_members()
            pending = [n for n, r in self._engines.items() if r.acked_version != self.version]
            alive = self._probe(pending)
            for name, ok in alive.items():
                if not ok:
                    reasons[name] = (f"unreachable: its sidecar did not answer /health for "
                                     f"{self.config.probe_grace_s:.0f}s")
            targets = sorted(n for n, ok in alive.items() if ok)
            if not targets:
                break
            attempts += 1
            fallback = attempts > 1 and self.config.disk_dir is not None
            transport: Transport = "disk" if fallback else self.config.transport
            outcome = self._attempt(named, plan, targets, transport, deadline)
            for name, (ok, reason) in outcome.items():
                if ok:
                    self._engines[name].acked_version = self.version
                    acked.append(name)
                    reasons.pop(name, None)
                else:
                    reasons[name] = reason
                    rejections.append(f"{name}: {reason}")
            if all(ok for ok, _ in outcome.values()):
                break
        stale: dict[str, str] = {}
        for name, record in self._engines.items():
            if record.acked_version == self.version:
                record.stale_reason = ""
            else:
                record.stale_reason = reasons.get(name, "not delivered before the deadline")
                stale[name] = record.stale_reason
        for name, reason in stale.items():
            log.warning("engine %s is stale at version %d: %s", name, self.version, reason)
        return SyncResult(
            version=self.version,
            acked=sorted(acked),
            stale=stale,
            attempts=attempts,
            seconds=time.monotonic() - start,
            bytes_per_engine=sum(b.nbytes for b in plan),
            rejections=tuple(rejections),
        )

    def _attempt(
        self,
        named: list[tuple[str, torch.Tensor]],
        plan: list[BucketMeta],
        targets: list[str],
        transport: Transport,
        deadline: float,
    ) -> dict[str, tuple[bool, str]]:
        tensors = dict(named)
        refused: dict[str, tuple[bool, str]] = {}
        ipc: list[str] = []
        if transport == "broadcast":
            refused, ipc, targets = self._split(targets)
        if not targets and not ipc:
            return refused
        incarnations = {n: self._engines[n].registration.incarnation for n in targets}
        if transport == "broadcast" and (self._group is None or incarnations != self._group_roster):
            self._drop_group()
            self._epoch += 1
        path = ""
        digests: list[str] = []
        handles: dict[str, str] = {}
        staged: list[torch.Tensor] = []
        try:
            if transport == "disk":
                digests = [
                    bucket_digest(pack_bucket(b, [tensors[m.name] for m in b.tensors]))
                    for b in plan
                ]
                written = disk.write_version(
                    self._disk_versions(),
                    self.version,
                    plan,
                    tensors,
                    digests,
                    version_digest(self.version, plan, digests),
                    self.config.config_json,
                )
                disk.prune(self._disk_versions(), self.config.keep_disk_versions)
                path = str(written)
            else:
                staged = [
                    pack_bucket(b, [tensors[m.name] for m in b.tensors], self._staging(b))
                    for b in plan
                ]
                if self.config.verify_digest:
                    digests = [bucket_digest(buf) for buf in staged]
                if ipc:
                    # The handles carry no ordering with this stream: the version must be
                    # complete before a reader on another process can see it.
                    torch.cuda.synchronize(self.device)
                    buckets = [(str(b.index), buf) for b, buf in zip(plan, staged, strict=True)]
                    handles = {name: encode_named_tensors(buckets) for name in ipc}
        except Exception as err:  # nothing was announced: every target fails with the reason
            reason = f"preparing version {self.version} failed at the trainer: {_described(err)}"
            log.warning("%s", reason)
            return {**refused, **{n: (False, reason) for n in [*targets, *ipc]}}
        # Receivers read announcements in sequence: a number is taken only when it is used.
        self._seq += 1
        seq = self._seq
        announcement = Announcement(
            seq=seq,
            version=self.version,
            epoch=self._epoch,
            transport=transport,
            roster={name: i + 1 for i, name in enumerate(targets)},
            backend=self.config.backend,
            layout=layout_to_json(plan),
            path=path,
            verify_digest=self.config.verify_digest,
            scan_nonfinite=self.config.scan_nonfinite,
            ipc=handles,
        )
        self._store.set(Keys.announcement(seq), encode(announcement))
        self._store.set(Keys.latest_seq, str(seq))
        error = ""
        if transport == "broadcast" and targets:
            try:
                if self._group is None:
                    self._group = BroadcastGroup(
                        self._store.raw,
                        epoch_prefix=Keys.group(self._epoch),
                        rank=0,
                        size=len(targets) + 1,
                        backend=self.config.backend,
                        device=self.device,
                        timeout_s=min(
                            self.config.join_timeout_s, max(1.0, deadline - time.monotonic())
                        ),
                    )
                    self._group_roster = incarnations
                for buf in staged:
                    self._group.broadcast(buf)
            except Exception as err:
                # Whatever a collective raises (NCCL reports some failures as ValueError or
                # TypeError, not RuntimeError), the version failed for these engines: the
                # receivers learn it from the digest record, the caller from their acks.
                error = f"broadcast of version {self.version} failed at the trainer: " + (
                    _described(err)
                )
                log.warning("%s", error)
                self._drop_group()
        record = {
            "error": error,
            "version_digest": version_digest(self.version, plan, digests) if digests else "",
            "bucket_digests": digests,
        }
        self._store.set(Keys.digest(seq), json.dumps(record))
        outcome = self._collect_acks(seq, [*targets, *ipc], deadline)
        if error:
            # The trainer's own failure is the cause; what each receiver saw follows it.
            outcome = {
                name: (ok, reason if ok else f"{error} (the engine's side: {reason})")
                for name, (ok, reason) in outcome.items()
            }
        if not all(ok for ok, _ in outcome.values()):
            self._drop_group()
        return {**refused, **outcome}

    def _split(
        self, targets: list[str]
    ) -> tuple[dict[str, tuple[bool, str]], list[str], list[str]]:
        """Targets of a broadcast as (refused with the reason, readers by CUDA IPC, group
        members): a sidecar on this rank's own GPU reads by IPC (NCCL refuses one GPU twice
        in a group); one staging on the CPU cannot join an NCCL group at all."""
        refused: dict[str, tuple[bool, str]] = {}
        ipc: list[str] = []
        members: list[str] = []
        for name in targets:
            gpu = self._engines[name].registration.gpu
            if self.gpu and gpu == self.gpu:
                ipc.append(name)
            elif self.config.backend == "nccl" and not gpu:
                refused[name] = (
                    False,
                    "its sidecar stages on the CPU, and an NCCL broadcast needs the engine's "
                    "GPU (run it with --device cuda:N)",
                )
            else:
                members.append(name)
        return refused, ipc, members

    def _disk_versions(self) -> Path:
        """This publisher's own version directory; before its first use, whatever earlier
        attempts left next to it is removed (they may hold the same numbers, other weights)."""
        root = self.config.disk_dir
        assert root is not None
        if self._disk_ready != root:
            removed = disk.clear_other_attempts(root, self.incarnation[:12])
            if removed:
                log.info("removed %d version directories of earlier attempts in %s",
                         len(removed), root)
            self._disk_ready = root
        return disk.attempt_dir(root, self.incarnation[:12])

    def _staging(self, bucket: BucketMeta) -> torch.Tensor:
        """The send buffer of `bucket` on this rank's device, kept while the layout stays
        (padding stays zero; CUDA IPC readers of an earlier version mapped the same memory)."""
        held = self._send_buffers.get(bucket.index)
        if held is not None and held[0] == bucket:
            return held[1]
        buf = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=self.device)
        self._send_buffers[bucket.index] = (bucket, buf)
        return buf

    def _collect_acks(
        self, seq: int, targets: list[str], deadline: float
    ) -> dict[str, tuple[bool, str]]:
        outcome: dict[str, tuple[bool, str]] = {}
        pending = set(targets)
        next_probe = time.monotonic() + 1.0
        while pending:
            for name in sorted(pending):
                if self._store.check([Keys.ack(seq, name)]):
                    try:
                        ack = decode_ack(self._store.get(Keys.ack(seq, name)))
                    except UnauthenticatedValue as err:
                        outcome[name] = (False, str(err))
                        pending.discard(name)
                        continue
                    reason = ack.reason
                    if not ack.ok and ack.serving_version:
                        reason = f"{reason} (still serving version {ack.serving_version})"
                    outcome[name] = (ack.ok, reason)
                    pending.discard(name)
            now = time.monotonic()
            if not pending:
                break
            if now >= deadline:
                for name in pending:
                    outcome[name] = (
                        False,
                        f"no acknowledgement of version {self.version} within "
                        f"{self.config.ack_timeout_s:.0f}s",
                    )
                break
            if now >= next_probe:
                for name, ok in self._probe(sorted(pending)).items():
                    if not ok:
                        outcome[name] = (False, "lost during sync: its sidecar stopped answering")
                        pending.discard(name)
                next_probe = time.monotonic() + 1.0
                continue
            poll_key(self._store, Keys.ack(seq, min(pending)), min(0.2, deadline - now))
        return outcome

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None
        self._group_roster = {}

    def close(self) -> None:
        self._drop_group()
        del self._store
