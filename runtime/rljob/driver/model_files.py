"""The HF model directory a job's workers load, in a module without Ray: the driver
prepares it before Ray starts, and GPU tests build trainers from it on machines without Ray."""

from __future__ import annotations

from pathlib import Path

from rljob.model.tiny_cache import TinyRequest, cached, materialise
from rljob.rollout.tasks import DatasetError, load_task
from rljob_api import exits
from rljob_api.exits import JobError
from rljob_api.spec import BUILTIN_TINY, RLJobSpec


def tiny_request(spec: RLJobSpec) -> TinyRequest | None:
    """What the built-in tiny model of this job is made of (its alphabet is the task's);
    None for a model of the user's."""
    if spec.model.source != BUILTIN_TINY:
        return None
    data = spec.data
    try:
        alphabet = load_task(data.dataset, data.prompt_key, data.label_key).alphabet
        if spec.eval.dataset:
            alphabet += load_task(spec.eval.dataset, data.prompt_key, data.label_key,
                                  field="spec.eval.dataset").alphabet
    except DatasetError as err:
        raise JobError(exits.INVALID, str(err)) from None
    return TinyRequest(spec.model.tiny, alphabet, spec.algorithm.seed, spec.model.dtype)


def import_writer_if_needed(spec: RLJobSpec) -> None:
    """Import the tiny model's writer (transformers' model classes: seconds of CPU) when this
    job will build its model, so `rljob.driver.start` spends them while Ray starts; a model
    of the user's or one built before needs none. Errors are `prepare_model`'s to report,
    after Ray started, as they were before this thread (it reads the dataset again: a toy
    task's, for the tiny model)."""
    try:
        request = tiny_request(spec)
        if request is not None and cached(request) is None:
            import rljob.model.tiny_model  # noqa: F401
    except Exception:  # reported by prepare_model, on the driver's thread
        return


def prepare_model(spec: RLJobSpec, workdir: Path) -> Path:
    """The HF model directory every worker loads: the spec's, or the built-in tiny model
    in the work directory (`rljob.model.tiny_cache`: copied when built before)."""
    request = tiny_request(spec)
    if request is None:
        source = Path(spec.model.source)
        if not (source / "config.json").is_file():
            raise JobError(exits.INVALID, f"spec.model.source: {source} is not an HF "
                           "model directory (no config.json); give one or use builtin:tiny")
        return source
    try:
        return materialise(request, workdir / "model")
    except ValueError as err:
        raise JobError(exits.INVALID, str(err)) from None
