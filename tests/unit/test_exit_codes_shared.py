"""The exit codes the README documents are the ones the runtime exits with and the operator
acts on (both read `rljob_api.exits`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rljob_api import exits

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_documented_exit_codes_are_the_ones_in_use() -> None:
    documented = dict(re.findall(r"(\d+) (done|runtime failure|invalid job|stopped on "
                                 r"non-finite|rollout engines lost|stopped by SIGINT|"
                                 r"stopped by\s+SIGTERM)",
                                 " ".join(README.read_text().split())))
    assert documented == {
        str(exits.OK): "done", str(exits.FAILED): "runtime failure",
        str(exits.INVALID): "invalid job", str(exits.NONFINITE): "stopped on non-finite",
        str(exits.ENGINES_EXHAUSTED): "rollout engines lost",
        str(exits.INTERRUPTED): "stopped by SIGINT", str(exits.TERMINATED): "stopped by SIGTERM"}
    # Only the codes saying a restart cannot help end a job; a signal stop is not a failure.
    assert set(exits.TERMINAL_REASONS) == {exits.INVALID, exits.NONFINITE,
                                           exits.ENGINES_EXHAUSTED}
    assert set(exits.TERMINAL_MEANING) == set(exits.TERMINAL_REASONS)
