"""A weight-sync cluster on one machine: the trainer's publisher in the test process, and
three engines, each the real `hf` rollout engine (a transformers model behind the engine
HTTP contract) in its own process with its own `rljob-weight-sync` sidecar process.
Everything started here is killed at teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from rljob.model.tiny_model import build_tiny, write_tiny
from rljob.weightsync.auth import SignedStore, bearer, peer_key
from rljob.weightsync.group import open_store
from rljob.weightsync.protocol import Announcement, Keys, decode_announcement
from rljob.weightsync.publisher import PublisherConfig, WeightPublisher
from rljob_api.spec import TinyModel
from tests.controlplane import REPO
from tests.polling import wait_for

ENGINES = ("e0", "e1", "e2")
SHAPE = TinyModel.model_validate(
    {"hiddenSize": 32, "numLayers": 2, "numHeads": 4, "intermediateSize": 64}
)
ALPHABET = "0123456789+-=abcdefgh"
SERVING = "hf engine serving on "


def tiny_model(seed: int) -> PreTrainedModel:
    """The test architecture; different seeds give different (random) weights."""
    model: PreTrainedModel = build_tiny(SHAPE, ALPHABET, seed)[0]
    return model.eval()  # type: ignore[no-any-return]


def _env() -> dict[str, str]:
    """The engine's and sidecar's environment: the checkout's packages come first on their
    path (the tests' `tests` package, and `runtime/` where rljob is not installed, as on a
    GPU machine that runs the tests from a copy of the tree), then whatever the parent had."""
    peer_key()  # the engines and sidecars get this process's key in their environment
    env = dict(os.environ)
    path = [str(REPO), str(REPO / "runtime"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path),
               TORCH_CPP_LOG_LEVEL="ERROR")
    return env


def http_json(url: str, body: Any = None, timeout: float = 10.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          **bearer(peer_key())})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@dataclass
class Cluster:
    publisher: WeightPublisher
    workdir: Path
    engines: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    sidecars: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    seeds: int = 0

    def start_engine(self, name: str, device: str = "cpu") -> None:
        self.seeds += 1
        model = write_tiny(self.workdir / f"model-{self.seeds}", SHAPE, ALPHABET, self.seeds,
                           "float32")
        log_path = self.workdir / f"{name}-engine-{self.seeds}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - owned by the child
        self.engines[name] = subprocess.Popen(
            [sys.executable, "-m", "rljob.engine.hf_server", "--model-path", str(model),
             "--port", "0", "--device", device],
            cwd=REPO,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

        def serving() -> str | None:
            lines = [ln for ln in log_path.read_text().splitlines() if ln.startswith(SERVING)]
            return lines[-1].removeprefix(SERVING) if lines else None

        wait_for(lambda: serving() is not None, timeout=90, what=f"engine {name} to listen",
                 describe=self.logs)
        url = serving()
        assert url is not None
        self.urls[name] = url

    def start_sidecar(self, name: str, device: str = "cpu") -> None:
        log = open(self.workdir / f"{name}-sidecar.log", "ab")  # noqa: SIM115
        self.sidecars[name] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rljob.engine.sidecar",
                "--trainer",
                f"127.0.0.1:{self.publisher.port}",
                "--engine-url",
                self.urls[name],
                "--engine-name",
                name,
                "--listen",
                "127.0.0.1:0",
                "--advertise-host",
                "127.0.0.1",
                "--device",
                device,
                "--collective-timeout",
                "6",
                "--connect-timeout",
                "10",
            ],
            cwd=REPO,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def kill(self, procs: dict[str, subprocess.Popen[bytes]], name: str) -> None:
        proc = procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def version(self, name: str) -> str:
        return str(http_json(self.urls[name] + "/get_weight_version")["weight_version"])

    def weights(self, name: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            n: torch.tensor(
                http_json(
                    self.urls[name] + "/get_weights_by_name",
                    {"name": n, "truncate_size": t.shape[0]},
                ),
                dtype=t.dtype,
            )
            for n, t in like.items()
        }

    def generate_version(self, name: str) -> str:
        out = http_json(
            self.urls[name] + "/generate",
            {
                "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 2},
                "return_logprob": True,
            },
        )
        return str(out["meta_info"]["weight_version"])

    def announcement(self) -> Announcement:
        """The latest announcement the sidecars were sent, read from the trainer's store as a
        sidecar reads it: every value is signed with the job's peer key and checked first."""
        store = SignedStore(open_store("127.0.0.1", self.publisher.port, server=False,
                                       timeout_s=30), peer_key())
        return decode_announcement(store.get(Keys.announcement(int(store.get(Keys.latest_seq)))))

    def registered(self, name: str) -> str | None:
        record = self.publisher.engines().get(name)
        return record.registration.incarnation if record else None

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
            for p in sorted(self.workdir.glob("*.log"))
        )

    def stop(self) -> None:
        for procs in (self.sidecars, self.engines):
            for name in list(procs):
                self.kill(procs, name)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("weightsync")
    publisher = WeightPublisher(
        PublisherConfig(
            port=0,
            bucket_bytes=16 << 10,
            ack_timeout_s=60,
            join_timeout_s=20,
            probe_timeout_s=1,
            max_attempts=2,
        )
    )
    c = Cluster(publisher, workdir)
    try:
        for name in ENGINES:
            c.start_engine(name)
        for name in ENGINES:
            c.start_sidecar(name)
        publisher.wait_for_engines(len(ENGINES), timeout_s=90)
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.stop()
        c.publisher.close()
