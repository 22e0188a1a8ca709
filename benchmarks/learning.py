"""Learning benchmark: run the tiny CPU job and print mean reward vs step and wall time.

    .venv/bin/python benchmarks/learning.py [examples/tiny-cpu.yaml] [--steps N]

The baseline is the untrained policy's mean reward (first rollout step, before any
update); the result is the mean over the last 10 steps.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rljob.cluster.cluster import RunOptions
from rljob.driver.run import run_job
from rljob.reporting import metrics_log
from rljob.reporting.reporter import PrintReporter
from rljob_api.validate import load_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("file", nargs="?", default="examples/tiny-cpu.yaml")
    parser.add_argument("--steps", type=int, default=None, help="stop after N steps")
    args = parser.parse_args()
    doc, spec = load_job(args.file)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        started = time.monotonic()
        code = run_job(doc["metadata"]["name"], spec, RunOptions(workdir, args.steps),
                       PrintReporter())
        wall = time.monotonic() - started
        rows = metrics_log.read(workdir / metrics_log.METRICS_FILE)
    print(f"\nexit code {code}; {len(rows)} steps in {wall:.1f}s wall "
          f"({sum(r['step_seconds'] for r in rows):.1f}s in the loop)")
    print(" step  reward    kl      tok/s  elapsed")
    elapsed = 0.0
    for r in rows:
        elapsed += r["step_seconds"]
        if r["step"] % 5 == 0 or r["step"] == 1:
            print(f"{r['step']:5d}  {r['reward']:.3f}  {r['kl']:7.3f}  "
                  f"{r['tokens_per_second']:6.0f}  {elapsed:6.1f}s")
    rewards = [r["reward"] for r in rows]
    last = rewards[-10:]
    print(f"untrained baseline (step 1): {rewards[0]:.3f}   "
          f"mean of last {len(last)} steps: {sum(last) / len(last):.3f}")


if __name__ == "__main__":
    main()
