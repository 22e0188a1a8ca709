"""The start-up clock: marks from the process's own start, and the line that carries them."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rljob.reporting import startup

pytestmark = pytest.mark.unit


def test_a_process_start_is_read_from_the_kernel_before_any_import() -> None:
    # A fresh interpreter: the start it reads lies after this test launched it and before
    # the first line of its own code ran (so the interpreter's start and every import count).
    code = ("import time; first = time.time(); from rljob.reporting import startup; "
            "print(startup.process_started_at(), first)")
    launched = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    started, first_line = map(float, out.stdout.split())
    tick = 0.011  # the kernel records a start in clock ticks (10 ms)
    assert launched - tick <= started <= first_line, (launched, started, first_line)


def test_the_driver_and_the_rollout_worker_import_no_torch() -> None:
    # torch costs every process that imports it seconds of start-up: the driver imports it
    # on a thread while Ray starts, never before; the rollout worker never.
    code = ("import sys, rljob.cli.main, rljob.driver.run, rljob.rollout.worker, "
            "rljob.cluster.cluster; print(sorted(m for m in ('torch', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout


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
