"""The tiny model comes out of the cache byte for byte as built, without transformers in the
driver that copies it; a bad entry is built again, never handed to a job; a job's own copy is
what it keeps; no cache only means building in place."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rljob.model import tiny_cache
from rljob.model.staged_dir import staged
from rljob.model.tiny_cache import MANIFEST, MODEL, TinyRequest, cached, materialise
from rljob.model.tiny_model import write_tiny
from rljob_api.spec import TinyModel

pytestmark = pytest.mark.unit

REQUEST = TinyRequest(TinyModel(hidden_size=32, num_layers=1, num_heads=2), "0123+=", 3,
                      "float32")
REPO = Path(__file__).resolve().parents[2]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".tmp-" in p.name or ".bad-" in p.name]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(tiny_cache.CACHE_ENV, str(root))
    return root / tiny_cache.SUBDIR


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """REQUEST's files as the writer makes them, with no cache involved."""
    directory = tmp_path_factory.mktemp("built") / "model"
    return _files(write_tiny(directory, REQUEST.shape, REQUEST.alphabet, REQUEST.seed,
                             REQUEST.dtype))


def test_a_second_driver_copies_the_model_without_importing_transformers(
        cache: Path, tmp_path: Path, built: dict[str, bytes]) -> None:
    spec_file = REPO / "examples" / "tiny-cpu.yaml"
    # A first process, as the first job's driver, builds the entry.
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from rljob.driver.model_files import prepare_model\n"
        "from rljob.trainer.select import trainer_class\n"
        "import rljob.driver.start, rljob.cluster.cluster\n"
        "from rljob_api.validate import load_job\n"
        f"_, spec = load_job({str(spec_file)!r})\n"
        "trainer_class(spec, use_gpu=False)\n"
        "prepare_model(spec, Path(sys.argv[1]))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'"
        " or m == 'rljob.model.tiny_model')))\n"
    )
    env = {**os.environ, tiny_cache.CACHE_ENV: str(cache.parent)}

    def driver(workdir: Path) -> list[str]:
        out = subprocess.run([sys.executable, "-c", code, str(workdir)], capture_output=True,
                             text=True, check=True, env=env)
        loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
        return loaded

    assert "rljob.model.tiny_model" in driver(tmp_path / "job1")  # built: a miss
    assert driver(tmp_path / "job2") == []  # copied: the driver never loads transformers
    assert _files(tmp_path / "job1" / "model") == _files(tmp_path / "job2" / "model")
    # The copy is the writer's bytes, as for REQUEST here:
    assert _files(materialise(REQUEST, tmp_path / "job3" / "model")) == built
    assert _leftovers(cache) == [] and _leftovers(tmp_path / "job2") == []


@pytest.mark.parametrize("other", [
    TinyRequest(REQUEST.shape, REQUEST.alphabet, 4, REQUEST.dtype),
    TinyRequest(REQUEST.shape, "0123+=-", REQUEST.seed, REQUEST.dtype),
    TinyRequest(REQUEST.shape, REQUEST.alphabet, REQUEST.seed, "bfloat16"),
    TinyRequest(TinyModel(hidden_size=32, num_layers=2, num_heads=2), REQUEST.alphabet,
                REQUEST.seed, REQUEST.dtype),
    TinyRequest(TinyModel(hidden_size=32, num_layers=1, num_heads=2, architecture="llama"),
                REQUEST.alphabet, REQUEST.seed, REQUEST.dtype),
], ids=["seed", "alphabet", "dtype", "layers", "architecture"])
def test_what_decides_the_bytes_decides_the_key(
        cache: Path, tmp_path: Path, other: TinyRequest, built: dict[str, bytes]) -> None:
    assert _files(materialise(REQUEST, tmp_path / "a")) == built
    assert cached(other) is None
    model = materialise(other, tmp_path / "b")
    assert _files(model)["model.safetensors"] != built["model.safetensors"]
    assert len(list(cache.iterdir())) == 2


def test_a_library_upgrade_gives_a_new_key(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    materialise(REQUEST, tmp_path / "a")
    assert cached(REQUEST) is not None
    real = tiny_cache.version
    monkeypatch.setattr(tiny_cache, "version",
                        lambda name: "99.0" if name == "transformers" else real(name))
    assert cached(REQUEST) is None


def test_without_a_libraries_version_nothing_is_cached(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        built: dict[str, bytes]) -> None:
    """A library installed without package metadata: its version is unknown, so no key can
    tell its builds apart; every job builds in place."""
    real = tiny_cache.version

    def version(name: str) -> str:
        if name == "torch":
            raise tiny_cache.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(tiny_cache, "version", version)
    assert _files(materialise(REQUEST, tmp_path / "job" / "model")) == built
    assert cached(REQUEST) is None and not cache.exists()


@pytest.mark.parametrize("damage", ["weights", "manifest", "no manifest", "no model",
                                    "a file more"])
def test_a_bad_entry_is_built_again_never_copied(
        cache: Path, tmp_path: Path, built: dict[str, bytes], damage: str) -> None:
    materialise(REQUEST, tmp_path / "first")
    entry = cache / REQUEST.key()
    if damage == "weights":
        (entry / MODEL / "model.safetensors").write_bytes(b"bit rot")
    elif damage == "manifest":
        (entry / MANIFEST).write_text("{not json")
    elif damage == "no manifest":  # an entry left by something else
        (entry / MANIFEST).unlink()
    elif damage == "no model":  # a removal cut short
        shutil.rmtree(entry / MODEL)
    else:
        (entry / MODEL / "extra.json").write_text("{}")
    assert _files(materialise(REQUEST, tmp_path / "next" / "model")) == built
    assert _files(entry / MODEL) == built and (entry / MANIFEST).is_file()
    assert _leftovers(cache) == []


def test_a_jobs_own_copy_is_kept_whatever_the_cache_holds(
        cache: Path, tmp_path: Path, built: dict[str, bytes]) -> None:
    """A resumed job reads the bytes it started with, even when the cache holds another
    whole entry under its key since (here: another seed's, manifest and all)."""
    model = materialise(REQUEST, tmp_path / "job" / "model")
    other = TinyRequest(REQUEST.shape, REQUEST.alphabet, 4, REQUEST.dtype)
    materialise(other, tmp_path / "other")
    entry = cache / REQUEST.key()
    shutil.rmtree(entry)
    shutil.copytree(cache / other.key(), entry)
    assert _files(materialise(REQUEST, model)) == built
    assert _files(entry / MODEL) == _files(tmp_path / "other")  # the cache untouched


def test_an_unreadable_entry_means_building_in_place(
        cache: Path, tmp_path: Path, built: dict[str, bytes]) -> None:
    materialise(REQUEST, tmp_path / "first")
    weights = cache / REQUEST.key() / MODEL / "model.safetensors"
    weights.unlink()
    weights.symlink_to(tmp_path / "nowhere")  # the copy fails with an OSError
    model = materialise(REQUEST, tmp_path / "job" / "model")
    assert _files(model) == built
    assert _leftovers(tmp_path / "job") == []


def test_without_a_writable_cache_the_model_is_built_in_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, built: dict[str, bytes]) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv(tiny_cache.CACHE_ENV, str(not_a_dir))
    model = materialise(REQUEST, tmp_path / "job" / "model")
    assert _files(model) == built
    assert _leftovers(model.parent) == []


def test_a_writer_that_finished_second_keeps_the_first_and_leaves_nothing(
        tmp_path: Path) -> None:
    target = tmp_path / "d"
    with staged(target, last_file="done") as first:
        with staged(target, last_file="done") as second:
            (second / "done").write_text("second")
        (first / "done").write_text("first")
    assert (target / "done").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    # Something in the way that is not a finished directory is an error, not a success.
    blocked = tmp_path / "blocked"
    (blocked / "other").mkdir(parents=True)
    with pytest.raises(OSError), staged(blocked, last_file="done") as tmp:
        (tmp / "done").write_text("")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked", "d"]


def test_a_failed_build_leaves_nothing(cache: Path, tmp_path: Path) -> None:
    bad = TinyRequest(TinyModel(hidden_size=30, num_layers=1, num_heads=4), "01", 0, "float32")
    with pytest.raises(ValueError, match="hiddenSize"):
        materialise(bad, tmp_path / "job" / "model")
    assert not (tmp_path / "job").exists()
    assert _leftovers(cache) == []
