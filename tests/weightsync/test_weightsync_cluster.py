"""One trainer, three engines, each engine with its sidecar, all separate processes (gloo).

The tests run in order on one cluster: each leaves every engine at the trainer's version.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rljob.weightsync import disk
from rljob.weightsync.group import BroadcastGroup
from rljob.weightsync.protocol import bucket_digest, pack_bucket, plan_buckets, version_digest
from rljob.weightsync.publisher import PublisherConfig, WeightPublisher
from tests.polling import wait_for
from tests.weightsync.conftest import ENGINES, Cluster, http_json, tiny_model

pytestmark = pytest.mark.runtime


class Trainer:
    """The trainer's weights; `step` changes every parameter, as an optimizer step would."""

    def __init__(self) -> None:
        self.model = tiny_model(seed=1000)
        self.version = 0

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def step(self) -> int:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        self.version += 1
        return self.version


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    return Trainer()


def assert_engine_matches(cluster: Cluster, name: str, expected: dict[str, torch.Tensor]) -> None:
    got = cluster.weights(name, expected)
    differing = [n for n, t in expected.items() if not torch.equal(got[n], t)]
    assert not differing, f"engine {name} differs from the trainer in {differing[:5]}"


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.params().items()}


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, object]]:
    """Arms a one-shot action run in the trainer just before broadcasting bucket `at`."""
    armed: dict[str, object] = {}
    original = BroadcastGroup.broadcast
    calls = {"n": 0}

    def broadcast(self: BroadcastGroup, buf: torch.Tensor, root: int = 0) -> None:
        if self.rank == 0 and armed:
            calls["n"] += 1
            if calls["n"] == armed["at"]:
                action = armed.pop("action")
                armed.clear()
                assert callable(action)
                action(buf)
        original(self, buf, root)

    monkeypatch.setattr(BroadcastGroup, "broadcast", broadcast)
    yield armed


def test_every_engine_equals_the_trainer_bit_for_bit(cluster: Cluster, trainer: Trainer) -> None:
    for _ in range(2):
        version = trainer.step()
        result = cluster.publisher.publish(version, trainer.params().items())
        assert result.stale == {}, cluster.logs()
        assert result.acked == list(ENGINES)
        assert result.bytes_per_engine > 3 * (16 << 10), "the test wants several buckets"
        announcement = cluster.announcement()
        assert (announcement.version, announcement.backend, announcement.ipc) == (
            version, "gloo", {})
        assert set(announcement.roster) == set(ENGINES)
        for name in ENGINES:
            assert cluster.version(name) == str(version)
            assert cluster.generate_version(name) == str(version)
            assert_engine_matches(cluster, name, trainer.params())


def test_nan_in_one_bucket_is_rejected_and_engines_keep_serving_the_previous_version(
    cluster: Cluster, trainer: Trainer, fault: dict[str, object]
) -> None:
    before = snapshot(trainer)
    previous = trainer.version

    def poison(buf: torch.Tensor) -> None:
        # Corrupt the wire copy after the trainer scanned and digested it.
        buf[:4].view(torch.float32)[0] = float("nan")

    fault.update(at=2, action=poison)
    cluster.publisher.config = dataclasses.replace(cluster.publisher.config, max_attempts=1)
    try:
        version = trainer.step()
        result = cluster.publisher.publish(version, trainer.params().items())
    finally:
        cluster.publisher.config = dataclasses.replace(cluster.publisher.config, max_attempts=2)
    assert result.acked == []
    assert set(result.stale) == set(ENGINES)
    for name, reason in result.stale.items():
        assert "bucket 1 has non-finite values" in reason and "1 NaN" in reason, reason
        assert "digest mismatch" in reason, reason
        assert cluster.version(name) == str(previous)
        assert cluster.generate_version(name) == str(previous)
        assert_engine_matches(cluster, name, before)
    health = http_json(cluster.publisher.engines()["e0"].registration.health_url + "/health")
    assert "non-finite" in health["last_rejection"]

    resynced = cluster.publisher.resync(trainer.params().items())
    assert resynced.acked == list(ENGINES) and resynced.stale == {}
    for name in ENGINES:
        assert cluster.version(name) == str(version)
        assert_engine_matches(cluster, name, trainer.params())


@pytest.mark.parametrize("error", [ValueError, TypeError, RuntimeError])
def test_a_collective_error_of_any_type_fails_only_that_delivery(
    cluster: Cluster, trainer: Trainer, fault: dict[str, object], error: type[Exception]
) -> None:
    """NCCL reports a CPU tensor as ValueError, other misuse as TypeError, a lost peer as
    RuntimeError: each is this version's failure for the engines, reported with its type,
    and the second delivery (through a fresh group) installs the version."""

    def fail(_: torch.Tensor) -> None:
        raise error("Tensors must be CUDA and dense")

    fault.update(at=1, action=fail)
    version = trainer.step()
    result = cluster.publisher.publish(version, trainer.params().items())
    assert result.acked == list(ENGINES) and result.stale == {}, cluster.logs()
    assert result.attempts == 2
    cause = (
        f"broadcast of version {version} failed at the trainer: "
        f"{error.__name__}: Tensors must be CUDA and dense"
    )
    assert sorted(r.split(":")[0] for r in result.rejections) == list(ENGINES)
    assert all(cause in r for r in result.rejections), result.rejections
    for name in ENGINES:
        assert cluster.version(name) == str(version)
        assert_engine_matches(cluster, name, trainer.params())


def test_restarted_sidecar_rejoins_at_the_next_version(cluster: Cluster, trainer: Trainer) -> None:
    old = cluster.registered("e1")
    cluster.kill(cluster.sidecars, "e1")
    cluster.start_sidecar("e1")
    wait_for(
        lambda: cluster.registered("e1") not in (None, old),
        timeout=60,
        what="the restarted sidecar to register",
        describe=cluster.logs,
    )
    version = trainer.step()
    result = cluster.publisher.publish(version, trainer.params().items())
    assert result.acked == list(ENGINES), result.stale
    assert_engine_matches(cluster, "e1", trainer.params())
    metrics = http_json_text(cluster.publisher.engines()["e1"].registration.health_url + "/metrics")
    assert f"rljob_weight_sync_engine_version {float(version)}" in metrics


def http_json_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def test_engine_killed_mid_sync_is_left_behind_then_resynced(
    cluster: Cluster, trainer: Trainer, fault: dict[str, object]
) -> None:
    def kill_e2(_: torch.Tensor) -> None:
        cluster.kill(cluster.sidecars, "e2")
        cluster.kill(cluster.engines, "e2")

    fault.update(at=3, action=kill_e2)
    version = trainer.step()
    result = cluster.publisher.publish(version, trainer.params().items())
    assert result.acked == ["e0", "e1"], cluster.logs()
    assert set(result.stale) == {"e2"}
    assert "sidecar" in result.stale["e2"], result.stale
    assert result.seconds < cluster.publisher.config.ack_timeout_s
    for name in ("e0", "e1"):
        assert_engine_matches(cluster, name, trainer.params())

    old = cluster.registered("e2")
    cluster.start_engine("e2")
    cluster.start_sidecar("e2")
    wait_for(
        lambda: cluster.registered("e2") not in (None, old),
        timeout=60,
        what="the new e2 sidecar to register",
        describe=cluster.logs,
    )
    resynced = cluster.publisher.resync(trainer.params().items())
    assert resynced.acked == ["e2"], resynced.stale
    assert cluster.version("e2") == str(version)
    assert_engine_matches(cluster, "e2", trainer.params())


def test_disk_mode_delivers_verified_safetensors_versions(
    cluster: Cluster, trainer: Trainer, tmp_path: Path
) -> None:
    cluster.publisher.config = dataclasses.replace(
        cluster.publisher.config, transport="disk", disk_dir=tmp_path, keep_disk_versions=1
    )
    try:
        for _ in range(2):
            version = trainer.step()
            result = cluster.publisher.publish(version, trainer.params().items())
            assert result.acked == list(ENGINES), result.stale
            for name in ENGINES:
                assert_engine_matches(cluster, name, trainer.params())
    finally:
        cluster.publisher.config = dataclasses.replace(
            cluster.publisher.config, transport="broadcast", disk_dir=None
        )
    # One directory of this publisher's attempt, holding the newest version only.
    (attempt,) = tmp_path.iterdir()
    assert attempt.name.startswith(disk.ATTEMPT_PREFIX)
    assert [p.name for p in attempt.iterdir()] == [disk.version_dir(attempt, version).name]
    assert (disk.version_dir(attempt, version) / disk.INDEX).exists()


def test_restarted_trainer_resumes_at_its_version(cluster: Cluster, trainer: Trainer) -> None:
    port = cluster.publisher.port
    resumed_at = trainer.version
    cluster.publisher.close()
    cluster.publisher = WeightPublisher(
        PublisherConfig(
            port=port, bucket_bytes=16 << 10, ack_timeout_s=60, join_timeout_s=20, probe_timeout_s=1
        ),
        start_version=resumed_at,
    )
    cluster.publisher.wait_for_engines(len(ENGINES), timeout_s=60)
    with pytest.raises(ValueError, match="must be greater"):
        cluster.publisher.publish(resumed_at, trainer.params().items())
    version = trainer.step()
    result = cluster.publisher.publish(version, trainer.params().items())
    assert result.acked == list(ENGINES), result.stale
    for name in ENGINES:
        assert cluster.version(name) == str(version)


def _leave_versions(root: Path, versions: range, weights: dict[str, torch.Tensor]) -> None:
    """What a crashed attempt leaves: complete, valid versions of other weights."""
    named = list(weights.items())
    plan = plan_buckets(named, 16 << 10)
    digests = [bucket_digest(pack_bucket(b, [weights[m.name] for m in b.tensors])) for b in plan]
    for v in versions:
        disk.write_version(root, v, plan, weights, digests, version_digest(v, plan, digests))


def test_a_resumed_publisher_installs_only_its_own_disk_versions(
    cluster: Cluster, trainer: Trainer, tmp_path: Path
) -> None:
    """A driver crashed after publishing versions past its last checkpoint: the weights
    directory holds those numbers with other weights, bare (the layout before attempts) and
    in that attempt's directory. The resumed publisher starts at the checkpoint's version and
    publishes the same numbers again; with the digest check off (nothing else would notice a
    wrong directory) the engines still install only what this attempt wrote."""
    resumed_at = trainer.version
    crashed = {n: t.clone() for n, t in tiny_model(seed=4242).named_parameters()}
    leftovers = range(resumed_at + 1, resumed_at + 3)
    _leave_versions(tmp_path, leftovers, crashed)
    _leave_versions(disk.attempt_dir(tmp_path, "crashed00000"), leftovers, crashed)
    port = cluster.publisher.port
    cluster.publisher.close()
    cluster.publisher = WeightPublisher(
        PublisherConfig(port=port, transport="disk", disk_dir=tmp_path, verify_digest=False,
                        bucket_bytes=16 << 10, ack_timeout_s=60, join_timeout_s=20,
                        probe_timeout_s=1),
        start_version=resumed_at,
    )
    try:
        cluster.publisher.wait_for_engines(len(ENGINES), timeout_s=60)
        for _ in leftovers:
            version = trainer.step()
            result = cluster.publisher.publish(version, trainer.params().items())
            assert result.acked == list(ENGINES), result.stale
            for name in ENGINES:
                assert cluster.version(name) == str(version)
                assert_engine_matches(cluster, name, trainer.params())
    finally:
        cluster.publisher.config = dataclasses.replace(
            cluster.publisher.config, transport="broadcast", disk_dir=None
        )
    # Only this attempt's versions remain.
    (attempt,) = tmp_path.iterdir()
    assert attempt == disk.attempt_dir(tmp_path, cluster.publisher.incarnation[:12])


def test_redeliver_sends_the_current_version_to_engines_that_had_it(
    cluster: Cluster, trainer: Trainer
) -> None:
    """An engine that dropped its weights while the trainer ran (SGLang releasing its memory)
    still reports the version; a resync passes it over, a redelivery makes it whole."""
    version = trainer.step()
    assert cluster.publisher.publish(version, trainer.params().items()).acked == list(ENGINES)
    initial = http_json(cluster.urls["e0"] + "/get_model_info")["model_path"]
    out = http_json(cluster.urls["e0"] + "/update_weights_from_disk",
                    {"model_path": initial, "weight_version": str(version)})
    assert out["success"], out
    assert cluster.version("e0") == str(version)
    with pytest.raises(AssertionError, match="differs"):
        assert_engine_matches(cluster, "e0", trainer.params())

    assert cluster.publisher.resync(trainer.params().items()).acked == []
    result = cluster.publisher.redeliver(trainer.params().items())
    assert result.acked == list(ENGINES), result.stale
    assert result.attempts == 1 and result.version == version
    for name in ENGINES:
        assert_engine_matches(cluster, name, trainer.params())
