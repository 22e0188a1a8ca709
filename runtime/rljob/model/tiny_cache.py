"""Built tiny models kept between jobs, keyed by everything that decides their bytes.

Building the tiny model needs transformers' model classes, seconds of CPU in a driver that
otherwise never loads a model. The bytes depend only on the shape, the alphabet, the seed,
the dtype, the code that writes them and the library versions, so a job whose model was
built before copies the files into its work directory instead. The job keeps its own copy:
every worker reads the work directory, and a resume must find the same bytes whatever
happened to the cache since.

An entry is `<root>/<key>/model/` with `<root>/<key>/manifest.json` (each file's SHA-256),
published whole (`rljob.model.staged_dir`). Every copy is checked against the manifest: an
entry that does not match (a disk error, a hand edit) is thrown away and built again, never
handed to a job. A cache that cannot be written or read (a read-only home in a pod) only
means the model is built in the work directory directly. Entries are small (the default
tiny model is about 0.4 MB) and never expire: `rm -r` the root to clear them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from rljob.model.staged_dir import staged
from rljob_api.spec import TinyModel

# The cache root of every rljob tool (hack/ scripts read the same variable); default
# `$XDG_CACHE_HOME/rljob`, else `~/.cache/rljob`.
CACHE_ENV = "RLJOB_CACHE"
SUBDIR = "tiny-models"
MANIFEST = "manifest.json"
MODEL = "model"
# The modules whose code shapes the files (the marker's name is in text_codec): a change to
# any gives new keys.
_WRITERS = ("tiny_model.py", "tokenizer.py", "dtypes.py", "text_codec.py")
_LIBRARIES = ("torch", "transformers", "safetensors")


class _Mismatch(Exception):
    """A copied entry's files differ from its manifest."""


@dataclass(frozen=True)
class TinyRequest:
    """What one job's built-in tiny model is made of."""

    shape: TinyModel
    alphabet: str
    seed: int
    dtype: str

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps({
            "shape": self.shape.model_dump(mode="json"),
            "alphabet": self.alphabet,
            "seed": self.seed,
            "dtype": self.dtype,
            "libraries": {name: version(name) for name in _LIBRARIES},
        }, sort_keys=True).encode())
        here = Path(__file__).parent
        for name in _WRITERS:
            digest.update((here / name).read_bytes())
        return digest.hexdigest()[:32]


def cache_root() -> Path | None:
    """Where entries live; None where there is no absolute place for them (XDG: a relative
    `XDG_CACHE_HOME` is ignored)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / SUBDIR
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "rljob" / SUBDIR
    try:
        return Path.home() / ".cache" / "rljob" / SUBDIR
    except RuntimeError:  # no HOME and no passwd entry
        return None


def _entry(request: TinyRequest) -> Path | None:
    """Where `request`'s entry lives; None without a cache root, or where a library's version
    cannot be read (no package metadata): a key that misses a version could serve stale
    bytes, so such a machine builds every time."""
    root = cache_root()
    if root is None:
        return None
    try:
        return root / request.key()
    except PackageNotFoundError:
        return None


def cached(request: TinyRequest) -> Path | None:
    """The cache entry of `request`, if one was published (checked when copied)."""
    entry = _entry(request)
    return entry if entry is not None and (entry / MANIFEST).is_file() else None


def materialise(request: TinyRequest, directory: Path) -> Path:
    """`directory` holding the tiny model of `request`: kept as it is when it has one already
    (a resumed job), else copied from the cache (built there first on a miss), else built in
    place."""
    if (directory / "config.json").exists():
        return directory
    entry = _entry(request)
    if entry is not None and _copy_from_cache(request, entry, directory):
        return directory
    return _write(request, directory)


def _copy_from_cache(request: TinyRequest, entry: Path, directory: Path) -> bool:
    """Copy the checked entry into `directory`, building or rebuilding it first where needed;
    False when the cache cannot serve (the caller builds in place)."""
    for _ in range(2):  # a bad entry is rebuilt once
        try:
            if not (entry / MANIFEST).is_file():
                _build_entry(request, entry)
            expected = _manifest(entry)
            files = sorted((entry / MODEL).iterdir()) if (entry / MODEL).is_dir() else []
            if sorted(p.name for p in files) != sorted(expected):
                raise _Mismatch  # files gone or added since the manifest
            with staged(directory, last_file="config.json") as tmp:
                for file in files:  # contents only: the job's own mode and times
                    shutil.copyfile(file, tmp / file.name)
                if _digests(tmp) != expected:
                    raise _Mismatch
            return True
        except _Mismatch:
            _discard(entry)
        except OSError:
            return False
    return False


def _build_entry(request: TinyRequest, entry: Path) -> None:
    """Build the model into a new entry with its manifest; a leftover without one goes."""
    if entry.exists() and not (entry / MANIFEST).is_file():
        _discard(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with staged(entry, last_file=MANIFEST) as tmp:
        model = _write(request, tmp / MODEL)
        (tmp / MANIFEST).write_text(json.dumps(_digests(model), sort_keys=True))


def _write(request: TinyRequest, directory: Path) -> Path:
    """Build with transformers: imported only here, where a model is built."""
    from rljob.model.tiny_model import write_tiny

    return write_tiny(directory, request.shape, request.alphabet, request.seed, request.dtype)


def _manifest(entry: Path) -> dict[str, str]:
    try:
        manifest = json.loads((entry / MANIFEST).read_bytes())
    except ValueError:  # not JSON, or not text
        raise _Mismatch from None
    if not isinstance(manifest, dict):
        raise _Mismatch
    return manifest


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir())}


def _discard(entry: Path) -> None:
    """Move a bad entry out of the way in one step (a reader sees it whole or not at all),
    then remove it. Checked again first: one another process has rebuilt meanwhile is whole
    now and stays."""
    try:
        if (entry / MODEL).is_dir() and _digests(entry / MODEL) == _manifest(entry):
            return
    except (_Mismatch, OSError):
        pass
    gone = entry.with_name(f"{entry.name}.bad-{uuid.uuid4().hex[:8]}")
    try:
        entry.rename(gone)
    except OSError:
        return  # another process moved it first
    shutil.rmtree(gone, ignore_errors=True)
