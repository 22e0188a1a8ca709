"""Sync vs async rollout in one run: the same job to the same step count, twice.

    .venv/bin/python benchmarks/async_rollout.py [examples/tiny-cpu.yaml] [--steps N]
        [--max-staleness K]

Prints the wall time of each mode's loop (the anchor is the sync run, measured in this same
run on this machine), how long each step waited for its batch, the staleness async samples
had, and both reward curves (mean reward per 10 steps), so "faster and not worse" can be
read off one output. On a small CPU machine the engine and the trainer share the cores, so
the overlap buys less than on GPUs, where each has its own devices.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from rljob import metrics_log
from rljob.cluster import RunOptions
from rljob.driver import run_job
from rljob.report import PrintReporter
from rljob_api.spec import RLJobSpec
from rljob_api.validate import load_job


def run(name: str, spec: RLJobSpec, steps: int) -> tuple[float, list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        code = run_job(name, spec, RunOptions(Path(tmp), steps), PrintReporter())
        wall = time.monotonic() - started
        rows = metrics_log.read(Path(tmp) / metrics_log.METRICS_FILE)
    if code != 0:
        raise SystemExit(f"{spec.rollout.mode.value} run exited {code}")
    return wall, rows


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("file", nargs="?", default="examples/tiny-cpu.yaml")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (totalSteps)")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=1,
                        help="runs per mode, seeds algorithm.seed, +1, ...: the curves' spread")
    args = parser.parse_args()
    doc, spec = load_job(args.file)
    steps = args.steps or spec.algorithm.total_steps
    seeds = [spec.algorithm.seed + i for i in range(args.seeds)]
    per_seed = {seed: one_seed(doc, steps, seed, args.max_staleness) for seed in seeds}
    print(f"\n{steps} steps of {args.file}, maxStaleness {args.max_staleness}, "
          f"seeds {', '.join(map(str, seeds))}")
    for seed, results in per_seed.items():
        report(seed, results, steps)
    if len(seeds) > 1:
        print("\n over all seeds: mean of the last 10 steps, and loop time")
        for mode in ("sync", "async"):
            lasts = [mean([r["reward"] for r in per_seed[s][mode][1][-10:]]) for s in seeds]
            loops = [sum(r["step_seconds"] for r in per_seed[s][mode][1]) for s in seeds]
            print(f"  {mode:<5} reward {mean(lasts):.3f} (seeds: "
                  f"{', '.join(f'{x:.3f}' for x in lasts)}), loop {mean(loops):.1f}s")


def one_seed(doc: dict[str, Any], steps: int, seed: int, max_staleness: int
             ) -> dict[str, tuple[float, list[dict[str, Any]]]]:
    modes: dict[str, RLJobSpec] = {}
    for mode in ("sync", "async"):
        edited = copy.deepcopy(doc)
        edited["spec"].setdefault("algorithm", {})["totalSteps"] = steps
        edited["spec"]["algorithm"]["seed"] = seed
        # One checkpoint, at the end: a save waits for the batch generating ahead, which
        # would hide async generation time outside the steps' own seconds.
        edited["spec"].setdefault("checkpoint", {})["interval"] = steps
        rollout = edited["spec"].setdefault("rollout", {})
        rollout["mode"] = mode
        rollout.pop("maxStaleness", None)
        if mode == "async":
            rollout["maxStaleness"] = max_staleness
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as fh:
            yaml.safe_dump(edited, fh)
            fh.flush()
            modes[mode] = load_job(fh.name)[1]  # validated as `rljob run` would
    return {mode: run(doc["metadata"]["name"], s, steps) for mode, s in modes.items()}


def report(seed: int, results: dict[str, tuple[float, list[dict[str, Any]]]], steps: int
           ) -> None:
    print(f"\n seed {seed}")
    print(" mode   wall s  loop s  waited for batch s  train s  staleness mean/max"
          "   (loop: the steps, start-up and the final save left out)")
    for mode, (wall, rows) in results.items():
        print(f" {mode:<5} {wall:7.1f} {sum(r['step_seconds'] for r in rows):7.1f} "
              f"{sum(r['rollout_wait_seconds'] for r in rows):19.1f} "
              f"{sum(r['train_seconds'] for r in rows):8.1f}  "
              f"{mean([r['staleness_mean'] for r in rows]):.2f}/"
              f"{max(r['staleness_max'] for r in rows):.0f}")
    sync_loop = sum(r["step_seconds"] for r in results["sync"][1])
    async_loop = sum(r["step_seconds"] for r in results["async"][1])
    print(f" async loop time / sync loop time: {async_loop / sync_loop:.2f}")
    print("\n mean reward per 10 steps")
    print("  steps     sync  async")
    for start in range(0, steps, 10):
        cells = [mean([r["reward"] for r in rows[start:start + 10]])
                 for _, rows in results.values()]
        print(f"  {start + 1:3d}-{min(start + 10, steps):<3d}  {cells[0]:.3f}  {cells[1]:.3f}")
    for mode, (_, rows) in results.items():
        print(f" {mode}: first step {rows[0]['reward']:.3f}, mean of last 10 steps "
              f"{mean([r['reward'] for r in rows[-10:]]):.3f}")


if __name__ == "__main__":
    main()
