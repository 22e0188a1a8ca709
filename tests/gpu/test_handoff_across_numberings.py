"""The sidecar-to-engine handoff between processes that number their GPUs differently, as
processes of different containers (or with different CUDA_VISIBLE_DEVICES) do.

The sender and the receiver are separate processes, each shown the GPUs it would be
allocated. The handle names the GPU by UUID (what SGLang's patched reductions expect), and
the receiver opens it on its own index of that GPU. One GPU: the receiver names it by UUID,
the sender by index. Two or more: the receiver sees the sender's GPU under another index.
Skips, with the reason, where there is no CUDA GPU.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rljob.weightsync import wire

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SENDER = """
import sys, time, torch
from pathlib import Path
from rljob.weightsync.wire import encode_flattened
flat = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
named = [("a", flat[: 1 << 19].view(512, 1024)), ("b", flat[1 << 19 :])]
Path(sys.argv[1]).write_text(encode_flattened(named, flat))
torch.cuda.synchronize()
while not Path(sys.argv[2]).exists():  # the memory stays until the receiver has read it
    time.sleep(0.05)
"""

RECEIVER = """
import sys, torch
from pathlib import Path
from rljob.weightsync.wire import decode_named_tensors
named = dict(decode_named_tensors(Path(sys.argv[1]).read_text()))
want = torch.arange(1 << 20, dtype=torch.float32, device=named["a"].device)
assert torch.equal(named["a"].reshape(-1), want[: 1 << 19])
assert torch.equal(named["b"], want[1 << 19 :])
print(named["a"].device.index, torch.cuda.get_device_properties(named["a"].device).uuid)
"""


def _uuids() -> list[str]:
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


class _Recorder(pickle.Unpickler):
    """Reads a handle without opening it: the arguments of each CUDA rebuild."""

    calls: list[tuple[Any, ...]]

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return lambda *args: self.calls.append(args)
        return super().find_class(module, name)


def _handoff(tmp_path: Path, sender_sees: str, receiver_sees: str) -> tuple[str, str]:
    """Send from a process seeing `sender_sees`, receive in one seeing `receiver_sees`;
    the device the sender's handle names, and the receiver's index and UUID of the GPU it
    opened the tensor on."""
    entry, done = tmp_path / "entry", tmp_path / "done"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": sender_sees}
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(entry), str(done)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not (entry.exists() and entry.stat().st_size):
            assert sender.poll() is None, f"the sender exited with {sender.returncode}"
            assert time.monotonic() < deadline, "the sender wrote no handle within 120 s"
            time.sleep(0.1)
        recorder = _Recorder(io.BytesIO(base64.b64decode(entry.read_text())))
        recorder.calls = []
        recorder.load()
        named = str(recorder.calls[0][wire._CUDA_DEVICE_ARG])
        out = subprocess.run([sys.executable, "-c", RECEIVER, str(entry)], check=True,
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": receiver_sees})
        return named, out.stdout.strip()
    finally:
        done.touch()
        sender.wait(timeout=60)


def test_the_handle_names_the_gpu_by_uuid_and_opens_where_the_receiver_sees_it(
        tmp_path: Path) -> None:
    (first, *_) = _uuids()
    named, opened = _handoff(tmp_path, "0", f"GPU-{first}")
    assert named == first  # a UUID, as SGLang's patched rebuild asserts, never an index
    assert opened == f"0 {first}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_receiver_that_numbers_the_gpu_otherwise_opens_it_on_the_same_gpu(
        tmp_path: Path) -> None:
    uuids = _uuids()
    # The sender sees only physical GPU 1 (its cuda:0); the receiver sees 0 and 1.
    named, opened = _handoff(tmp_path, "1", "0,1")
    assert named == uuids[1]
    assert opened == f"1 {uuids[1]}"
