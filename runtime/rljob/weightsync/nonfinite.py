"""The non-finite check every version passes before it is sent, installed or trained on.

The publisher runs it before a version leaves the trainer, the sidecar after a version
arrives, the engines before they install one: a NaN or Inf is named and refused there, never
replaced. It has to cost about one read of the version's bytes, so it screens whole buffers
on the device and checks element by element only what the screen flags.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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
BYTE_NONFINITE: dict[torch.dtype, tuple[int, int]] = {
    torch.float8_e4m3fn: (0x7F, 0x7F),
    torch.float8_e5m2: (0x7C, 0x7C),
    torch.float8_e4m3fnuz: (0xFF, 0x80),
    torch.float8_e5m2fnuz: (0xFF, 0x80),
}


def _screen(span: torch.Tensor) -> torch.Tensor:
    """A one-element bool tensor on the span's device: True when its float32 sum is finite.

    A NaN or Inf makes the sum non-finite; finite values can overflow it too, so the
    members of a flagged span are checked one by one. A sum rather than a bit test: on an
    H200 torch's sum reads a bf16 buffer at 3.6 TB/s, a Triton kernel testing exponent bits
    at 2.9 TB/s (docs/benchmarks/weight-sync.md). A one-byte float is tested by its bits
    (`BYTE_NONFINITE`).
    """
    if span.dtype.itemsize == 1:
        mask, value = BYTE_NONFINITE.get(span.dtype, (0, 1))  # (0, 1): none of these
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
