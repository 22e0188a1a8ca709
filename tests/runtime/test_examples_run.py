"""Each CPU example of examples/ (as tests/unit/test_examples.py finds them) runs with
`rljob run`, unchanged but for `--max-steps`, as a user would start it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rljob.reporting import metrics_log
from rljob_api.exits import OK as EXIT_OK
from tests.processes import reap
from tests.unit.test_examples import cpu_examples

pytestmark = pytest.mark.runtime


@pytest.mark.parametrize("path", cpu_examples(), ids=lambda p: p.name)
def test_cpu_example_runs(tmp_path: Path, path: Path) -> None:
    workdir = tmp_path / "w"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rljob.cli", "run", str(path), "--max-steps", "2",
         "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=540)
    finally:
        reap(proc)
    assert proc.returncode == EXIT_OK, out.decode(errors="replace")[-4000:]
    rows = metrics_log.read(workdir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["policy_version"] == r["step"] for r in rows)
