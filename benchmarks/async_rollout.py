"""Sync vs async rollout in one run: the same job to the same step count, twice.

    .venv/bin/python benchmarks/async_rollout.py [examples/tiny-cpu.yaml] [--steps N]
        [--max-staleness K] [--seeds N] [--first-seed S] [--modes sync,async]
        [--steps-per-rollout K] [--lr LR] [--tis CAP] [--json FILE]

Prints the wall time of each mode's loop (the anchor is the sync run, measured in this same
run on this machine), how long each step waited for its batch, the staleness async samples
had, and both reward curves (mean reward per 10 steps), so "faster and not worse" can be
read off one output. On a small CPU machine the engine and the trainer share the cores, so
the overlap buys less than on GPUs, where each has its own devices.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from rljob.cluster.cluster import RunOptions
from rljob.driver.run import run_job
from rljob.reporting import metrics_log
from rljob.reporting.reporter import PrintReporter
from rljob_api.spec import RLJobSpec
from rljob_api.validate import load_job


def run(name: str, spec: RLJobSpec, steps: int) -> tuple[float, list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        code = run_job(name, spec, RunOptions(Path(tmp), steps), PrintReporter())
        wall = time.monotonic() - started
        rows = metrics_log.read(Path(tmp) / metrics_log.METRICS_FILE)
    if code != 0:
        raise SystemExit(f"the {spec.rollout.mode} run exited {code}")
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
    parser.add_argument("--first-seed", type=int, default=None,
                        help="the first seed (default: the file's algorithm.seed)")
    parser.add_argument("--modes", default="sync,async",
                        help="the modes to run, comma-separated; the comparison needs both")
    parser.add_argument("--steps-per-rollout", type=int, default=None,
                        help="algorithm.stepsPerRollout (globalBatchSize follows, so a rollout "
                        "batch is still trained once)")
    parser.add_argument("--lr", type=float, default=None, help="algorithm.lr")
    parser.add_argument("--tis", type=float, default=None, metavar="CAP",
                        help="turn algorithm.tis on with this cap in both modes")
    parser.add_argument("--json", type=Path, default=None,
                        help="write every run's metrics rows here, by seed and mode "
                        "(rewritten after each seed)")
    args = parser.parse_args()
    doc, spec = load_job(args.file)
    steps = args.steps or spec.algorithm.total_steps
    first = spec.algorithm.seed if args.first_seed is None else args.first_seed
    seeds = [first + i for i in range(args.seeds)]
    modes = args.modes.split(",")
    algorithm = doc["spec"].setdefault("algorithm", {})
    if args.steps_per_rollout is not None:
        batch = spec.algorithm.rollout_batch_size * spec.algorithm.n_samples_per_prompt
        algorithm["stepsPerRollout"] = args.steps_per_rollout
        algorithm["globalBatchSize"] = batch // args.steps_per_rollout
    if args.lr is not None:
        algorithm["lr"] = args.lr
    if args.tis is not None:
        algorithm["tis"] = {"enabled": True, "cap": args.tis}
    per_seed: dict[int, dict[str, tuple[float, list[dict[str, Any]]]]] = {}
    for seed in seeds:
        per_seed[seed] = one_seed(doc, steps, seed, args.max_staleness, modes)
        if args.json is not None:  # after every seed: a run stopped later keeps these
            args.json.write_text(json.dumps(
                {str(s): {m: rows for m, (_, rows) in r.items()} for s, r in per_seed.items()}))
    print(f"\n{steps} steps of {args.file}, maxStaleness {args.max_staleness}, "
          f"stepsPerRollout {algorithm.get('stepsPerRollout')}, lr {algorithm.get('lr')}, "
          f"tis {algorithm.get('tis')}, "
          f"seeds {', '.join(map(str, seeds))}")
    if modes == ["sync", "async"]:
        for seed, results in per_seed.items():
            report(seed, results, steps)
    summary(per_seed, modes)


def std(values: list[float]) -> float:
    """Sample standard deviation (n − 1)."""
    if len(values) < 2:
        return float("nan")
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def summary(per_seed: dict[int, dict[str, tuple[float, list[dict[str, Any]]]]],
            modes: list[str]) -> None:
    """Mean and spread of the late reward over seeds and, with both modes, the paired
    difference (the same seed draws the same prompts and initial weights in both modes), so
    a gap can be told from seed noise: t = mean / (std / sqrt(n)) of the per-seed
    differences."""
    seeds = list(per_seed)
    for last in (10, 20):
        print(f"\n over {len(seeds)} seeds: mean reward of the last {last} steps")
        late = {m: [mean([r["reward"] for r in per_seed[s][m][1][-last:]]) for s in seeds]
                for m in modes}
        for m in modes:
            print(f"  {m:<5} {mean(late[m]):.3f} ± {std(late[m]):.3f} (seeds: "
                  f"{', '.join(f'{x:.3f}' for x in late[m])})")
        if modes == ["sync", "async"]:
            diff = [a - s for s, a in zip(late["sync"], late["async"], strict=True)]
            spread = std(diff)
            t = mean(diff) / (spread / math.sqrt(len(diff))) if spread > 0 else float("nan")
            print(f"  async − sync {mean(diff):+.3f} ± {spread:.3f}, paired t {t:+.2f} "
                  f"(n {len(diff)}), async ahead in {sum(d > 0 for d in diff)} of {len(diff)}")
    for m in modes:
        loops = [sum(r["step_seconds"] for r in per_seed[s][m][1]) for s in seeds]
        gaps = [mean([r["logprob_gap"] for r in per_seed[s][m][1]]) for s in seeds]
        print(f"  {m:<5} loop {mean(loops):.1f}s, mean |rollout − trainer log-prob| per token "
              f"{mean(gaps):.4f}")


def one_seed(doc: dict[str, Any], steps: int, seed: int, max_staleness: int,
             run_modes: list[str]) -> dict[str, tuple[float, list[dict[str, Any]]]]:
    modes: dict[str, RLJobSpec] = {}
    for mode in run_modes:
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
