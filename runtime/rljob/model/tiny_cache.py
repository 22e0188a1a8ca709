"""Built tiny models kept between jobs, keyed by everything that decides their bytes.

Building the tiny model needs transformers' model classes, seconds of CPU in a driver that
otherwise never loads a model. The bytes depend only on the shape, the alphabet, the seed,
the dtype, the code that writes them and the library versions, so a job whose model was
built before copies the files into its work directory instead (the job keeps its own copy:
every worker reads the work directory, and a resume must find the same bytes whatever
happened to the cache). A cache that cannot be written (a read-only home in a pod) only
means the model is built in the work directory directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from rljob_api.spec import TinyModel

CACHE_SUBDIR = Path("rljob") / "tiny-models"
# The modules whose code shapes the files: a change to either gives new keys.
_WRITERS = ("tiny_model.py", "tokenizer.py", "dtypes.py")
_LIBRARIES = ("torch", "transformers", "safetensors")


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
    """`$XDG_CACHE_HOME/rljob/tiny-models`, else under `~/.cache`; None without a home."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:  # no HOME and no passwd entry
            return None
    return Path(base) / CACHE_SUBDIR


def cached(request: TinyRequest) -> Path | None:
    """The cached model directory of `request`, if one was built before."""
    root = cache_root()
    if root is None:
        return None
    path = root / request.key()
    return path if (path / "config.json").is_file() else None


def materialise(request: TinyRequest, directory: Path) -> Path:
    """`directory` holding the tiny model of `request`: kept as it is when it has one already
    (a resumed job), else copied from the cache, built into the cache first on a miss."""
    if (directory / "config.json").exists():
        return directory
    source = cached(request)
    if source is None:
        source = _build_into_cache(request)
    if source is None:  # no cache here: build where the job reads it
        return _write(request, directory)
    tmp = directory.with_name(f"{directory.name}.tmp-{uuid.uuid4().hex[:8]}")
    shutil.copytree(source, tmp)
    publish(tmp, directory)
    return directory


def _build_into_cache(request: TinyRequest) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
        return _write(request, root / request.key())
    except OSError:
        return None


def _write(request: TinyRequest, directory: Path) -> Path:
    from rljob.model.tiny_model import write_tiny  # transformers: only when building

    return write_tiny(directory, request.shape, request.alphabet, request.seed, request.dtype)


def publish(tmp: Path, directory: Path) -> None:
    """Move a finished directory into place; another writer's finished one wins."""
    try:
        tmp.rename(directory)
    except OSError:
        if not (directory / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
