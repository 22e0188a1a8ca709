"""Atomic, verified checkpoints with keep-last-K.

A checkpoint is written into a temporary directory, every file is fsynced, a manifest
of SHA-256 digests is written last, and only then is the directory renamed to
`step_XXXXXXXX` (rename is atomic on POSIX). A crash at any point leaves either the
complete new checkpoint or none; readers only trust a directory whose files all match
its manifest, so a torn or tampered checkpoint is skipped in favour of the one before.

One writer at a time (`rljob.checkpoint.lease`): a store publishes only while its writer holds the
store's lease, checked right before each publish, and never replaces a published
checkpoint, so a writer that lost its lease (a driver left behind by a restart) can neither
add a checkpoint nor remove one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rljob.checkpoint.lease import TTL_S, WAIT_S, LeaseHeld, LeaseLost, WriterLease, writer_identity

MANIFEST = "MANIFEST.json"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
REJECTED_PREFIX = ".rejected-"

__all__ = ["CheckpointConflict", "CheckpointStore", "LeaseHeld", "LeaseLost", "Verified",
           "fsync_path", "step_of", "verify", "write_manifest"]


class CheckpointConflict(Exception):
    """The step is already published: a checkpoint is never replaced."""


@dataclass(frozen=True)
class Verified:
    step: int
    path: Path
    checksum: str
    size_bytes: int


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk (rename durability needs both)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(tmp: Path, step: int, entries: dict[str, dict[str, int | str]]) -> None:
    """Write and fsync the manifest: the last file of a checkpoint, which makes it whole.

    Its own function so that a test can stop a save at this exact point from outside
    (tests/faults.py) without the product carrying a test switch.
    """
    with (tmp / MANIFEST).open("w") as fh:
        json.dump({"step": step, "files": entries}, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(PREFIX) or not name[len(PREFIX):].isdigit():
        return None
    return int(name[len(PREFIX):])


def verify(path: Path) -> Verified | None:
    """The checkpoint at `path` if every file in its manifest is present and matches."""
    step = step_of(path)
    manifest = path / MANIFEST
    if step is None or not manifest.is_file():
        return None
    try:
        data = json.loads(manifest.read_text())
        files: dict[str, dict[str, int | str]] = data["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    size = 0
    for rel, entry in files.items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != entry["size"] or _sha256(f) != entry["sha256"]:
            return None
        size += int(entry["size"])
    return Verified(step, path, _sha256(manifest), size)


class CheckpointStore:
    """The checkpoints of one job under `root`; `writer` names this process in the lease."""

    def __init__(self, root: Path, keep_last: int, writer: str | None = None,
                 lease_ttl_s: float = TTL_S, lease_wait_s: float = WAIT_S) -> None:
        self.root = root
        self.keep_last = keep_last
        root.mkdir(parents=True, exist_ok=True)
        self.lease = WriterLease(root, writer or writer_identity(), lease_ttl_s)
        self.lease_wait_s = lease_wait_s
        self._begun: set[Path] = set()  # temporary directories of this writer's saves

    def acquire(self, on_wait: Callable[[str], None] | None = None) -> None:
        """Become the store's only writer, waiting for a live one up to the deadline
        (LeaseHeld after it); `on_wait` hears once why it waits. Temporary directories
        left by earlier writers (saves they never finished) go now: no one else writes."""
        self.lease.acquire(self.lease_wait_s, on_wait)
        for stale in self.root.glob(f"{TMP_PREFIX}*"):
            if stale not in self._begun:
                shutil.rmtree(stale, ignore_errors=True)

    def release(self) -> None:
        """Let the next writer in at once (a writer that just stops need not be outwaited)."""
        self.lease.release()

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for the checkpoint of `step`."""
        tmp = self.root / f"{TMP_PREFIX}{PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        self._begun.add(tmp)
        return tmp

    def commit(self, tmp: Path, step: int) -> Verified:
        """Checksum, fsync and publish `tmp` as the checkpoint of `step`; prune old ones.

        Takes the lease first if this store has not (waiting as `acquire` does); raises
        LeaseLost when another writer took the store over, and CheckpointConflict when
        `step` is already published, leaving every published checkpoint as it was.
        """
        if self.lease.generation is None:
            self.acquire()
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        entries: dict[str, dict[str, int | str]] = {}
        for f in files:
            fsync_path(f)
            entries[str(f.relative_to(tmp))] = {"sha256": _sha256(f), "size": f.stat().st_size}
        write_manifest(tmp, step, entries)
        fsync_path(tmp)
        self.lease.check()
        final = self.root / f"{PREFIX}{step:08d}"
        if final.exists():
            if verify(final) is not None:
                raise CheckpointConflict(
                    f"checkpoint {final} is already published; a published checkpoint is "
                    "never replaced (another writer saved this step)")
            # Torn or corrupt (resume passed over it): kept aside as evidence, not deleted.
            os.rename(final, self.root / f"{REJECTED_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(tmp, final)  # never replaces a directory that has files
        except OSError as err:
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise CheckpointConflict(
                    f"checkpoint {final} appeared while publishing; not replaced") from None
            raise
        fsync_path(self.root)
        verified = verify(final)
        if verified is None:
            raise OSError(f"checkpoint {final} failed verification right after writing")
        # Pruning removes checkpoints: only while this writer still owns the store (a writer
        # that stalled since the check above must not delete its successor's).
        self.lease.check()
        self._prune()
        return verified

    def _prune(self) -> None:
        """This writer's unfinished saves, and published checkpoints beyond `keep_last`."""
        for tmp in list(self._begun):
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            self._begun.discard(tmp)
        steps = sorted((s, p) for p in self.root.iterdir() if (s := step_of(p)) is not None)
        for _, path in steps[: max(0, len(steps) - self.keep_last)]:
            shutil.rmtree(path, ignore_errors=True)

    def latest(self) -> Verified | None:
        """The newest checkpoint that verifies; torn or corrupt ones are passed over."""
        if not self.root.is_dir():
            return None
        candidates = sorted(
            ((s, p) for p in self.root.iterdir() if (s := step_of(p)) is not None), reverse=True
        )
        for _, path in candidates:
            found = verify(path)
            if found is not None:
                return found
        return None

    def published(self) -> list[tuple[int, Path]]:
        """Checkpoints that were published (verified when committed), oldest first."""
        return sorted(
            (s, p) for p in self.root.iterdir()
            if (s := step_of(p)) is not None and (p / MANIFEST).is_file()
        )
