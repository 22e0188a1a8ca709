"""Versions as HF safetensors directories (`weightSync.mode: disk`, and the resync fallback).

One shard per bucket plus `model.safetensors.index.json`, so any HF loader (and SGLang's
`/update_weights_from_disk`) reads it. A directory appears under its final name only when
complete (written to a temporary name, fsynced, renamed), so an engine never loads half a
version.

Versions are namespaced by attempt: each publisher writes under `<root>/attempt-<token>/`,
and before its first version it removes what earlier attempts left in `<root>`. A driver
that crashed after publishing versions past its last checkpoint leaves directories whose
numbers the resumed run publishes again with other weights; under its own namespace the
resumed run never finds, reuses or announces them.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rljob.checkpoint.store import fsync_path
from rljob.weightsync.protocol import BucketMeta, layout_to_json, pack_bucket

INDEX = "model.safetensors.index.json"
MANIFEST = "rljob-weights.json"
ATTEMPT_PREFIX = "attempt-"


def attempt_dir(root: Path, attempt: str) -> Path:
    """Where the publisher of attempt `attempt` writes its versions."""
    return root / f"{ATTEMPT_PREFIX}{attempt}"


def clear_other_attempts(root: Path, attempt: str) -> list[Path]:
    """Remove every version another attempt left under `root` (its attempt directory, or a
    `v…` version or `.v…` temporary lying directly under `root`, outside any attempt's
    namespace); returns what was removed."""
    if not root.exists():
        return []
    ours = attempt_dir(root, attempt).name
    stale = [p for p in root.iterdir()
             if p.name != ours and (p.name.startswith((ATTEMPT_PREFIX, "v", ".v")))]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_version(
    root: Path,
    version: int,
    buckets: Sequence[BucketMeta],
    tensors: dict[str, torch.Tensor],
    bucket_digests: Sequence[str],
    digest: str,
    config_json: str | None = None,
) -> Path:
    """Write version `version` atomically; returns its final directory."""
    final = version_dir(root, version)
    if final.exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    weight_map: dict[str, str] = {}
    total = 0
    for bucket in buckets:
        name = shard_name(bucket.index, len(buckets))
        shard = {m.name: tensors[m.name].detach().contiguous().cpu() for m in bucket.tensors}
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        fsync_path(tmp / name)
        for m in bucket.tensors:
            weight_map[m.name] = name
            total += m.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / INDEX).write_text(json.dumps(index, indent=1))
    manifest = {
        "version": version,
        "digest": digest,
        "bucket_digests": list(bucket_digests),
        "layout": layout_to_json(buckets),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest))
    if config_json is not None:
        (tmp / "config.json").write_text(config_json)
    fsync_path(tmp)
    os.rename(tmp, final)
    fsync_path(root)
    return final


def read_bucket(path: Path, bucket: BucketMeta, count: int) -> torch.Tensor:
    """Bucket `bucket` of the version in `path`, packed exactly as the sender packed it."""
    shard = load_file(str(path / shard_name(bucket.index, count)))
    missing = [m.name for m in bucket.tensors if m.name not in shard]
    if missing:
        raise ValueError(f"{path}: shard {bucket.index} lacks {', '.join(missing[:3])}")
    return pack_bucket(bucket, [shard[m.name] for m in bucket.tensors])


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete versions (and stale temporary dirs)."""
    if not root.exists():
        return
    versions = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v"))
    for old in versions[:-keep] if keep > 0 else versions:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(".v*.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
