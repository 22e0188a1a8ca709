"""The tiny model comes out of the cache byte for byte as built, without transformers in the
process that copies it, and a job's own copy is what it keeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rljob.model.tiny_cache import TinyRequest, cached, materialise
from rljob.model.tiny_model import write_tiny
from rljob_api.spec import TinyModel

pytestmark = pytest.mark.unit

REQUEST = TinyRequest(TinyModel(hidden_size=32, num_layers=1, num_heads=2), "0123+=", 3,
                      "float32")


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def test_a_second_job_copies_the_built_model_without_importing_transformers(
        cache_home: Path, tmp_path: Path) -> None:
    first = materialise(REQUEST, tmp_path / "job1" / "model")
    assert cached(REQUEST) is not None
    # Another process, as the next job's driver: the copy needs no model classes.
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from rljob.model.tiny_cache import TinyRequest, materialise\n"
        "from rljob_api.spec import TinyModel\n"
        f"r = TinyRequest(TinyModel(hidden_size=32, num_layers=1, num_heads=2), '0123+=', 3,"
        f" 'float32')\n"
        f"materialise(r, Path({str(tmp_path / 'job2' / 'model')!r}))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'torch') or m == 'rljob.model.tiny_model')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "XDG_CACHE_HOME": str(cache_home)})
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    second = tmp_path / "job2" / "model"
    built = write_tiny(tmp_path / "built", REQUEST.shape, REQUEST.alphabet, REQUEST.seed,
                       REQUEST.dtype)
    assert _files(first) == _files(built)
    assert _files(second) == _files(built)


def test_what_decides_the_bytes_decides_the_key(cache_home: Path, tmp_path: Path) -> None:
    materialise(REQUEST, tmp_path / "a")
    other_seed = TinyRequest(REQUEST.shape, REQUEST.alphabet, 4, REQUEST.dtype)
    other_alphabet = TinyRequest(REQUEST.shape, "0123+=-", REQUEST.seed, REQUEST.dtype)
    assert cached(other_seed) is None and cached(other_alphabet) is None
    materialise(other_seed, tmp_path / "b")
    assert (_files(tmp_path / "a")["model.safetensors"]
            != _files(tmp_path / "b")["model.safetensors"])
    assert len(list((cache_home / "rljob" / "tiny-models").iterdir())) == 2


def test_a_jobs_own_copy_is_kept_whatever_the_cache_holds(
        cache_home: Path, tmp_path: Path) -> None:
    """A resumed job reads the bytes it started with, not a cache entry changed since."""
    model = materialise(REQUEST, tmp_path / "job" / "model")
    kept = _files(model)
    entry = cached(REQUEST)
    assert entry is not None
    (entry / "model.safetensors").write_bytes(b"changed")
    assert _files(materialise(REQUEST, model)) == kept


def test_without_a_writable_cache_the_model_is_built_in_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_dir))
    model = materialise(REQUEST, tmp_path / "job" / "model")
    built = write_tiny(tmp_path / "built", REQUEST.shape, REQUEST.alphabet, REQUEST.seed,
                       REQUEST.dtype)
    assert _files(model) == _files(built)
    assert not [p for p in model.parent.iterdir() if ".tmp-" in p.name]
