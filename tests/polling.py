"""Poll-with-deadline: the only way tests wait for something to become true."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Timeout(AssertionError):
    """The condition did not hold before the deadline; says what was last seen."""


def wait_for(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.2,
    describe: Callable[[], str] | None = None,
) -> T:
    """Call `probe` until it returns something truthy; return it, or fail after `timeout` s.

    `probe` may raise; the last exception (or `describe()`) goes into the failure message.
    """
    deadline = time.monotonic() + timeout
    last: str = "never evaluated"
    while True:
        try:
            value = probe()
            if value:
                return value
            last = f"last value: {value!r}"
        except Exception as err:  # a probe error is a "not yet", reported on timeout
            last = f"last error: {type(err).__name__}: {err}"
        if time.monotonic() >= deadline:
            extra = describe() if describe else last
            raise Timeout(f"timed out after {timeout:.0f}s waiting for {what}; {extra}")
        time.sleep(interval)
