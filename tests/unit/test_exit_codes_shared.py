"""The operator acts on the driver's exit codes; they must be the ones the runtime exits with."""

from __future__ import annotations

import pytest

from rljob_api import exits
from rljob_api import exits as exit_codes

pytestmark = pytest.mark.unit


def test_operator_and_runtime_agree_on_the_exit_codes() -> None:
    assert (exits.INVALID, exits.NONFINITE, exits.TERMINATED) == (
        exit_codes.INVALID, exit_codes.NONFINITE, exit_codes.TERMINATED)
    # Only the codes saying a restart cannot help end a job; a signal stop is not a failure.
    assert set(exits.TERMINAL_REASONS) == {exit_codes.INVALID, exit_codes.NONFINITE}
    assert set(exits.TERMINAL_MEANING) == set(exits.TERMINAL_REASONS)
