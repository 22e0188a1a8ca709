"""`rljob-weight-sync`: the sidecar that owns one rollout engine's place in weight sync.

It registers with the trainer's store, follows the announcements, receives each version
addressed to it (broadcast group or disk), verifies it (digest, finite values), installs it
into its engine through the engine's HTTP update endpoints and acknowledges the result. A
rejected version never reaches the engine, which keeps serving the previous one. When the
trainer's store goes away (trainer restart) or the sidecar itself restarts, it registers
again and is included from the next announcement on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from rljob.engine.client import EngineClient, EngineError
from rljob.engine.rank_devices import RankCopies, entry_devices
from rljob.weightsync import disk
from rljob.weightsync.auth import SignedStore, peer_key
from rljob.weightsync.group import BroadcastGroup, open_store, poll_key, rank_device
from rljob.weightsync.nonfinite import nonfinite_names, nonfinite_report
from rljob.weightsync.protocol import (
    Ack,
    Announcement,
    BucketMeta,
    Keys,
    Registration,
    bucket_digest,
    decode_announcement,
    encode,
    gpu_uuid,
    layout_from_json,
    unpack_bucket,
    version_digest,
)
from rljob.weightsync.wire import (
    decode_named_tensors,
    shared_memory_fits,
    use_file_system_sharing,
)
from rljob_api import layout
from rljob_api.env import ENGINE_URL, POD_IP, POD_NAME, WEIGHT_SYNC_TRAINER

log = logging.getLogger("rljob.engine.sidecar")


@dataclass(frozen=True)
class SidecarConfig:
    engine_name: str
    engine_url: str
    trainer_host: str
    trainer_port: int
    listen_host: str = "0.0.0.0"
    listen_port: int = layout.WEIGHT_SYNC_HEALTH_PORT
    advertise_host: str = ""
    device: str = "cpu"
    # The engine's GPUs (Ray's ids, first slot first; "" on CPU): a sidecar actor is shown
    # them all, so rank r's entry goes on rank r's GPU (`rljob.engine.rank_devices`).
    engine_gpus: str = ""
    connect_timeout_s: float = 30.0
    collective_timeout_s: float = 120.0
    install_timeout_s: float = 300.0
    reconnect_backoff_s: float = 2.0


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.serving_version = Gauge(
            "rljob_weight_sync_engine_version",
            "Weight version the local engine reports (-1 when not numeric or unknown).",
            registry=self.registry,
        )
        self.versions = Counter(
            "rljob_weight_sync_versions",
            "Versions handled, by result (installed or rejected).",
            ["result"],
            registry=self.registry,
        )
        self.bytes = Counter(
            "rljob_weight_sync_received_bytes",
            "Weight bytes received from the trainer.",
            registry=self.registry,
        )
        self.last_seconds = Gauge(
            "rljob_weight_sync_last_sync_seconds",
            "Seconds from announcement to acknowledgement of the last version.",
            registry=self.registry,
        )
        self.connected = Gauge(
            "rljob_weight_sync_connected",
            "1 while registered with the trainer's store.",
            registry=self.registry,
        )
        self.serving_version.set(-1)


class Sidecar:
    def __init__(self, config: SidecarConfig, key: str | None = None) -> None:
        """`key`: the job's peer key (default: `peer_key()`), which its engine requires and
        every store value must be signed with."""
        self.config = config
        self._key = peer_key() if key is None else key
        self.engine = EngineClient(config.engine_url, timeout_s=10.0, api_key=self._key)
        self.metrics = SidecarMetrics()
        self.incarnation = uuid.uuid4().hex
        self.state = "starting"
        self.last_rejection = ""
        self.last_acked_version = -1
        self._stop = threading.Event()
        self._group: BroadcastGroup | None = None
        self._epoch = -1
        self._http: ThreadingHTTPServer | None = None
        self._staging: list[torch.Tensor] = []
        self._flat: torch.Tensor | None = None  # the one allocation `_staging` views
        self._rank_copies = RankCopies()
        # The GPU this sidecar touches, index made explicit: staging, its NCCL rank and the
        # identity it registers with (how the trainer sees whether they share a GPU).
        self.device = rank_device(config.device)
        self.gpu = gpu_uuid(self.device)
        if self.device.type == "cpu":
            use_file_system_sharing()

    # --- health and metrics -----------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {
            "engine": self.config.engine_name,
            "incarnation": self.incarnation,
            "state": self.state,
            "last_acked_version": self.last_acked_version,
            "last_rejection": self.last_rejection,
        }

    def serve_http(self) -> int:
        """Serve /health and /metrics on a background thread; returns the bound port."""
        sidecar = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/health":
                    body, ctype = json.dumps(sidecar.health()).encode(), "application/json"
                elif self.path == "/metrics":
                    body, ctype = generate_latest(sidecar.metrics.registry), CONTENT_TYPE_LATEST
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._http = ThreadingHTTPServer(
            (self.config.listen_host, self.config.listen_port), Handler
        )
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return int(self._http.server_address[1])

    # --- main loop --------------------------------------------------------------------------

    def run(self) -> None:
        """Follow the trainer until stopped, re-registering whenever the store is lost."""
        port = self.serve_http()
        log.info("sidecar %s: health on port %d", self.config.engine_name, port)
        while not self._stop.is_set():
            try:
                self._session(port)
            except (RuntimeError, OSError) as err:
                self.state = "disconnected"
                self.metrics.connected.set(0)
                self._drop_group()
                log.warning("trainer store unavailable (%s); reconnecting", err)
                self._stop.wait(self.config.reconnect_backoff_s)

    def stop(self) -> None:
        self._stop.set()
        if self._http is not None:
            self._http.shutdown()

    def _engine_version(self) -> str:
        try:
            version = self.engine.weight_version()
        except EngineError:
            return ""
        self.metrics.serving_version.set(int(version) if version.lstrip("-").isdigit() else -1)
        return version

    def _session(self, http_port: int) -> None:
        cfg = self.config
        # Values are signed and checked with the job's key: one that does not check out
        # (UnauthenticatedValue, a RuntimeError) is never parsed, and ends this session like
        # a lost store; the next registers again and starts after the latest announcement.
        store = SignedStore(open_store(
            cfg.trainer_host, cfg.trainer_port, server=False, timeout_s=cfg.connect_timeout_s
        ), self._key)
        advertise = cfg.advertise_host or socket.gethostbyname(socket.gethostname())
        registration = Registration(
            engine=cfg.engine_name,
            incarnation=self.incarnation,
            health_url=f"http://{advertise}:{http_port}",
            engine_version=self._engine_version(),
            gpu=self.gpu,
        )
        index = int(store.add(Keys.members, 1)) - 1
        store.set(Keys.member(index), encode(registration))
        next_seq = int(store.get(Keys.latest_seq)) + 1 if store.check([Keys.latest_seq]) else 1
        self.state = "idle"
        self.metrics.connected.set(1)
        log.info(
            "registered %s as member %d; waiting for announcement %d",
            cfg.engine_name,
            index,
            next_seq,
        )
        while not self._stop.is_set():
            if not poll_key(store, Keys.announcement(next_seq), 1.0, interval_s=0.1):
                continue
            announcement = decode_announcement(store.get(Keys.announcement(next_seq)))
            next_seq += 1
            addressed = {*announcement.roster, *announcement.ipc}
            if cfg.engine_name not in addressed:
                continue
            self.handle(store, announcement)

    def handle(self, store: SignedStore, ann: Announcement) -> None:
        """Receive, verify, install and acknowledge one announcement."""
        start = time.monotonic()
        self.state = f"receiving v{ann.version}"
        layout = layout_from_json(ann.layout)
        try:
            if ann.transport == "disk":
                buffers = [disk.read_bucket(Path(ann.path), b, len(layout)) for b in layout]
            elif self.config.engine_name in ann.ipc:
                buffers = self._receive_ipc(ann, layout)
            else:
                buffers = self._receive_broadcast(store, ann, layout)
        except Exception as err:
            # Any exception type: NCCL and CUDA report failures as RuntimeError, ValueError
            # or TypeError alike, and each one only fails this version, never the sidecar.
            self._drop_group()
            self._ack(
                store,
                ann,
                False,
                f"receiving version {ann.version} failed: {type(err).__name__}: {err}",
                start,
            )
            return
        problems = self._verify(store, ann, layout, buffers)
        if problems:
            self._ack(store, ann, False, "; ".join(problems), start)
            return
        self.state = f"installing v{ann.version}"
        try:
            if ann.transport == "broadcast":
                if self.device.type == "cuda":
                    # The engine reads the staging through handles it already holds, which
                    # carry no event to wait on: the bytes must be in place before it asks.
                    torch.cuda.synchronize(self.device)
                result = self.engine.update_from_rank_tensors(
                    self._rank_entries(layout), str(ann.version), self.config.install_timeout_s
                )
            else:
                result = self.engine.update_from_disk(
                    ann.path, str(ann.version), self.config.install_timeout_s
                )
            serving = self._engine_version()
        except EngineError as err:
            self._ack(store, ann, False, f"engine unreachable while installing: {err}", start)
            return
        if not result.success:
            self._ack(
                store, ann, False, f"engine refused version {ann.version}: {result.message}", start
            )
        elif serving != str(ann.version):
            self._ack(
                store,
                ann,
                False,
                f"engine reports version {serving!r} after installing {ann.version}",
                start,
            )
        else:
            self._ack(store, ann, True, "", start, serving)

    def _receive_broadcast(
        self, store: SignedStore, ann: Announcement, layout: Sequence[BucketMeta]
    ) -> list[torch.Tensor]:
        if self._group is None or self._epoch != ann.epoch:
            self._drop_group()
            self._group = BroadcastGroup(
                store.raw,
                epoch_prefix=Keys.group(ann.epoch),
                rank=ann.roster[self.config.engine_name],
                size=len(ann.roster) + 1,
                backend=ann.backend,
                device=self.device,
                timeout_s=self.config.collective_timeout_s,
            )
            self._epoch = ann.epoch
        buffers = self._buffers(layout)
        for bucket, buf in zip(layout, buffers, strict=True):
            self._group.broadcast(buf)
            self.metrics.bytes.inc(bucket.nbytes)
        return buffers

    def _receive_ipc(self, ann: Announcement, layout: Sequence[BucketMeta]) -> list[torch.Tensor]:
        """Copy the version out of the trainer's buckets on this same GPU.

        The trainer's memory is mapped only for the copy: torch cannot hand a tensor it
        received by CUDA IPC on to a third process (the engine), and the trainer reuses its
        buckets for the next version, so the version is verified and installed from this
        sidecar's own staging buffers, as a broadcast one is.
        """
        mapped = dict(decode_named_tensors(ann.ipc[self.config.engine_name]))
        buffers = self._buffers(layout)
        for bucket, buf in zip(layout, buffers, strict=True):
            source = mapped.pop(str(bucket.index))
            if source.numel() != bucket.nbytes or source.device.type != "cuda":
                raise ValueError(
                    f"bucket {bucket.index}: the trainer shared {source.numel()} bytes on "
                    f"{source.device}, the layout says {bucket.nbytes} bytes on a GPU"
                )
            buf.copy_(source)
            self.metrics.bytes.inc(bucket.nbytes)
        torch.cuda.synchronize(self.device)
        return buffers

    def _buffers(self, layout: Sequence[BucketMeta]) -> list[torch.Tensor]:
        """This sidecar's staging buffers for `layout`: consecutive views of one allocation.

        Kept across versions: fresh shared memory costs page faults on both sides of the
        handoff, every version, and the engine keeps the last version's handles open
        (`TensorReceiver`), so a kept buffer is not opened again. One allocation makes the
        version one flat buffer: one handle to hand over (a flattened bucket) and one span
        to screen for NaN/Inf. The engine copies out before it answers, so nothing still
        reads them when the next version arrives.
        """
        sizes = [b.nbytes for b in layout]
        if [b.numel() for b in self._staging] != sizes:
            # The old version's memory goes before the new is taken.
            self._staging, self._flat = [], None
            self._rank_copies.clear()
            self._flat = self._allocate(sum(sizes))
            self._staging = list(self._flat.split(sizes))
        return self._staging

    def _rank_entries(self, layout: Sequence[BucketMeta]) -> list[list[tuple[str, torch.Tensor]]]:
        """Each tensor-parallel rank's tensors of the staged, verified version: views of the
        staging for the first rank, of a copy on its own GPU for each further rank of a GPU
        engine (`rljob.engine.rank_devices`), of the same shared memory on the CPU."""
        assert self._flat is not None, "staged first"
        visible = torch.cuda.device_count() if self.device.type == "cuda" else 0
        devices = entry_devices(str(self.device), self.engine.tp_size(), visible)
        sizes = [b.nbytes for b in layout]
        return [
            [nt for b, view in zip(layout, flat.split(sizes), strict=True)
             for nt in unpack_bucket(b, view)]
            for flat in self._rank_copies.copies(self._flat, devices)
        ]

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cpu":
            shared_memory_fits(nbytes)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if buf.device.type == "cpu":
            buf.share_memory_()
        return buf

    def _verify(
        self,
        store: SignedStore,
        ann: Announcement,
        layout: Sequence[BucketMeta],
        buffers: Sequence[torch.Tensor],
    ) -> list[str]:
        problems: list[str] = []
        if ann.scan_nonfinite:
            # One fused scan of the whole version (one host sync); the counts per bucket are
            # taken only on the rare version that fails it.
            unpacked = [unpack_bucket(b, buf) for b, buf in zip(layout, buffers, strict=True)]
            flagged = set(nonfinite_names([nt for views in unpacked for nt in views]))
            for bucket, views in zip(layout, unpacked, strict=True):
                found = nonfinite_report([(n, t) for n, t in views if n in flagged])
                if found:
                    problems.append(
                        f"bucket {bucket.index} has non-finite values: " + ", ".join(found)
                    )
        if not poll_key(store, Keys.digest(ann.seq), self.config.collective_timeout_s):
            return [*problems, f"the trainer published no digest for version {ann.version}"]
        record = json.loads(store.get(Keys.digest(ann.seq)))
        if record["error"]:
            problems.append(f"sender aborted: {record['error']}")
        elif ann.verify_digest:
            digests = [bucket_digest(buf) for buf in buffers]
            if version_digest(ann.version, layout, digests) != record["version_digest"]:
                bad = [
                    str(i)
                    for i, (got, want) in enumerate(
                        zip(digests, record["bucket_digests"], strict=True)
                    )
                    if got != want
                ]
                problems.append(
                    f"digest mismatch for version {ann.version} (buckets {', '.join(bad)})"
                )
        return problems

    def _ack(
        self,
        store: SignedStore,
        ann: Announcement,
        ok: bool,
        reason: str,
        start: float,
        serving: str = "",
    ) -> None:
        elapsed = time.monotonic() - start
        if not ok:
            # What the engine serves instead: the trainer reports it with the reason.
            serving = self._engine_version()
        ack = Ack(
            engine=self.config.engine_name,
            seq=ann.seq,
            version=ann.version,
            ok=ok,
            reason=reason,
            serving_version=serving,
            extra={"seconds": elapsed},
        )
        store.set(Keys.ack(ann.seq, self.config.engine_name), encode(ack))
        self.metrics.last_seconds.set(elapsed)
        self.metrics.versions.labels(result="installed" if ok else "rejected").inc()
        if ok:
            self.last_acked_version = ann.version
            log.info("installed version %d in %.2fs", ann.version, elapsed)
        else:
            self.last_rejection = f"v{ann.version}: {reason}"
            log.warning("rejected version %d: %s", ann.version, reason)
        self.state = "idle"

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None
        self._epoch = -1


def _host_port(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise SystemExit(f"rljob-weight-sync: {what} must look like HOST:PORT, got {value!r}")
    return host, int(port)


def parse_args(argv: Sequence[str] | None) -> SidecarConfig:
    env = os.environ
    p = argparse.ArgumentParser(prog="rljob-weight-sync", description=__doc__.split("\n")[0])
    p.add_argument(
        "--trainer",
        default=env.get(WEIGHT_SYNC_TRAINER, ""),
        help=f"HOST:PORT of the trainer's weight-sync store (${WEIGHT_SYNC_TRAINER})",
    )
    p.add_argument(
        "--engine-url",
        default=env.get(ENGINE_URL, f"http://127.0.0.1:{layout.ENGINE_PORT}"),
        help=f"base URL of the local engine (${ENGINE_URL})",
    )
    p.add_argument(
        "--engine-name",
        default="",
        help=f"this engine's name in the group (default: ${POD_NAME}, else the host name)",
    )
    p.add_argument("--listen", default=f"0.0.0.0:{layout.WEIGHT_SYNC_HEALTH_PORT}",
                   help="HOST:PORT for /health and /metrics")
    p.add_argument(
        "--advertise-host",
        default=env.get(POD_IP, ""),
        help=f"address the trainer uses to probe /health (${POD_IP})",
    )
    p.add_argument(
        "--device",
        default="cuda:0" if torch.cuda.is_available() else "cpu",
        help="where received buckets are staged: cpu or cuda:N (the engine's GPU)",
    )
    p.add_argument("--connect-timeout", type=float, default=30.0)
    p.add_argument("--collective-timeout", type=float, default=120.0)
    p.add_argument("--install-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if not args.trainer:
        raise SystemExit(
            f"rljob-weight-sync: --trainer HOST:PORT (or ${WEIGHT_SYNC_TRAINER}) is required"
        )
    engine_name = args.engine_name or env.get(POD_NAME, socket.gethostname())
    trainer_host, trainer_port = _host_port(args.trainer, "--trainer")
    listen_host, listen_port = _host_port(args.listen, "--listen")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise SystemExit(f"rljob-weight-sync: --device must be cpu or cuda:N, got {args.device!r}")
    for name in ("connect_timeout", "collective_timeout", "install_timeout"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"rljob-weight-sync: --{name.replace('_', '-')} must be > 0 seconds")
    return SidecarConfig(
        engine_name=engine_name,
        engine_url=args.engine_url,
        trainer_host=trainer_host,
        trainer_port=trainer_port,
        listen_host=listen_host,
        listen_port=listen_port,
        advertise_host=args.advertise_host,
        device=args.device,
        connect_timeout_s=args.connect_timeout,
        collective_timeout_s=args.collective_timeout,
        install_timeout_s=args.install_timeout,
    )


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    Sidecar(config).run()


if __name__ == "__main__":
    main(sys.argv[1:])
