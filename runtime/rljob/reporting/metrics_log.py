"""`metrics.jsonl` (one JSON object per rollout step) and the reward/KL curve PNG.

Eval figures (`eval_reward`, ...) appear only in the rows of steps that were evaluated.

Non-finite figures are written as the strings "NaN"/"Infinity"/"-Infinity" so the file
stays strict JSON without hiding them behind a number.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"
NON_FINITE = ("NaN", "Infinity", "-Infinity")  # how append writes non-finite floats


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def keep_until(path: Path, step: int) -> None:
    """Drop rows after `step` (they are redone after a resume from that step)."""
    if not path.exists():
        return
    rows = [r for r in read(path) if int(r["step"]) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def append(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps({k: _encode(v) for k, v in row.items()}) + "\n")


def last_eval(path: Path) -> tuple[int, float] | None:
    """(step, eval_reward) of the latest row that has an evaluation, or None; a non-finite
    reward comes back as the float it was, for the status to name."""
    for row in reversed(read(path)):
        value = row.get("eval_reward")
        if isinstance(value, int | float) or value in NON_FINITE:
            return int(row["step"]), float(value)
    return None


Series = tuple[list[int], list[float]]


def series(rows: list[dict[str, Any]], key: str) -> Series:
    """(steps, values) of the rows that have a finite number under `key`: eval figures exist
    only on eval steps, so each point keeps its own step instead of a row index."""
    pts = [(int(r["step"]), float(r[key])) for r in rows
           if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def reward_curves(rows: list[dict[str, Any]]) -> dict[str, Series]:
    """The upper panel's curves by label: the training reward of every step, and the eval
    figures where an evaluation ran."""
    curves = {"train reward": series(rows, "reward")}
    for key, label in (("eval_reward", "eval reward"), ("eval_reward_max", "eval best-of-n")):
        points = series(rows, key)
        if points[0]:
            curves[label] = points
    return curves


def plot(rows: list[dict[str, Any]], target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for label, (steps, values) in reward_curves(rows).items():
        style = "-" if label == "train reward" else ("o-" if label == "eval reward" else "s--")
        top.plot(steps, values, style, label=label)
    top.set_ylabel("mean reward")
    top.legend(loc="lower right")
    bottom.plot(*series(rows, "kl"), color="tab:red")
    bottom.set_ylabel("KL(policy ‖ ref)")
    bottom.set_xlabel("rollout step")
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)
