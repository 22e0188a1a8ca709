"""Nothing read from the weight-sync store is parsed before its tag under the job's peer key
checks out: over a real TCP store, a sidecar following it refuses a forged announcement
whose unpickling would create a file, and the file never appears; the same announcement
signed with the job's key is unpickled (so the refusal is what kept the file away)."""

from __future__ import annotations

import base64
import json
import logging
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rljob.engine.sidecar import Sidecar, SidecarConfig
from rljob.weightsync.auth import (
    SignedStore,
    UnauthenticatedValue,
    derive_key,
    peer_key,
    sign,
)
from rljob.weightsync.group import open_store
from rljob.weightsync.protocol import Announcement, Keys, decode_ack, encode
from rljob_api import env
from tests.polling import wait_for

pytestmark = pytest.mark.runtime
KEY = "a" * 64


class _Touch:
    """A pickle that creates `path` when it is unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.path), "w")


@pytest.fixture
def store() -> Iterator[tuple[SignedStore, int]]:
    raw = open_store("127.0.0.1", 0, server=True, timeout_s=10)
    yield SignedStore(raw, KEY), int(raw.port)
    del raw


def test_values_are_read_only_under_the_key_and_the_name_they_were_signed_for(
        store: tuple[SignedStore, int]) -> None:
    signed, port = store
    client = open_store("127.0.0.1", port, server=False, timeout_s=10)
    signed.set("ws/a", '{"x": 1}')
    assert SignedStore(client, KEY).get("ws/a") == b'{"x": 1}'
    with pytest.raises(UnauthenticatedValue, match="'ws/a' is not signed with this job's"):
        SignedStore(client, "b" * 64).get("ws/a")  # another job's key
    client.set("ws/b", '{"x": 2}')  # a stranger's write, untagged
    with pytest.raises(UnauthenticatedValue, match="refused unread"):
        signed.get("ws/b")
    client.set("ws/c", client.get("ws/a").decode())  # a signed value under another name
    with pytest.raises(UnauthenticatedValue):
        signed.get("ws/c")
    client.set("ws/d", (sign(KEY, "ws/d", b'{"x": 1}')[:-1] + b"2").decode())  # changed
    with pytest.raises(UnauthenticatedValue):
        signed.get("ws/d")


def test_the_key_comes_from_the_environment_the_ray_token_or_is_made_once() -> None:
    assert peer_key({env.PEER_KEY: "given"}) == "given"
    pods = {env.RAY_AUTH_TOKEN: "t" * 64}
    derived = peer_key(pods)
    # Every pod of the job (one Ray token) has the same key, which is not the token itself,
    # and is put into the environment its children inherit.
    assert derived == derive_key("t" * 64) == pods[env.PEER_KEY] and "t" * 64 not in derived
    assert peer_key({env.RAY_AUTH_TOKEN: "u" * 64}) != derived
    laptop: dict[str, str] = {}
    made = peer_key(laptop)
    assert len(made) == 64 and peer_key(laptop) == made == laptop[env.PEER_KEY]
    assert peer_key({}) != made


def test_a_sidecar_refuses_a_forged_announcement_before_unpickling_it(
        store: tuple[SignedStore, int], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    signed, port = store
    marker = tmp_path / "unpickled"
    handles = base64.b64encode(pickle.dumps(_Touch(marker))).decode()
    # On the sidecar's GPU: it would copy the version out of these CUDA IPC handles.
    forged = Announcement(seq=1, version=1, epoch=1, transport="broadcast", roster={},
                          backend="gloo", layout=[], ipc={"e": handles})
    # A stranger who reaches the store writes it untagged, or tagged under a key of its own.
    signed.raw.set(Keys.announcement(1), encode(forged).encode())
    config = SidecarConfig(engine_name="e", engine_url="http://127.0.0.1:9",
                           trainer_host="127.0.0.1", trainer_port=port, listen_host="127.0.0.1",
                           listen_port=0, device="cpu", reconnect_backoff_s=0.1)
    sidecar = Sidecar(config, key=KEY)
    caplog.set_level(logging.WARNING, logger="rljob.engine.sidecar")
    thread = threading.Thread(target=sidecar.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: "refused unread" in caplog.text, timeout=30,
                 what="the sidecar to refuse the forged announcement",
                 describe=lambda: caplog.text)
        signed.raw.set(Keys.announcement(1), sign("f" * 64, Keys.announcement(1),
                                                  encode(forged)))
        refusals = caplog.text.count("refused unread")
        wait_for(lambda: caplog.text.count("refused unread") > refusals, timeout=30,
                 what="the sidecar to refuse it signed with another key")
        assert not marker.exists(), "a forged announcement was unpickled"
        assert not signed.raw.check([Keys.ack(1, "e")]), "nothing was acknowledged"

        # The same announcement under the job's key is unpickled: the tag alone kept the
        # file away. (Its handles are no tensors, so the version is refused afterwards.)
        signed.set(Keys.announcement(1), encode(forged))
        ack = wait_for(lambda: signed.raw.check([Keys.ack(1, "e")])
                       and decode_ack(signed.get(Keys.ack(1, "e"))), timeout=30,
                       what="the sidecar to handle the signed announcement")
        assert not ack.ok and "receiving version 1 failed" in ack.reason, ack
        assert marker.exists()
    finally:
        sidecar.stop()
        thread.join(timeout=30)


def test_the_kind_suites_foreign_pod_is_refused_by_an_engine_and_the_trainer(
        tmp_path: Path) -> None:
    """The probe the kind suite runs in a pod of another namespace (e2e/kind/foreign_peer.py),
    run here as its own process against a real hf engine and the trainer's store, as it finds
    them where no network plugin enforces the job's NetworkPolicy: both engine routes answer
    401, the update's pickle is never unpickled, the trainer's values carry their tag, and
    the made-up engine it registers is not taken into the trainer's group."""
    import os
    import subprocess
    import sys

    from e2e.kind.foreign_peer import PROBE, RESULT
    from rljob.engine.hf_server import HFEngine, ServerThread
    from rljob.model.tiny_model import write_tiny
    from rljob.weightsync.publisher import PublisherConfig, WeightPublisher
    from rljob_api.spec import TinyModel

    model = write_tiny(tmp_path / "m", TinyModel(), "0123456789+=", 1, "float32")
    server = ServerThread(HFEngine(str(model), "float32", "cpu", "0"))
    publisher = WeightPublisher(PublisherConfig(port=0))
    marker = tmp_path / "unpickled"
    try:
        environ = {k: v for k, v in os.environ.items() if k != env.PEER_KEY}
        environ.update(ENGINE_URL=server.url, STORE_HOST="127.0.0.1",
                       STORE_PORT=str(publisher.port), GCS_HOST="127.0.0.1", GCS_PORT="9",
                       MARKER=str(marker), RESULT=RESULT)
        run = subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True,
                             text=True, timeout=120, check=False)
        lines = [line for line in run.stdout.splitlines() if line.startswith(RESULT)]
        assert run.returncode == 0 and lines, run.stderr[-3000:]
        seen = json.loads(lines[-1][len(RESULT):])
        assert seen["generate"]["status"] == 401 and seen["update"]["status"] == 401, seen
        assert not marker.exists()
        assert seen["store"]["reachable"] and seen["store"]["forged_member"] == 0, seen
        value = seen["store"]["trainer_value"]
        assert value[64:] == publisher.incarnation and len(value) == 64 + 32, value
        assert "foreign-peer" not in publisher.engines()
        assert seen["ray_gcs"] == {"error": seen["ray_gcs"]["error"]}  # nothing listens on 9
    finally:
        publisher.close()
        server.stop()
