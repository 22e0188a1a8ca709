"""Faults for tests, installed from outside the product: the product has no test switches.

Each fault patches one production function in the process it runs in:

- `pause_saves_at(step)`: a checkpoint save of `step` stops just before its manifest is
  written (the files are on disk, the checkpoint is not whole), leaving `PAUSE_MARKER` next
  to the checkpoints, so a test can kill the process at that known point.
- `corrupt_broadcast_once(engine, version)`: that engine's sidecar puts a NaN into the first
  received copy of `version`, after the sender's scan and digest, as a corrupted transfer
  would.
- `nan_published_at(version)`: the trainer's publisher is handed `version` with one NaN in
  its first floating-point tensor (a copy; the trainer's own weights stay finite), as
  weights corrupted between the trainer's check and the send would be.
- `sidecar_dies_at(engine, version, once)`: that engine's sidecar process exits at once
  when `version` is announced to it, as one the OOM killer ends would; with a marker path
  `once`, only the first process to get there (the marker says one did).

Processes the test does not run itself get them from the environment through
`install_from_env`: Ray workers name it as their `worker_process_setup_hook`
(`SETUP_HOOK`), and `python -m tests.faults ARGS…` is `rljob ARGS…` with them installed.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

PAUSE_MARKER = ".save-paused"
PAUSE_SAVE_ENV = "RLJOB_TEST_PAUSE_SAVE_AT_STEP"  # STEP
CORRUPT_ENV = "RLJOB_TEST_CORRUPT_BROADCAST"  # ENGINE:VERSION
NAN_PUBLISHED_ENV = "RLJOB_TEST_NAN_PUBLISHED"  # VERSION
SIDECAR_DIES_ENV = "RLJOB_TEST_SIDECAR_DIES"  # ENGINE:VERSION:ONCE_MARKER_PATH or ENGINE:VERSION:
SETUP_HOOK = "tests.faults.install_from_env"


def pause_saves_at(step: int) -> None:
    """Stop every save of `step` in this process before its manifest, for good."""
    from rljob.checkpoint import store as checkpoint

    original = checkpoint.write_manifest

    def paused(tmp: Path, at: int, entries: dict[str, dict[str, int | str]]) -> None:
        if at == step:
            (tmp.parent / PAUSE_MARKER).write_text(str(step))
            threading.Event().wait()  # until the test kills the process
        original(tmp, at, entries)

    checkpoint.write_manifest = paused  # type: ignore[assignment]


def corrupt_broadcast_once(engine: str, version: int) -> None:
    """The first broadcast copy of `version` that `engine`'s sidecar receives gets a NaN."""
    from rljob.engine import sidecar
    from rljob.weightsync.protocol import dtype_from_name

    original = sidecar.Sidecar._receive_broadcast
    done: set[int] = set()

    def corrupted(self: sidecar.Sidecar, store: Any, ann: Any, layout: Any) -> Any:
        buffers = original(self, store, ann, layout)
        if self.config.engine_name == engine and ann.version == version and version not in done:
            done.add(version)
            first = next(m for m in layout[0].tensors
                         if dtype_from_name(m.dtype).is_floating_point)
            raw = buffers[0][first.offset : first.offset + first.nbytes]
            raw.view(dtype_from_name(first.dtype))[0] = float("nan")
        return buffers

    sidecar.Sidecar._receive_broadcast = corrupted  # type: ignore[method-assign]


def sidecar_dies_at(engine: str, version: int, once: Path | None) -> None:
    """The sidecar of `engine` exits when `version` is announced to it (every process that
    gets it, or only the first when `once` names a marker file)."""
    from rljob.engine import sidecar

    original = sidecar.Sidecar.handle

    def dying(self: sidecar.Sidecar, store: Any, ann: Any) -> Any:
        if self.config.engine_name == engine and ann.version == version:
            if once is None:
                os._exit(1)
            try:
                with once.open("x"):
                    pass
            except FileExistsError:
                pass
            else:
                os._exit(1)
        return original(self, store, ann)

    sidecar.Sidecar.handle = dying  # type: ignore[method-assign]


def nan_published_at(version: int) -> None:
    """`WeightPublisher.publish` of `version` gets a NaN in a copy of its first float tensor."""
    from rljob.weightsync import publisher

    original = publisher.WeightPublisher.publish

    def poisoned(self: publisher.WeightPublisher, at: int, named_tensors: Any) -> Any:
        named = list(named_tensors)
        if at == version:
            i = next(i for i, (_, t) in enumerate(named) if t.is_floating_point())
            name, tensor = named[i]
            bad = tensor.detach().clone()
            bad.view(-1)[0] = float("nan")
            named[i] = (name, bad)
        return original(self, at, named)

    publisher.WeightPublisher.publish = poisoned  # type: ignore[method-assign,assignment]


def install_from_env() -> None:
    """Install the faults this process's environment asks for (none when it asks none)."""
    step = os.environ.get(PAUSE_SAVE_ENV)
    if step:
        pause_saves_at(int(step))
    target = os.environ.get(CORRUPT_ENV)
    if target:
        engine, _, version = target.rpartition(":")
        corrupt_broadcast_once(engine, int(version))
    poisoned = os.environ.get(NAN_PUBLISHED_ENV)
    if poisoned:
        nan_published_at(int(poisoned))
    dies = os.environ.get(SIDECAR_DIES_ENV)
    if dies:
        engine, version, marker = dies.split(":", 2)
        sidecar_dies_at(engine, int(version), Path(marker) if marker else None)


def main() -> int:
    """`rljob` with the environment's faults installed."""
    install_from_env()
    from rljob.cli.main import main as rljob_main

    return rljob_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
