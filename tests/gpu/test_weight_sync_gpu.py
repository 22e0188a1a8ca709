"""Weight sync on real GPUs, through the product's publisher, sidecar and `hf` engine.

- An NCCL group member is handed only buffers on its own GPU (a world-size-1 group).
- A sidecar on the trainer's own GPU (colocated) receives by CUDA IPC: NCCL cannot hold
  one GPU twice in a group (`Duplicate GPU detected`).
- With two GPUs: a disaggregated engine on GPU 1 receives by an NCCL broadcast from the
  trainer on GPU 0.
- A sidecar staging on the CPU is refused a place in an NCCL group, with the reason.

Each engine and sidecar is its own process, as in a job. Skips (with the reason) where there
is no CUDA GPU; the two-GPU test also where there is only one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch._C._distributed_c10d import HashStore

from rljob.weightsync.group import BroadcastGroup
from rljob.weightsync.protocol import Announcement
from rljob.weightsync.publisher import PublisherConfig, WeightPublisher
from tests.weightsync.conftest import Cluster, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
COLOCATED, REMOTE, CPU_STAGED = "colocated", "remote", "cpu-staged"


def test_an_nccl_group_is_handed_only_buffers_on_its_own_gpu() -> None:
    group = BroadcastGroup(HashStore(), epoch_prefix="g/", rank=0, size=1, backend="nccl",
                           device="cuda", timeout_s=60)
    try:
        assert group.device == torch.device("cuda", torch.cuda.current_device())
        buf = torch.arange(16, dtype=torch.uint8, device=group.device)
        group.broadcast(buf)
        assert buf.tolist() == list(range(16))
        with pytest.raises(ValueError, match=f"works on {group.device}; refusing to hand it a "
                           "buffer on cpu"):
            group.broadcast(torch.arange(16, dtype=torch.uint8))
    finally:
        group.close()


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Trainer (publisher, NCCL) on cuda:0; engines each with their own sidecar process."""
    workdir = tmp_path_factory.mktemp("weightsync-gpu")
    publisher = WeightPublisher(PublisherConfig(
        port=0, backend="nccl", device="cuda:0", bucket_bytes=16 << 10, ack_timeout_s=120,
        join_timeout_s=60, probe_timeout_s=2, max_attempts=1))
    cluster = Cluster(publisher, workdir)
    engines = {COLOCATED: ("cuda:0", "cuda:0"), CPU_STAGED: ("cpu", "cpu")}
    if TWO_GPUS:
        engines[REMOTE] = ("cuda:1", "cuda:1")
    try:
        for name, (engine_device, _) in engines.items():
            cluster.start_engine(name, engine_device)
        for name, (_, sidecar_device) in engines.items():
            cluster.start_sidecar(name, sidecar_device)
        publisher.wait_for_engines(len(engines), timeout_s=120)
        yield cluster
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()
        publisher.close()


def _published(cluster: Cluster, version: int, params: dict[str, torch.Tensor]) -> Announcement:
    """Publish `params` as `version`; the announcement the sidecars were sent."""
    result = cluster.publisher.publish(version, params.items())
    expected = {COLOCATED, REMOTE} if TWO_GPUS else {COLOCATED}
    assert set(result.acked) == expected, (result.stale, cluster.logs())
    return cluster.announcement()


def _engine_equals(cluster: Cluster, name: str, params: dict[str, torch.Tensor]) -> None:
    expected = {n: t.detach().cpu() for n, t in params.items()}
    got = cluster.weights(name, expected)
    differing = [n for n, t in expected.items() if not torch.equal(got[n], t)]
    assert not differing, f"engine {name} differs from the trainer in {differing[:5]}"
    assert cluster.generate_version(name) == cluster.version(name)


def test_the_colocated_engine_receives_by_cuda_ipc_from_cpu_or_gpu_weights(
    gpu_cluster: Cluster,
) -> None:
    # Version 1 from CPU tensors (what the megatron actor used to hand over), version 2 from
    # the trainer's GPU: either way the buckets are packed on the trainer's GPU.
    for version, device in ((1, "cpu"), (2, "cuda:0")):
        params = {n: p.detach().to(device) for n, p in tiny_model(seed=version).named_parameters()}
        announcement = _published(gpu_cluster, version, params)
        assert list(announcement.ipc) == [COLOCATED] and COLOCATED not in announcement.roster
        assert gpu_cluster.version(COLOCATED) == str(version)
        _engine_equals(gpu_cluster, COLOCATED, params)


def test_a_cpu_staging_sidecar_is_refused_by_an_nccl_publisher_with_the_reason(
    gpu_cluster: Cluster,
) -> None:
    params = {n: p.detach() for n, p in tiny_model(seed=3).named_parameters()}
    result = gpu_cluster.publisher.publish(3, params.items())
    assert set(result.stale) == {CPU_STAGED}
    assert "stages on the CPU" in result.stale[CPU_STAGED]
    assert gpu_cluster.version(CPU_STAGED) == "0"


@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs (trainer on 0, engine on 1)")
def test_a_disaggregated_engine_on_another_gpu_receives_by_nccl_broadcast(
    gpu_cluster: Cluster,
) -> None:
    for version in (4, 5):
        params = {n: p.detach().to("cuda:0")
                  for n, p in tiny_model(seed=version).named_parameters()}
        announcement = _published(gpu_cluster, version, params)
        assert announcement.roster == {REMOTE: 1} and announcement.backend == "nccl"
        assert list(announcement.ipc) == [COLOCATED]
        for name in (REMOTE, COLOCATED):
            assert gpu_cluster.version(name) == str(version)
            _engine_equals(gpu_cluster, name, params)
    log = (gpu_cluster.workdir / f"{REMOTE}-sidecar.log").read_text()
    assert "installed version 5" in log
