"""The weight-sync wire protocol, shared by the trainer's publisher, the sidecar and the tests.

A version travels as buckets: each bucket is one contiguous byte buffer holding several
tensors (HF parameter names, dtypes and shapes listed in the announcement), so a broadcast
moves a few large messages instead of thousands of small ones. The sender announces the
bucket layout before sending, and publishes the per-version digest after the last bucket;
every receiver recomputes the digest from what it received and scans for non-finite
values before anything reaches its engine.

Coordination runs through one TCP store (a plain key/value server every sidecar can reach:
in a job the driver hosts it on the Ray head, see `wiring`): registrations, announcements,
digests and acknowledgements are JSON values under the keys built here, so both ends agree
on names in one place.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

# Offsets inside a bucket are aligned so every tensor view is aligned for its dtype (and for
# vectorised copies on GPU).
ALIGN_BYTES = 64
PROTOCOL_VERSION = 1

Transport = Literal["broadcast", "disk"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype (`torch.bfloat16` -> `bfloat16`)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be synced; supported: {', '.join(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} in a weight-sync manifest")
    return _DTYPES[name]


def _aligned(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside its bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketMeta:
    index: int
    nbytes: int
    tensors: tuple[TensorMeta, ...]


def plan_buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[BucketMeta]:
    """Group tensors, in the given order, into buckets of at most `bucket_bytes` each.

    A tensor larger than the bucket size travels alone in a bucket of its own size: the
    limit bounds staging memory for ordinary tensors without forbidding a huge embedding.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket size must be positive")
    seen: set[str] = set()
    buckets: list[BucketMeta] = []
    current: list[TensorMeta] = []
    used = 0
    for name, tensor in named:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one version")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if current and used + _aligned(nbytes) > bucket_bytes:
            buckets.append(BucketMeta(len(buckets), used, tuple(current)))
            current, used = [], 0
        current.append(
            TensorMeta(name, dtype_name(tensor.dtype), tuple(tensor.shape), used, nbytes)
        )
        used += _aligned(nbytes)
    if current:
        buckets.append(BucketMeta(len(buckets), used, tuple(current)))
    return buckets


def pack_bucket(
    bucket: BucketMeta, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy `tensors` (in bucket order) into one uint8 buffer laid out as `bucket` says."""
    device = tensors[0].device if tensors else torch.device("cpu")
    buf = out if out is not None else torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
    for meta, tensor in zip(bucket.tensors, tensors, strict=True):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[meta.offset : meta.offset + meta.nbytes].copy_(flat)
    return buf


def unpack_bucket(bucket: BucketMeta, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views (no copies) of the tensors inside a received bucket buffer."""
    if buf.numel() != bucket.nbytes:
        raise ValueError(
            f"bucket {bucket.index}: got {buf.numel()} bytes, expected {bucket.nbytes}"
        )
    out: list[tuple[str, torch.Tensor]] = []
    for meta in bucket.tensors:
        raw = buf[meta.offset : meta.offset + meta.nbytes]
        out.append((meta.name, raw.view(dtype_from_name(meta.dtype)).view(meta.shape)))
    return out


def bucket_digest(buf: torch.Tensor) -> str:
    """SHA-256 of a bucket's bytes (GPU buffers are hashed from a host copy)."""
    host = buf.detach().cpu() if buf.device.type != "cpu" else buf.detach()
    return hashlib.sha256(host.contiguous().numpy().data).hexdigest()


def version_digest(
    version: int, buckets: Sequence[BucketMeta], bucket_digests: Sequence[str]
) -> str:
    """One digest binding the version number, the layout and every bucket's bytes."""
    h = hashlib.sha256()
    h.update(json.dumps({"version": version, "layout": layout_to_json(buckets)}).encode())
    for d in bucket_digests:
        h.update(d.encode())
    return h.hexdigest()


def layout_to_json(buckets: Sequence[BucketMeta]) -> list[dict[str, Any]]:
    return [
        {
            "index": b.index,
            "nbytes": b.nbytes,
            "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in b.tensors],
        }
        for b in buckets
    ]


def layout_from_json(raw: list[dict[str, Any]]) -> list[BucketMeta]:
    return [
        BucketMeta(
            int(b["index"]),
            int(b["nbytes"]),
            tuple(
                TensorMeta(str(n), str(d), tuple(int(s) for s in shape), int(o), int(nb))
                for n, d, shape, o, nb in b["tensors"]
            ),
        )
        for b in raw
    ]


# --- coordination records (JSON in the trainer's store) -------------------------------------


@dataclass(frozen=True)
class Registration:
    """A sidecar announcing itself; a new `incarnation` means it restarted."""

    engine: str
    incarnation: str
    health_url: str
    engine_version: str = ""
    # UUID of the GPU the sidecar stages on ("" on CPU): a trainer on the same GPU hands it
    # the version by CUDA IPC instead of an NCCL group, which cannot span one device twice.
    gpu: str = ""


@dataclass(frozen=True)
class Announcement:
    """Version `version`, delivered as announcement `seq` to the engines in `roster` (ranks
    of the broadcast group) and `ipc`.

    `epoch` names the broadcast group; it changes whenever membership changes, so receivers
    know when to rebuild their group. For `disk`, `path` is the version directory. Engines
    in `ipc` sit on the trainer's own GPU: they join no group and copy the packed buckets
    out of the trainer's memory through their own handles (a `wire` entry naming
    each bucket by its index, one per engine since torch counts one reference per entry
    and gives one back per reading), which hold the finished version when this is announced.
    """

    seq: int
    version: int
    epoch: int
    transport: Transport
    roster: dict[str, int]
    backend: str
    layout: list[dict[str, Any]]
    path: str = ""
    verify_digest: bool = True
    scan_nonfinite: bool = True
    ipc: dict[str, str] = field(default_factory=dict)
    protocol: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Ack:
    """A receiver's verdict on one announcement: installed (`ok`) or rejected with `reason`."""

    engine: str
    seq: int
    version: int
    ok: bool
    reason: str = ""
    serving_version: str = ""
    extra: dict[str, float] = field(default_factory=dict)


def gpu_uuid(device: torch.device) -> str:
    """The identity of the GPU behind `device`, the same in every process and container
    that sees it, whatever index it has there ("" for the CPU)."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def encode(record: Registration | Announcement | Ack) -> str:
    return json.dumps(asdict(record), sort_keys=True)


def decode_registration(raw: bytes) -> Registration:
    return Registration(**json.loads(raw))


def decode_announcement(raw: bytes) -> Announcement:
    return Announcement(**json.loads(raw))


def decode_ack(raw: bytes) -> Ack:
    return Ack(**json.loads(raw))


# --- store keys ------------------------------------------------------------------------------


class Keys:
    """Names of the store keys; one trainer incarnation owns one store."""

    trainer = "ws/trainer"  # trainer incarnation id; a change means "start over"
    members = "ws/members"  # counter: number of registrations so far
    latest_seq = "ws/latest_seq"

    @staticmethod
    def member(i: int) -> str:
        return f"ws/member/{i}"

    @staticmethod
    def announcement(seq: int) -> str:
        return f"ws/announce/{seq}"

    @staticmethod
    def digest(seq: int) -> str:
        return f"ws/digest/{seq}"

    @staticmethod
    def ack(seq: int, engine: str) -> str:
        return f"ws/ack/{seq}/{engine}"

    @staticmethod
    def group(epoch: int) -> str:
        return f"ws/pg/{epoch}/"
