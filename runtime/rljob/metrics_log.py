"""`metrics.jsonl` (one JSON object per rollout step) and the reward/KL curve PNG.

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
    rows = [r for r in read(path) if int(r["step"]) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def append(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps({k: _encode(v) for k, v in row.items()}) + "\n")


def plot(rows: list[dict[str, Any]], target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [(int(r["step"]), float(r[key])) for r in rows
               if isinstance(r.get(key), int | float)]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(*series("reward"), label="train reward")
    if any("eval_reward" in r for r in rows):
        top.plot(*series("eval_reward"), "o-", label="eval reward")
    top.set_ylabel("mean reward")
    top.legend(loc="lower right")
    bottom.plot(*series("kl"), color="tab:red")
    bottom.set_ylabel("KL(policy ‖ ref)")
    bottom.set_xlabel("rollout step")
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)
