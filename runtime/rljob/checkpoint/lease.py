"""One writer per checkpoint store: a lease file with a heartbeat, taken atomically.

Two drivers of one job (a restarted driver while the old one still runs on a partitioned
node, or two `rljob run` on one workdir) must never write the same store at once. The
lease is a series of files `.writer-lease.<generation>` in the store; the highest
generation is the lease. A writer takes generation g+1 with a hard link (fails if it
exists: exactly one of two newcomers wins) only when generation g is free: released, its
heartbeat older than its TTL, or its process provably dead (same boot, same PID namespace,
no such PID). The holder renews its own file every TTL/4 (written aside, then renamed over
it) and, before each commit, checks that no newer generation exists: a writer whose lease
was taken over stops instead of publishing. A lease file is never deleted while it is the
newest, so generations only grow and a stale holder always sees that it lost.

Heartbeats are wall-clock times read by other machines: the nodes' clocks must agree to
well within the TTL (NTP does).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rljob_api import env

PREFIX = ".writer-lease."
TTL_S = 30.0
WAIT_S = 90.0  # a newcomer outwaits a crashed holder's TTL, then gives up (retryable)


class LeaseHeld(Exception):
    """Another live writer holds the store; retrying later (after it stopped) can help."""


class LeaseLost(Exception):
    """This writer's lease was taken over: a newer writer owns the store now."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def writer_identity(attempt: int | None = None) -> str:
    """Who writes, for people reading the lease: pod (or host), attempt and process."""
    where = os.environ.get(env.POD_NAME) or socket.gethostname()
    part = f"/attempt-{attempt}" if attempt is not None else ""
    return f"{where}{part}/pid-{os.getpid()}"


@dataclass(frozen=True)
class Holder:
    """The content of one lease file."""

    writer: str
    token: str
    renewed_at: float  # unix time of the last heartbeat
    ttl_s: float
    boot_id: str = ""
    pid_namespace: str = ""
    pid: int = 0
    released: bool = False

    def free(self, now: float) -> bool:
        """True when a newcomer may take the store over from this holder."""
        if self.released or now > self.renewed_at + self.ttl_s:
            return True
        same_process_table = (self.boot_id and self.boot_id == _boot_id()
                              and self.pid_namespace and self.pid_namespace == _pid_namespace())
        return bool(same_process_table and self.pid and not _pid_alive(self.pid))

    def describe(self, now: float) -> str:
        return f"{self.writer} (heartbeat {max(0.0, now - self.renewed_at):.0f}s ago)"


def _generation(path: Path) -> int | None:
    tail = path.name[len(PREFIX):]
    return int(tail) if path.name.startswith(PREFIX) and tail.isdigit() else None


class WriterLease:
    """This process's claim on the store under `root`."""

    def __init__(self, root: Path, writer: str, ttl_s: float = TTL_S) -> None:
        self.root = root
        self.ttl_s = ttl_s
        self.me = Holder(writer=writer, token=uuid.uuid4().hex, renewed_at=0.0, ttl_s=ttl_s,
                         boot_id=_boot_id(), pid_namespace=_pid_namespace(), pid=os.getpid())
        self.generation: int | None = None
        self.lost: str = ""
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        return self.generation is not None and not self.lost

    def _file(self, generation: int) -> Path:
        return self.root / f"{PREFIX}{generation:08d}"

    def _newest(self) -> tuple[int, Holder | None]:
        """The newest generation and its holder (0, None when the store has no lease)."""
        generations = sorted(g for p in self.root.iterdir() if (g := _generation(p)) is not None)
        for generation in reversed(generations):
            path = self._file(generation)
            try:
                return generation, Holder(**json.loads(path.read_text()))
            except FileNotFoundError:
                continue  # cleaned up between listing and reading: an older one
            except (OSError, ValueError, TypeError):
                # Unreadable: judge it by its age alone.
                stamp = path.stat().st_mtime if path.exists() else 0.0
                return generation, Holder("an unreadable lease", "", stamp, self.ttl_s)
        return 0, None

    def _write_aside(self, holder: Holder) -> Path:
        tmp = self.root / f".lease-tmp-{uuid.uuid4().hex[:12]}"
        with tmp.open("w") as fh:
            json.dump(asdict(holder), fh)
            fh.flush()
            os.fsync(fh.fileno())
        return tmp

    def _take(self, generation: int) -> bool:
        """Create lease file `generation`, complete, only if it does not exist yet."""
        holder = replace(self.me, renewed_at=time.time())
        tmp = self._write_aside(holder)
        try:
            os.link(tmp, self._file(generation))
            return True
        except FileExistsError:
            return False
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            return self._create(generation, holder)  # a filesystem without hard links
        finally:
            tmp.unlink(missing_ok=True)

    def _create(self, generation: int, holder: Holder) -> bool:
        """Exclusive create, then the content: a reader that sees the file still empty
        judges it by its age, so it counts as live and nobody else takes it."""
        try:
            fd = os.open(self._file(generation), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump(asdict(holder), fh)
            fh.flush()
            os.fsync(fh.fileno())
        return True

    def acquire(self, wait_s: float = WAIT_S,
                on_wait: Callable[[str], None] | None = None) -> None:
        """Take the store, waiting up to `wait_s` for a live holder; LeaseHeld after that."""
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            generation, holder = self._newest()
            now = time.time()
            if holder is not None and holder.token == self.me.token and not self.lost:
                return  # already ours
            if holder is None or holder.free(now):
                if self._take(generation + 1):
                    self.generation = generation + 1
                    self.lost = ""
                    self._forget_older(self.generation)
                    self._start_heartbeat()
                    return
                continue  # another newcomer won this generation: look again
            if time.monotonic() >= deadline:
                raise LeaseHeld(
                    f"the checkpoint store {self.root} is in use by {holder.describe(now)}; "
                    f"waited {wait_s:.0f}s. Two drivers of one job must not write it at once; "
                    "this is retryable once the other one has stopped")
            if on_wait is not None and not told:
                on_wait(f"the checkpoint store {self.root} is in use by "
                        f"{holder.describe(now)}; waiting up to {wait_s:.0f}s for it to stop")
                told = True
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))

    def _forget_older(self, generation: int) -> None:
        for path in self.root.iterdir():
            g = _generation(path)
            if g is not None and g < generation:
                path.unlink(missing_ok=True)

    def _newer_exists(self) -> bool:
        assert self.generation is not None
        return any((g := _generation(p)) is not None and g > self.generation
                   for p in self.root.iterdir())

    def _renew(self) -> None:
        """Rewrite this writer's lease with a fresh heartbeat, unless it was taken over."""
        assert self.generation is not None
        with self._lock:
            if self._newer_exists():
                self.lost = "a newer writer took the checkpoint store over"
                return
            path = self._file(self.generation)
            try:
                current = Holder(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                self.lost = f"its lease file {path.name} is gone or unreadable"
                return
            if current.token != self.me.token:
                self.lost = f"its lease file {path.name} now names {current.writer}"
                return
            os.replace(self._write_aside(replace(self.me, renewed_at=time.time())), path)

    def check(self) -> None:
        """Renew now and raise LeaseLost unless this writer still owns the store (called
        before publishing anything)."""
        if self.generation is None:
            raise LeaseLost("this writer never took the checkpoint store")
        if not self.lost:
            # An OSError here is the storage failing, not a takeover: it propagates, and the
            # run reports it (StorageError, retryable) where a lost lease is not reported.
            self._renew()
            if not self.lost and self._newer_exists():
                self.lost = "a newer writer took the checkpoint store over"
        if self.lost:
            raise LeaseLost(f"{self.me.writer} lost the checkpoint store {self.root}: "
                            f"{self.lost}; it stops without publishing")

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, name="checkpoint-lease",
                                           daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self._renew()
            except OSError:
                continue  # storage unreachable: check() before a commit decides
            if self.lost:
                return

    def release(self) -> None:
        """Stop the heartbeat and mark the lease free, if this writer still holds it."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if self.generation is None or self.lost:
            return
        with self._lock, contextlib.suppress(OSError, ValueError, TypeError):
            if self._newer_exists():
                return
            path = self._file(self.generation)
            if Holder(**json.loads(path.read_text())).token == self.me.token:
                os.replace(self._write_aside(replace(self.me, renewed_at=time.time(),
                                                     released=True)), path)
        self.generation = None

