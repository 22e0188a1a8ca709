"""The start-up clock: marks from the process's own start, and the line that carries them."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rljob.reporting import startup

pytestmark = pytest.mark.unit


def test_a_process_start_is_read_from_the_kernel_before_any_import() -> None:
    # A fresh interpreter that sleeps before importing the clock: the start it reads is the
    # process's, so the sleep (and the interpreter's own start) is inside it.
    code = ("import time; time.sleep(0.5); from rljob.reporting import startup; "
            "print(time.time() - startup.process_started_at())")
    began = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    elapsed = float(out.stdout)
    assert 0.5 <= elapsed <= time.time() - began + 0.05, (elapsed, time.time() - began)


def test_the_line_lists_every_mark_in_order_and_parses_back(
        capsys: pytest.CaptureFixture[str]) -> None:
    clock = startup.StartupClock(time.time() - 2.0)
    clock.mark("imports")
    clock.mark("ray started")
    clock.finish()
    clock.mark("late")  # after the line: not part of start-up
    clock.finish()  # printed once
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if startup.PREFIX in ln]
    marks = startup.parse("\rbar 0%" + line)  # a progress bar may share the line
    assert [m.name for m in marks] == ["imports", "ray started", startup.FIRST_ROLLOUT]
    assert all(2.0 <= m.at_s < 60 for m in marks)
    assert [m.at_s for m in marks] == sorted(m.at_s for m in marks)
