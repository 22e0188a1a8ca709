"""One writer per checkpoint store: a second driver waits or gives up, a driver whose lease
was taken over cannot publish, and no published checkpoint is ever replaced."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rljob.checkpoint.store import CheckpointConflict, CheckpointStore, LeaseHeld, verify
from tests.controlplane import REPO
from tests.polling import wait_for

pytestmark = pytest.mark.unit

# A driver of its own: takes the store, saves steps 1 and 2, says so, then saves step 3
# when told to (a line on stdin), and exits 0 (published), 7 (lease lost) or 8 (conflict).
WRITER = """
import sys
from pathlib import Path
from rljob.checkpoint.store import CheckpointConflict, CheckpointStore, LeaseLost
store = CheckpointStore(Path(sys.argv[1]), keep_last=10, writer="old-driver",
                        lease_ttl_s=float(sys.argv[2]))
store.acquire()

def save(step):
    tmp = store.begin(step)
    (tmp / "model.bin").write_bytes(b"old" * 1000)
    store.commit(tmp, step)

save(1)
save(2)
print("saved", flush=True)
sys.stdin.readline()
try:
    save(3)
except LeaseLost as err:
    print(f"LOST: {err}", flush=True)
    sys.exit(7)
except CheckpointConflict as err:
    print(f"CONFLICT: {err}", flush=True)
    sys.exit(8)
print("published", flush=True)
store.release()
"""


class Writer:
    """The WRITER process, its output in a file the test polls."""

    def __init__(self, root: Path, ttl_s: float, log: Path) -> None:
        self.log = log
        self.out = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(ttl_s)], stdin=subprocess.PIPE,
            stdout=self.out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
        wait_for(lambda: "saved" in self.text(), timeout=60, what="the writer to save steps 1-2",
                 describe=self.text)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def go_on(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"\n")
        self.proc.stdin.flush()
        return self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.out.close()


@pytest.fixture
def writers(tmp_path: Path) -> Iterator[list[Writer]]:
    started: list[Writer] = []
    yield started
    for w in started:
        w.stop()


def _save(store: CheckpointStore, step: int, payload: bytes) -> Path:
    tmp = store.begin(step)
    (tmp / "model.bin").write_bytes(payload * 1000)
    return store.commit(tmp, step).path


def _published(root: Path) -> dict[str, bytes]:
    """Every published checkpoint that verifies, with its payload."""
    out = {}
    for path in sorted(root.glob("step_*")):
        assert verify(path) is not None, f"{path} no longer verifies"
        out[path.name] = (path / "model.bin").read_bytes()
    return out


def test_a_writer_whose_lease_was_taken_over_cannot_commit(
        tmp_path: Path, writers: list[Writer]) -> None:
    """The partition case: the old driver stops heartbeating (SIGSTOP: alive, silent), its
    lease expires, a new driver takes the store and saves step 3; when the old one comes
    back it tries to save step 3 too, and stops without touching anything published."""
    root = tmp_path / "checkpoints"
    old = Writer(root, ttl_s=2.0, log=tmp_path / "old.log")
    writers.append(old)
    old.proc.send_signal(signal.SIGSTOP)

    waits: list[str] = []
    new = CheckpointStore(root, keep_last=10, writer="new-driver", lease_wait_s=60)
    new.acquire(on_wait=waits.append)
    (said,) = waits  # the old lease was still live: the newcomer waited for it to expire
    assert "old-driver" in said and "waiting" in said
    _save(new, 3, b"new")

    old.proc.send_signal(signal.SIGCONT)
    assert old.go_on() == 7, old.text()
    assert "lost the checkpoint store" in old.text()
    assert _published(root) == {"step_00000001": b"old" * 1000, "step_00000002": b"old" * 1000,
                                "step_00000003": b"new" * 1000}
    # The new writer still owns the store and goes on publishing.
    _save(new, 4, b"new")
    assert sorted(_published(root)) == [f"step_0000000{s}" for s in (1, 2, 3, 4)]
    new.release()


def test_a_live_writer_keeps_a_newcomer_out_until_its_deadline(
        tmp_path: Path, writers: list[Writer]) -> None:
    root = tmp_path / "checkpoints"
    old = Writer(root, ttl_s=1.0, log=tmp_path / "old.log")
    writers.append(old)
    start = time.monotonic()
    newcomer = CheckpointStore(root, keep_last=10, writer="new-driver", lease_wait_s=4)
    with pytest.raises(LeaseHeld, match=r"in use by old-driver.*retryable"):
        newcomer.acquire()
    # Four TTLs passed: the holder's heartbeat kept its lease live all along.
    assert time.monotonic() - start >= 4
    assert old.go_on() == 0, old.text()  # it still owned the store: step 3 is published
    assert sorted(_published(root)) == ["step_00000001", "step_00000002", "step_00000003"]
    # It released the store on its way out: the next writer gets in without waiting.
    waits: list[str] = []
    newcomer.acquire(on_wait=waits.append)
    assert waits == []
    newcomer.release()


def test_a_killed_writer_on_this_machine_is_not_outwaited(
        tmp_path: Path, writers: list[Writer]) -> None:
    """Same boot and PID namespace, no such process: its lease is free at once, even though
    its heartbeat is younger than its TTL."""
    root = tmp_path / "checkpoints"
    old = Writer(root, ttl_s=600.0, log=tmp_path / "old.log")
    writers.append(old)
    old.proc.send_signal(signal.SIGKILL)
    old.proc.wait(timeout=30)
    start = time.monotonic()
    CheckpointStore(root, keep_last=10, writer="new-driver", lease_wait_s=30).acquire()
    assert time.monotonic() - start < 10


def test_commit_never_replaces_a_published_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=10)
    first = _save(store, 1, b"a")
    with pytest.raises(CheckpointConflict, match="already published"):
        _save(store, 1, b"b")
    assert (first / "model.bin").read_bytes() == b"a" * 1000 and verify(first) is not None
    store.release()


def test_a_torn_step_directory_is_set_aside_not_deleted(tmp_path: Path) -> None:
    """A step directory that does not verify (passed over on resume) is kept as evidence
    under another name when the step is saved again."""
    torn = tmp_path / "step_00000002"
    torn.mkdir()
    (torn / "model.bin").write_bytes(b"torn")
    store = CheckpointStore(tmp_path, keep_last=10)
    saved = _save(store, 2, b"c")
    assert verify(saved) is not None and (saved / "model.bin").read_bytes() == b"c" * 1000
    (aside,) = tmp_path.glob(".rejected-step_00000002-*")
    assert (aside / "model.bin").read_bytes() == b"torn"
    store.release()


def test_without_hard_links_the_lease_is_still_exclusive(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Filesystems without hard links (SMB shares) refuse `link`: the lease is then taken by
    an exclusive create, and a second writer still cannot get in while it is live."""
    def no_links(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    first = CheckpointStore(tmp_path, keep_last=10, writer="first")
    first.acquire()
    second = CheckpointStore(tmp_path, keep_last=10, writer="second", lease_wait_s=1)
    with pytest.raises(LeaseHeld, match="in use by first"):
        second.acquire()
    _save(first, 1, b"a")
    first.release()
    second.acquire()
    _save(second, 2, b"b")
    assert sorted(_published(tmp_path)) == ["step_00000001", "step_00000002"]
    second.release()
