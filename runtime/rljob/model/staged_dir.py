"""A directory written beside its final name and moved there whole, so a reader sees either
nothing or all of it: the tiny model in a job's work directory and the cache's entries,
which two jobs may write at once."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged(directory: Path, last_file: str) -> Iterator[Path]:
    """A fresh sibling of `directory` to write into, moved to `directory` when the block ends
    and removed when it raises (a failed or interrupted write leaves nothing). When another
    writer finished `directory` first (it holds `last_file`), theirs is kept: every finished
    one is whole. Anything else in the way is an error, never taken for a finished one."""
    tmp = directory.with_name(f"{directory.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        try:
            tmp.rename(directory)
        except OSError:
            if not (directory / last_file).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
