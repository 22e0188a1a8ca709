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


# A tensor at least this large (elements) gets a reduction kernel of its own; smaller ones
# are screened together, many per kernel, where a launch each would cost more than the read.
SCREEN_ALONE = 1 << 20
# Views of one buffer lying at most this many bytes apart are screened as one span (the
# alignment padding between them is read too): a bucket is then one kernel, not one a tensor.
SPAN_GAP_BYTES = 4096


_Named = list[tuple[str, torch.Tensor]]


def _spans(
    named: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[torch.Tensor, _Named]], _Named]:
    """Contiguous views of one storage in one dtype, merged into flat spans over it.

    A received version is a few buffers holding all its tensors (a bucket, the sidecar's
    staging, a flattened bucket): screening each buffer's span whole reads the same bytes
    with one kernel, where one a tensor costs a launch and a reduction each. Returns the
    spans with their members, and the tensors that are no such view (screened as before).
    """
    groups: dict[tuple[torch.device, int, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    rest: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        if not tensor.is_floating_point() or not tensor.numel():
            continue
        if tensor.is_contiguous():
            key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.dtype)
            groups.setdefault(key, []).append((name, tensor))
        else:
            rest.append((name, tensor))
    spans: list[tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]] = []
    for (_, _, dtype), members in groups.items():
        if len(members) == 1:
            rest.extend(members)
            continue
        gap = max(1, SPAN_GAP_BYTES // dtype.itemsize)
        members.sort(key=lambda nt: nt[1].storage_offset())
        run: list[tuple[str, torch.Tensor]] = []
        end = 0
        for nt in members:
            begin = int(nt[1].storage_offset())
            if run and begin - end > gap:
                spans.append(_span(run))
                run = []
            end = begin + nt[1].numel() if not run else max(end, begin + nt[1].numel())
            run.append(nt)
        spans.append(_span(run))
    single = [s for s in spans if len(s[1]) == 1]
    rest.extend(m for _, members in single for m in members)
    return [s for s in spans if len(s[1]) > 1], rest


def _span(run: _Named) -> tuple[torch.Tensor, _Named]:
    first = min(t.storage_offset() for _, t in run)
    last = max(t.storage_offset() + t.numel() for _, t in run)
    return run[0][1].as_strided((last - first,), (1,), first), run


# One-byte floats have no norm kernel (and no sum on every device): their NaN/Inf are
# found by their bits, as (mask, value) on the byte: exponent (and for e4m3fn the mantissa)
# all ones, or the one NaN byte of the "fnuz" formats.
_BYTE_NONFINITE: dict[torch.dtype, tuple[int, int]] = {
    torch.float8_e4m3fn: (0x7F, 0x7F),
    torch.float8_e5m2: (0x7C, 0x7C),
    torch.float8_e4m3fnuz: (0xFF, 0x80),
    torch.float8_e5m2fnuz: (0xFF, 0x80),
}


def _screen(span: torch.Tensor) -> torch.Tensor:
    """A one-element bool tensor on the span's device: True when its float32 sum is finite.

    A NaN or Inf makes the sum non-finite; finite values can overflow it too, so the
    members of a flagged span are checked one by one. torch's sum reads a bf16 buffer at
    3.6 TB/s on an H200, faster than a Triton kernel testing exponent bits that was tried
    in its place (2.9 TB/s, benchmarks/weight_sync_ipc_gpu.py, 2026-12-01). A one-byte
    float is tested by its bits (`_BYTE_NONFINITE`).
    """
    if span.dtype.itemsize == 1:
        mask, value = _BYTE_NONFINITE.get(span.dtype, (0, 1))  # (0, 1): none of these
        return ~((span.reshape(-1).view(torch.uint8) & mask) == value).any()[None]
    return torch.isfinite(span.sum(dtype=torch.float32))[None]


def _all_finite(tensor: torch.Tensor) -> bool:
    """Element by element (a one-byte float by its bits, which is exact)."""
    if tensor.dtype.itemsize == 1:
        return bool(_screen(tensor).item())
    return bool(torch.isfinite(tensor).all())


def nonfinite_names(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating tensors holding NaN or Inf, in the given order.

    A screen on the device instead of a check per tensor: views of one buffer are summed
    as one span (`_spans`: a received version costs one kernel per buffer), any other large
    tensor by a kernel of its own, small ones together by `_foreach_norm` (one multi-tensor
    kernel per dtype), and the verdicts reach the host in one transfer per device, so a
    version costs about one read of its bytes and one synchronisation per device, not one
    per tensor. Only what the screen flags is checked element by element before it is
    named, so a false alarm (a sum overflowing from finite values, or non-finite padding
    between the tensors of a span) never refuses a finite tensor.
    """
    spans, rest = _spans(named)
    verdicts: dict[torch.device, list[torch.Tensor]] = {}
    screened: dict[torch.device, list[list[tuple[str, torch.Tensor]]]] = {}
    small: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for span, members in spans:
        verdicts.setdefault(span.device, []).append(_screen(span))
        screened.setdefault(span.device, []).append(members)
    for name, tensor in rest:
        if tensor.numel() >= SCREEN_ALONE or tensor.dtype.itemsize == 1:
            verdicts.setdefault(tensor.device, []).append(_screen(tensor.reshape(-1)))
            screened.setdefault(tensor.device, []).append([(name, tensor)])
        else:
            small.setdefault((tensor.device, tensor.dtype), []).append((name, tensor))
    for (device, _), members in small.items():
        norms = torch._foreach_norm([t for _, t in members], 1)
        verdicts.setdefault(device, []).append(torch.isfinite(torch.stack(list(norms)).float()))
        screened.setdefault(device, []).extend([m] for m in members)
    flagged: set[str] = set()
    for device, parts in verdicts.items():
        finite = torch.cat(parts).tolist()
        flagged.update(
            name
            for members, ok in zip(screened[device], finite, strict=True)
            if not ok
            for name, tensor in members
            if not _all_finite(tensor)
        )
    return [name for name, _ in named if name in flagged]


def nonfinite_report(named: Sequence[tuple[str, torch.Tensor]], limit: int = 5) -> list[str]:
    """Human-readable findings for every floating tensor holding NaN or Inf (first `limit`)."""
    tensors = dict(named)
    found: list[str] = []
    for name in nonfinite_names(named):
        tensor = tensors[name]
        nan = int(torch.isnan(tensor).sum())
        inf = int(tensor.numel() - int(torch.isfinite(tensor).sum()) - nan)
        found.append(f"{name}: {nan} NaN, {inf} Inf")
        if len(found) >= limit:
            found.append("... (more tensors not listed)")
            break
    return found


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
    out of the trainer's memory through their own handles (a `tensor_payload` entry naming
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
