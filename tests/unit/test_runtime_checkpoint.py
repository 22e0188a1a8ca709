"""Checkpoints are atomic and verified; a kill mid-save leaves the previous one in use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rljob.checkpoint.store import CheckpointStore, verify
from tests.controlplane import REPO
from tests.faults import PAUSE_MARKER, PAUSE_SAVE_ENV
from tests.polling import wait_for

pytestmark = pytest.mark.unit


def _save(store: CheckpointStore, step: int, payload: bytes = b"x") -> Path:
    tmp = store.begin(step)
    (tmp / "model.bin").write_bytes(payload * 1000)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "state.json").write_text(f'{{"step": {step}}}')
    return store.commit(tmp, step).path


def test_commit_publishes_a_verified_directory_and_keeps_last_k(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        _save(store, step)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    latest = store.latest()
    assert latest is not None and latest.step == 3 and latest.size_bytes > 1000
    assert len(latest.checksum) == 64


def test_a_corrupted_checkpoint_is_passed_over(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    _save(store, 1)
    newest = _save(store, 2)
    (newest / "model.bin").write_bytes(b"y" * 1000)  # same size, different bytes
    assert verify(newest) is None
    latest = store.latest()
    assert latest is not None and latest.step == 1


def test_a_checkpoint_missing_a_file_is_passed_over(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    _save(store, 1)
    (_save(store, 2) / "sub" / "state.json").unlink()
    latest = store.latest()
    assert latest is not None and latest.step == 1


SAVER = """
import sys
from pathlib import Path
from rljob.checkpoint.store import CheckpointStore
from tests.faults import install_from_env
install_from_env()
store = CheckpointStore(Path(sys.argv[1]), keep_last=3)
for step in (1, 2):
    tmp = store.begin(step)
    (tmp / "model.bin").write_bytes(bytes([step]) * 100000)
    store.commit(tmp, step)
"""


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_in_use(tmp_path: Path) -> None:
    env = {**os.environ, PAUSE_SAVE_ENV: "2", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)], env=env)
    try:
        wait_for(lambda: (tmp_path / PAUSE_MARKER).exists(), timeout=60,
                 what="the save of step 2 to pause mid-way")
        # step 2's files are written, its manifest is not: the torn save is on disk now
        assert any(p.name.startswith(".tmp-step_00000002") for p in tmp_path.iterdir())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    latest = CheckpointStore(tmp_path, keep_last=3).latest()
    assert latest is not None and latest.step == 1
    assert (latest.path / "model.bin").read_bytes() == bytes([1]) * 100000
    # the next save cleans up the torn one
    store = CheckpointStore(tmp_path, keep_last=3)
    _save(store, 3)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
