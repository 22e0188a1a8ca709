"""Rollout engines lost mid-run: the same job with and without faults, in one run.

    .venv/bin/python benchmarks/engine_faults.py [examples/tiny-cpu.yaml] [--engines N]
        [--steps S] [--kill-every K] [--json FILE] [--logs DIR]

Runs `rljob run` twice on this machine with N engines: once untouched (the anchor, measured
in this same run), once killing one engine process (SIGKILL, chosen in turn) every K steps.
A kill waits until every engine serves (the run's own `lost`/`rejoined` lines), so each
fault is one engine of N down, the case the target speaks of; a kill that would land while
a replacement is still starting is put off, and the kills made are printed.
Prints for each run the steps/s of the loop, the steps redone (metrics.jsonl rows beyond one
per step, and attempts resumed), the requests sent again, the engines lost and rejoined,
and how long engines were down: from each loss to its engine's rejoin, or to the end of the
run for an engine that never rejoined. The target: 0 steps redone, and a throughput loss no
larger than the lost engines' share of the generation while they were down (printed beside
it as the bound).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from rljob.reporting import metrics_log

REPO = Path(__file__).resolve().parents[1]


def engine_processes(root: int) -> list[psutil.Process]:
    """The run's engine actor processes (Ray titles each `ray::EngineProcess`)."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith("ray::EngineProcess"):
                out.append(child)
        except psutil.Error:
            continue
    return out


# Searched, not matched: a line may follow the progress bar's last redraw.
LOST = re.compile(r"engines: (engine-\d+) lost: ")
REJOINED = re.compile(r"engines: (engine-\d+) rejoined, ")


def engines_down(lines: list[tuple[float, str]]) -> dict[str, float]:
    """The engines lost and not rejoined yet, with when each was lost (by the run's log)."""
    down: dict[str, float] = {}
    for t, text in lines:
        if lost := LOST.search(text):
            down.setdefault(lost.group(1), t)
        elif back := REJOINED.search(text):
            down.pop(back.group(1), None)
    return down


def down_seconds(lines: list[tuple[float, str]], end: float) -> float:
    """Seconds engines were down before `end` (the last step's end), summed over engines:
    each loss to that engine's rejoin, or to `end` for an engine still down then."""
    total, down = 0.0, dict[str, float]()
    for t, text in lines:
        if lost := LOST.search(text):
            down.setdefault(lost.group(1), t)
        elif (back := REJOINED.search(text)) and back.group(1) in down:
            total += max(0.0, min(t, end) - down.pop(back.group(1)))
    return total + sum(max(0.0, end - t) for t in down.values())


def run(doc: dict[str, Any], kill_every: int | None, log: Path | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path, workdir = Path(tmp) / "job.yaml", Path(tmp) / "w"
        path.write_text(yaml.safe_dump(doc))
        proc = subprocess.Popen(
            [sys.executable, "-m", "rljob.cli", "run", str(path), "--workdir", str(workdir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        lines: list[tuple[float, str]] = []

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append((time.monotonic(), line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        kills, turn, next_kill = 0, 0, kill_every
        total = int(doc["spec"]["algorithm"]["totalSteps"])
        loop_end: float | None = None
        metrics = workdir / metrics_log.METRICS_FILE
        while proc.poll() is None:
            time.sleep(0.2)
            if not metrics.exists():
                continue
            done = len({int(r["step"]) for r in metrics_log.read(metrics)})
            if done >= total and loop_end is None:
                loop_end = time.monotonic()  # downtime counts to the last step, not the exit
            # No kill once the last step is done: it would land on a run that is ending.
            if next_kill is not None and next_kill <= done < total \
                    and not engines_down(list(lines)):
                engines = engine_processes(proc.pid)
                if engines:
                    os.kill(engines[turn % len(engines)].pid, signal.SIGKILL)
                    kills, turn = kills + 1, turn + 1
                next_kill = done + (kill_every or 0)  # K steps after this kill, not the plan
        reader.join(timeout=10)
        end = loop_end or time.monotonic()
        if log is not None:  # each line with the seconds since the run started
            start = lines[0][0] if lines else end
            log.write_text("".join(f"{t - start:8.2f} {text}\n" for t, text in lines))
        rows = metrics_log.read(metrics)
        if proc.returncode != 0:
            tail = "\n".join(text for _, text in lines[-40:])
            raise SystemExit(f"rljob run exited {proc.returncode}:\n{tail}")
    loop_s = sum(float(r["step_seconds"]) for r in rows)
    steps = [int(r["step"]) for r in rows]
    lost = sum(1 for _, text in lines if LOST.search(text))
    back = sum(1 for _, text in lines if REJOINED.search(text))
    return {"kills": kills, "steps": len(set(steps)), "rows": len(rows),
            "redone": len(steps) - len(set(steps)),
            "resumed": sum(1 for _, text in lines if text.startswith("resumed from")),
            "loop_seconds": loop_s, "steps_per_second": len(rows) / loop_s,
            "reissued": sum(float(r.get("reissued_requests", 0)) for r in rows),
            "lost": lost, "rejoined": back, "engine_down_seconds": down_seconds(lines, end)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", nargs="?", default=str(REPO / "examples" / "tiny-cpu.yaml"))
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-every", type=int, default=15)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="write each run's output here, timed")
    args = parser.parse_args()
    doc = yaml.safe_load(Path(args.job).read_text())
    doc["spec"]["rollout"]["engines"] = args.engines
    doc["spec"]["algorithm"]["totalSteps"] = args.steps
    doc["spec"]["checkpoint"]["interval"] = args.steps  # a redone step would show
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    results = {"no faults": run(copy.deepcopy(doc), None,
                                args.logs / "no-faults.log" if args.logs else None),
               f"kill 1 of {args.engines} every {args.kill_every} steps":
                   run(copy.deepcopy(doc), args.kill_every,
                       args.logs / "faults.log" if args.logs else None)}
    anchor = results["no faults"]["steps_per_second"]
    print(f"{args.steps} steps, {args.engines} engines, this machine ({os.cpu_count()} CPUs)")
    print(f"{'run':<32}{'kills':>6}{'steps/s':>9}{'vs anchor':>10}{'redone':>8}"
          f"{'resumed':>8}{'reissued':>9}{'lost':>5}{'back':>5}{'down s':>8}{'bound':>7}")
    for name, r in results.items():
        # The lost engines' share of generation while they were down, over the loop.
        bound = r["engine_down_seconds"] / args.engines / r["loop_seconds"]
        print(f"{name:<32}{r['kills']:>6}{r['steps_per_second']:>9.3f}"
              f"{r['steps_per_second'] / anchor - 1:>+10.1%}{r['redone']:>8}{r['resumed']:>8}"
              f"{r['reissued']:>9.0f}{r['lost']:>5}{r['rejoined']:>5}"
              f"{r['engine_down_seconds']:>8.1f}{-bound:>+7.1%}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
