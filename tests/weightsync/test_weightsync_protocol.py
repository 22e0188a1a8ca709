"""The wire format, the disk format, the tensor handoff and the SGLang command line."""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._C._distributed_c10d import HashStore

from rljob.cluster.weight_sync import ENGINE_PORT_ENV, PORT_ENV, SyncSettings
from rljob.engine.sglang_launcher import (
    EngineStartError,
    ReservedArgumentError,
    SGLangServer,
    build_command,
    wait_healthy,
)
from rljob.engine.sidecar import Sidecar, SidecarConfig, parse_args
from rljob.weightsync import disk
from rljob.weightsync.auth import SignedStore
from rljob.weightsync.group import BroadcastGroup
from rljob.weightsync.nonfinite import SCREEN_ALONE, nonfinite_names, nonfinite_report
from rljob.weightsync.protocol import (
    ALIGN_BYTES,
    Announcement,
    Keys,
    bucket_digest,
    decode_ack,
    layout_from_json,
    layout_to_json,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
    version_digest,
)
from rljob.weightsync.publisher import PublisherConfig, WeightPublisher
from rljob.weightsync.results import NonFiniteWeights
from rljob.weightsync.wire import (
    TensorReceiver,
    decode_named_tensors,
    encode_flattened,
    encode_named_tensors,
    flat_span,
    update_problems,
)
from rljob_api.rules import RESERVED_SGLANG_ARGS
from rljob_api.spec import WeightSyncSpec

pytestmark = pytest.mark.unit


def named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(50, 16, generator=g)),
        ("norm.weight", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("layer.bias", torch.randn(3, generator=g).half()),
        ("scale", torch.tensor(2.5)),
        ("big.weight", torch.randn(300, 10, generator=g)),
        ("steps", torch.arange(5)),
    ]


def test_buckets_respect_the_size_and_keep_order() -> None:
    tensors = named()
    plan = plan_buckets(tensors, bucket_bytes=4096)
    order = [m.name for b in plan for m in b.tensors]
    assert order == [n for n, _ in tensors]
    for b in plan:
        assert all(m.offset % ALIGN_BYTES == 0 for m in b.tensors)
        if len(b.tensors) > 1:
            assert b.nbytes <= 4096
    # The 12 000-byte tensor does not fit any bucket and travels alone.
    big = next(b for b in plan if any(m.name == "big.weight" for m in b.tensors))
    assert len(big.tensors) == 1 and big.nbytes >= 12000


def test_pack_then_unpack_is_bit_exact_for_every_dtype() -> None:
    tensors = named()
    plan = plan_buckets(tensors, bucket_bytes=1 << 20)
    by_name = dict(tensors)
    (bucket,) = plan
    buf = pack_bucket(bucket, [by_name[m.name] for m in bucket.tensors])
    for name, view in unpack_bucket(bucket, buf):
        assert view.dtype == by_name[name].dtype and torch.equal(view, by_name[name])


def test_layout_survives_json_and_the_digest_binds_version_and_bytes() -> None:
    tensors = named()
    plan = plan_buckets(tensors, bucket_bytes=2048)
    assert layout_from_json(json.loads(json.dumps(layout_to_json(plan)))) == plan
    by_name = dict(tensors)
    bufs = [pack_bucket(b, [by_name[m.name] for m in b.tensors]) for b in plan]
    digests = [bucket_digest(b) for b in bufs]
    reference = version_digest(7, plan, digests)
    assert version_digest(8, plan, digests) != reference
    bufs[1][5] ^= 1  # one flipped bit
    assert version_digest(7, plan, [bucket_digest(b) for b in bufs]) != reference


def test_nonfinite_report_names_the_tensor_and_counts() -> None:
    t = torch.zeros(4)
    t[1], t[2] = float("nan"), float("-inf")
    report = nonfinite_report([("ok", torch.ones(2)), ("bad", t), ("ints", torch.arange(3))])
    assert report == ["bad: 1 NaN, 1 Inf"]


def test_the_fused_scan_names_exactly_the_nonfinite_tensors() -> None:
    nan = torch.ones(5, dtype=torch.bfloat16)
    nan[2] = float("nan")
    neg_inf = torch.ones(3, 3)
    neg_inf[1, 1] = float("-inf")
    inf = torch.ones(4, dtype=torch.float16)
    inf[0] = float("inf")
    # Finite, but its sum of magnitudes overflows float16: the screen flags it, the
    # element-wise confirmation clears it.
    loud = torch.full((8,), 60000.0, dtype=torch.float16)
    named = [
        ("ok", torch.randn(6, 2)),
        ("nan", nan),
        ("loud", loud),
        ("empty", torch.empty(0)),
        ("ints", torch.arange(4)),
        ("neg_inf", neg_inf),
        ("inf", inf),
        ("ok16", torch.ones(3, dtype=torch.bfloat16)),
    ]
    # Tensors large enough to be screened alone: one NaN among a million values, and a
    # finite one whose float32 sum overflows.
    big_nan = torch.zeros(SCREEN_ALONE, dtype=torch.bfloat16)
    big_nan[-1] = float("nan")
    big_loud = torch.full((SCREEN_ALONE,), 3e38, dtype=torch.bfloat16)
    named += [("big_nan", big_nan), ("big_loud", big_loud)]
    assert nonfinite_names(named) == ["nan", "neg_inf", "inf", "big_nan"]
    assert nonfinite_report(named) == ["nan: 1 NaN, 0 Inf", "neg_inf: 0 NaN, 1 Inf",
                                       "inf: 0 NaN, 1 Inf", "big_nan: 1 NaN, 0 Inf"]
    assert nonfinite_names([("loud", loud), ("big_loud", big_loud)]) == []


def test_a_group_member_is_handed_only_buffers_on_its_own_device() -> None:
    store = HashStore()
    with pytest.raises(ValueError, match="nccl group needs cuda buffers, but rank 0 stages on cpu"):
        BroadcastGroup(store, epoch_prefix="p/", rank=0, size=1, backend="nccl", device="cpu",
                       timeout_s=5)
    group = BroadcastGroup(store, epoch_prefix="q/", rank=0, size=1, backend="gloo",
                           device="cpu", timeout_s=5)
    try:
        buf = torch.arange(4, dtype=torch.uint8)
        group.broadcast(buf)
        assert buf.tolist() == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="works on cpu; refusing to hand it a buffer on meta"):
            group.broadcast(torch.empty(4, dtype=torch.uint8, device="meta"))
    finally:
        group.close()
    with pytest.raises(ValueError, match="backend nccl cannot stage on cpu"):
        WeightPublisher(PublisherConfig(port=0, backend="nccl", device="cpu"))


def test_a_sidecar_rejects_a_version_whatever_its_receive_raises() -> None:
    """A receive that fails with any exception type (here NCCL's ValueError for a CPU
    buffer, and an UnpicklingError from unreadable CUDA IPC handles) is acknowledged as
    that version's rejection, with the type, and the sidecar handles the next one."""
    store = SignedStore(HashStore(), "k" * 64)
    sidecar = Sidecar(SidecarConfig(engine_name="e", engine_url="http://127.0.0.1:9",
                                    trainer_host="127.0.0.1", trainer_port=1, device="cpu"),
                      key="k" * 64)
    layout = layout_to_json(plan_buckets(named(), 1 << 20))
    nccl = Announcement(seq=1, version=1, epoch=1, transport="broadcast", roster={"e": 1},
                        backend="nccl", layout=layout)
    unreadable = Announcement(seq=2, version=2, epoch=1, transport="broadcast", roster={},
                              backend="nccl", layout=layout,
                              ipc={"e": base64.b64encode(b"not a pickle").decode()})
    for ann, cause in ((nccl, "ValueError: a weight-sync nccl group needs cuda buffers"),
                       (unreadable, "UnpicklingError")):
        sidecar.handle(store, ann)
        ack = decode_ack(store.get(Keys.ack(ann.seq, "e")))
        assert not ack.ok and ack.version == ann.version
        assert f"receiving version {ann.version} failed: {cause}" in ack.reason, ack.reason
    assert sidecar.state == "idle"


def test_publisher_refuses_nonfinite_weights_and_old_versions() -> None:
    publisher = WeightPublisher(PublisherConfig(port=0), start_version=5)
    try:
        with pytest.raises(ValueError, match="greater than the last published version 5"):
            publisher.publish(5, named())
        bad = [("w", torch.tensor([1.0, float("inf")]))]
        with pytest.raises(NonFiniteWeights, match="w: 0 NaN, 1 Inf"):
            publisher.publish(6, bad)
        assert publisher.version == 5
    finally:
        publisher.close()


def test_publisher_settings_follow_the_spec(tmp_path: Path) -> None:
    spec = WeightSyncSpec.model_validate(
        {"mode": "disk", "bucketSizeMb": 3, "ackTimeoutSeconds": 9, "scanNonfinite": False}
    )
    cfg = PublisherConfig.from_spec(spec, port=1234, backend="gloo", device="cpu",
                                   disk_dir=tmp_path)
    assert (cfg.transport, cfg.bucket_bytes, cfg.ack_timeout_s) == ("disk", 3 << 20, 9.0)
    assert cfg.scan_nonfinite is False and cfg.verify_digest is True
    with pytest.raises(ValueError, match="disk_dir"):
        WeightPublisher(PublisherConfig(port=0, transport="disk"))


def test_disk_versions_are_complete_hf_directories(tmp_path: Path) -> None:
    tensors = named()
    plan = plan_buckets(tensors, bucket_bytes=2048)
    by_name = dict(tensors)
    bufs = [pack_bucket(b, [by_name[m.name] for m in b.tensors]) for b in plan]
    digests = [bucket_digest(b) for b in bufs]
    for version in (1, 2, 3):
        path = disk.write_version(tmp_path, version, plan, by_name, digests, "d", '{"x": 1}')
    index = json.loads((path / disk.INDEX).read_text())
    assert set(index["weight_map"]) == set(by_name)
    for bucket, buf in zip(plan, bufs, strict=True):
        assert torch.equal(disk.read_bucket(path, bucket, len(plan)), buf)
    disk.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003"]


def test_shared_memory_handoff_reaches_another_process() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    entry = encode_named_tensors([("w", t)])
    code = (
        "import sys; from rljob.weightsync.wire import decode_named_tensors as d;"
        "(n, x), = d(sys.stdin.read()); print(n, x.sum().item(), tuple(x.shape))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=entry, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["w", "66.0", "(3,", "4)"], out.stderr
    assert decode_named_tensors(entry)[0][0] == "w"


def test_engine_side_checks_refuse_a_bad_update_whole() -> None:
    current = {"a": torch.zeros(2), "b": torch.zeros(3, dtype=torch.bfloat16)}
    problems = update_problems(
        current,
        [("a", torch.tensor([1.0, float("nan")])), ("b", torch.zeros(3)), ("c", torch.zeros(1))],
    )
    assert problems == [
        "b: dtype torch.float32 != torch.bfloat16",
        "unknown parameter c",
        "a: non-finite values",
    ]


def test_sidecar_arguments_are_checked_with_a_message() -> None:
    with pytest.raises(SystemExit, match="--trainer HOST:PORT"):
        parse_args(["--trainer", "", "--device", "cpu"])
    with pytest.raises(SystemExit, match="must look like HOST:PORT"):
        parse_args(["--trainer", "trainer-0", "--device", "cpu"])
    with pytest.raises(SystemExit, match="cpu or cuda:N"):
        parse_args(["--trainer", "t:1", "--device", "tpu"])
    cfg = parse_args(["--trainer", "t:29600", "--device", "cpu", "--engine-name", "r0"])
    assert (cfg.trainer_host, cfg.trainer_port, cfg.engine_name) == ("t", 29600, "r0")


def test_sidecar_names_itself_after_its_pod_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "rl-rollout-abc")
    assert parse_args(["--trainer", "t:1", "--device", "cpu"]).engine_name == "rl-rollout-abc"
    cfg = parse_args(["--trainer", "t:1", "--device", "cpu", "--engine-name", "e7",
                      "--listen", "0.0.0.0:8093"])
    assert (cfg.engine_name, cfg.listen_port) == ("e7", 8093)


SERVER = SGLangServer(model_path="/model", host="0.0.0.0", port=30000, tp_size=4, nccl_port=31000,
                      api_key="k")


def test_sglang_args_pass_through_and_owned_args_are_ours() -> None:
    argv = build_command(
        SERVER,
        {
            "mem-fraction-static": "0.8",
            "enable-torch-compile": "true",
            "disable-radix-cache": "false",
        },
    )
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    pairs = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert pairs["--tp-size"] == "4" and pairs["--port"] == "30000"
    assert pairs["--nccl-port"] == "31000" and pairs["--model-path"] == "/model"
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.8"
    assert "--enable-torch-compile" in argv and "--disable-radix-cache" not in argv


@pytest.mark.parametrize("key", [*RESERVED_SGLANG_ARGS, "weight-version"])
def test_a_user_value_for_an_owned_sglang_arg_is_refused(key: str) -> None:
    with pytest.raises(ReservedArgumentError, match=f"sets {key}, which rljob sets itself"):
        build_command(SERVER, {key: "1"})


def test_health_polling_gives_up_at_its_deadline_and_on_exit() -> None:
    with pytest.raises(EngineStartError, match="not healthy after 1s"):
        wait_healthy("http://127.0.0.1:9", deadline_s=1, request_timeout_s=0.2, interval_s=0.2)
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(timeout=60)
    with pytest.raises(EngineStartError, match="exited with code 3"):
        wait_healthy("http://127.0.0.1:9", deadline_s=30, process=proc)


def test_driver_settings_come_from_the_operator_env_with_clear_errors() -> None:
    assert SyncSettings.from_env({}) == SyncSettings(store_port=0, engine_port=0)
    pods = {PORT_ENV: "29600", ENGINE_PORT_ENV: "30000"}
    assert SyncSettings.from_env(pods) == SyncSettings(29600, 30000)
    with pytest.raises(ValueError, match=f"{ENGINE_PORT_ENV} must be a port number"):
        SyncSettings.from_env({ENGINE_PORT_ENV: "70000"})


def test_views_of_one_buffer_are_screened_as_one_span_without_false_refusals() -> None:
    """A staged version (views of one buffer, padding between them) is screened whole; a
    NaN in the padding alone refuses nothing, one inside a tensor names exactly that one."""
    plan = plan_buckets([("a", torch.zeros(5)), ("b", torch.zeros(7)), ("c", torch.zeros(3))],
                        1 << 20)
    buf = torch.zeros(plan[0].nbytes, dtype=torch.uint8)
    views = unpack_bucket(plan[0], buf)
    floats = buf.view(torch.float32)
    padding = 5  # a is 20 bytes, b starts at 64: the float at byte 20 is padding
    floats[padding] = float("nan")
    assert nonfinite_names(views) == []
    views[1][1][6] = float("inf")
    assert nonfinite_names(views) == ["b"]
    assert nonfinite_report(views) == ["b: 0 NaN, 1 Inf"]


def test_a_flattened_bucket_round_trips_and_stays_mapped_across_versions() -> None:
    """Views of one staging buffer travel as one flattened bucket (SGLang's format); the
    receiver keeps the shared memory mapped, so the next version's decode finds the same
    memory and reads what the sender wrote there since."""
    plan = plan_buckets([("w", torch.zeros(3, 4)), ("b", torch.zeros(4))], 1 << 20)
    staging = torch.zeros(plan[0].nbytes, dtype=torch.uint8)
    views = unpack_bucket(plan[0], staging)
    views[0][1].copy_(torch.arange(12.0).view(3, 4))
    flat = flat_span(views)
    assert flat is not None and flat.dtype == torch.float32
    receiver = TensorReceiver()
    (first,) = receiver.decode([encode_flattened(views, flat)])
    assert [(n, tuple(t.shape)) for n, t in first] == [("w", (3, 4)), ("b", (4,))]
    assert torch.equal(first[0][1], torch.arange(12.0).view(3, 4))
    views[1][1].fill_(7.0)
    (second,) = receiver.decode([encode_flattened(views, flat)])
    assert second[1][1].data_ptr() == first[1][1].data_ptr()
    assert torch.equal(second[1][1], torch.full((4,), 7.0))
    # Not one buffer, or two dtypes: no flattened bucket.
    assert flat_span([("x", torch.zeros(2)), ("y", torch.zeros(2))]) is None
    assert flat_span([("x", views[0][1]), ("y", views[1][1].view(torch.int32))]) is None


def test_a_colocated_sglang_starts_with_its_memory_saver_once() -> None:
    """Releasing SGLang's memory for the trainer needs --enable-memory-saver at start;
    a user's own value for it does not add a second flag or switch it off."""
    colocated = SGLangServer(model_path="/model", host="0.0.0.0", port=30000, tp_size=1,
                             nccl_port=31000, memory_saver=True, api_key="k")
    for user in ({}, {"enable-memory-saver": "true"}, {"enable-memory-saver": "false"}):
        assert build_command(colocated, user).count("--enable-memory-saver") == 1
    assert "--enable-memory-saver" not in build_command(SERVER, {})


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_one_byte_floats_are_screened_by_their_bits(dtype: torch.dtype) -> None:
    """float8 has no norm kernel: a small or lone float8 tensor used to make the screen
    raise NotImplementedError instead of naming its NaN; a finite one is never named."""
    small = torch.ones(6).to(dtype)
    small[2] = float("nan")
    big = torch.zeros(SCREEN_ALONE).to(dtype)
    big[-1] = float("nan")
    fine = torch.full((SCREEN_ALONE,), 240.0).to(dtype)  # finite, large, sums to 2.5e8
    named = [("small", small), ("ok", torch.ones(3).to(dtype)), ("big", big), ("fine", fine)]
    assert nonfinite_names(named) == ["small", "big"]
    assert nonfinite_report(named) == ["small: 1 NaN, 0 Inf", "big: 1 NaN, 0 Inf"]
    # Views of one buffer: a NaN in one, and (e5m2 has them) an Inf in another.
    plan = plan_buckets([("a", torch.zeros(5).to(dtype)), ("b", torch.zeros(7).to(dtype))],
                        1 << 20)
    views = unpack_bucket(plan[0], torch.zeros(plan[0].nbytes, dtype=torch.uint8))
    assert nonfinite_names(views) == []
    views[1][1][3] = float("inf") if dtype == torch.float8_e5m2 else float("nan")
    assert nonfinite_names(views) == ["b"]


def test_opposite_infinities_in_one_span_are_named() -> None:
    """+Inf and -Inf in one screened span sum to NaN, not to something finite."""
    plan = plan_buckets([(n, torch.zeros(4, dtype=torch.bfloat16)) for n in "abc"], 1 << 20)
    views = unpack_bucket(plan[0], torch.zeros(plan[0].nbytes, dtype=torch.uint8))
    views[0][1][0] = float("inf")
    views[2][1][3] = float("-inf")
    assert nonfinite_names(views) == ["a", "c"]


def test_an_sglang_engine_never_starts_without_the_peer_key() -> None:
    """Without --api-key SGLang would serve its weight-update routes to anyone."""
    with pytest.raises(ValueError, match="peer key"):
        build_command(dataclasses.replace(SERVER, api_key=""), {})
