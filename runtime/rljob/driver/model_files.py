"""The HF model directory a job's workers load, in a module without Ray: the driver
prepares it before Ray starts, and GPU tests build trainers from it on machines without Ray."""

from __future__ import annotations

from pathlib import Path

from rljob.rollout.tasks import DatasetError, load_task
from rljob_api import exits
from rljob_api.exits import JobError
from rljob_api.spec import RLJobSpec


def prepare_model(spec: RLJobSpec, workdir: Path) -> Path:
    """The HF model directory every worker loads: the spec's, or the built-in tiny model
    written for the task's alphabet (importing torch and transformers: `rljob.driver.start`
    does this while Ray starts)."""
    from rljob.model.tiny_model import BUILTIN_TINY, write_tiny

    if spec.model.source != BUILTIN_TINY:
        source = Path(spec.model.source)
        if not (source / "config.json").is_file():
            raise JobError(exits.INVALID, f"spec.model.source: {source} is not an HF "
                           "model directory (no config.json); give one or use builtin:tiny")
        return source
    data = spec.data
    try:
        alphabet = load_task(data.dataset, data.prompt_key, data.label_key).alphabet
        if spec.eval.dataset:
            alphabet += load_task(spec.eval.dataset, data.prompt_key, data.label_key,
                                  field="spec.eval.dataset").alphabet
    except DatasetError as err:
        raise JobError(exits.INVALID, str(err)) from None
    try:
        return write_tiny(workdir / "model", spec.model.tiny, alphabet, spec.algorithm.seed,
                          spec.model.dtype)
    except ValueError as err:
        raise JobError(exits.INVALID, str(err)) from None
