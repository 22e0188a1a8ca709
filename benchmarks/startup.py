"""Start-up benchmark: from `rljob run FILE` to its first rollout request, phase by phase.

    .venv/bin/python benchmarks/startup.py [examples/tiny-cpu.yaml] [--runs 3]

Each run is a fresh `rljob run FILE --max-steps 1` process on a new workdir (nothing to
resume). The driver prints one `startup:` line (`rljob.reporting.startup`): seconds from the
process's start to each mark (its imports, Ray started, the placement group, each actor's
constructor done, the first weights in the engines, the first rollout request). The table
holds every run's marks and their median. The anchor, measured in the same run on the same
machine, is what one Python process takes to import torch and transformers: start-up costs
a few of those, so the ratio travels between machines better than the seconds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rljob.reporting import startup

REPO = Path(__file__).resolve().parents[1]
RLJOB = Path(sys.executable).parent / "rljob"


def anchor_s() -> float:
    """Wall seconds of a Python process that imports torch and transformers' model classes."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c",
                    "import torch, transformers; transformers.AutoModelForCausalLM"],
                   check=True)
    return time.monotonic() - started


def one_run(file: str) -> tuple[list[startup.Mark], float]:
    """The marks of one fresh run, and its wall time to the exit (one step)."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        proc = subprocess.run([str(RLJOB), "run", file, "--max-steps", "1", "--workdir", tmp],
                              capture_output=True, text=True, cwd=REPO, check=False)
        wall = time.monotonic() - started
    # The progress bar may share the line (it redraws with carriage returns).
    lines = [ln for ln in proc.stderr.splitlines() if startup.PREFIX in ln]
    if proc.returncode != 0 or not lines:
        sys.exit(f"rljob run exited {proc.returncode} without a startup line:\n"
                 f"{proc.stderr[-4000:]}")
    return startup.parse(lines[0]), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", default="examples/tiny-cpu.yaml")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    anchor = anchor_s()
    runs = [one_run(args.file) for _ in range(args.runs)]
    names: list[str] = []
    for marks, _ in runs:
        names += [m.name for m in marks if m.name not in names]
    by_run = [{m.name: m.at_s for m in marks} for marks, _ in runs]
    names.sort(key=lambda n: statistics.median(r[n] for r in by_run if n in r))
    width = max(len(n) for n in names)
    print(f"{args.file}: seconds from the `rljob run` process's start, {args.runs} runs")
    print(f"{'mark':<{width}}  " + "  ".join(f"run {i + 1:>2}" for i in range(args.runs))
          + "  median")
    for name in names:
        cells = [f"{r[name]:6.2f}" if name in r else "     -" for r in by_run]
        values = [r[name] for r in by_run if name in r]
        print(f"{name:<{width}}  " + "  ".join(cells) + f"  {statistics.median(values):6.2f}")
    first = statistics.median(r[startup.FIRST_ROLLOUT] for r in by_run)
    wall = statistics.median(w for _, w in runs)
    print(f"\nfirst rollout request: {first:.2f}s (median); one-step run wall {wall:.1f}s")
    print(f"anchor: import torch + transformers in one process {anchor:.2f}s "
          f"(first rollout request = {first / anchor:.1f} x the anchor)")


if __name__ == "__main__":
    main()
