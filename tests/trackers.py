"""Each tracker's records read back with that tracker's own reader, as {key: {step: value}}.

TensorBoard: its EventAccumulator. W&B: `wandb leet inspect --json`, W&B's reader of an
offline run's transaction log (the Python datastore reader is gone from the SDK, and the
public API needs the server). MLflow: `MlflowClient.get_metric_history`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rljob.reporting import metrics_log

Series = dict[str, dict[int, float]]

NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _number(value: Any) -> float:
    return NON_FINITE[value] if isinstance(value, str) else float(value)


def metrics_jsonl(workdir: Path) -> Series:
    """metrics.jsonl as the trackers receive it: every number but the step, by step."""
    out: Series = {}
    for row in metrics_log.read(workdir / metrics_log.METRICS_FILE):
        for key, value in row.items():
            if key != "step" and (isinstance(value, int | float) or value in NON_FINITE):
                out.setdefault(key, {})[int(row["step"])] = _number(value)
    return out


def tensorboard(log_dir: Path) -> Series:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_offline(root: Path) -> Series:
    """The history of the one offline run under `root` (W&B's `dir`)."""
    (log,) = root.glob("wandb/offline-run-*/run-*.wandb")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false"}
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                         capture_output=True, text=True, check=True, env=env, timeout=120,
                         stdin=subprocess.DEVNULL).stdout
    series: Series = {}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue  # the command's notes on its options
        record = json.loads(line)
        if record.get("type") != "history":
            continue
        items = record["history"]["item"]
        step = int(items["_step"])
        for key, value in items.items():
            if not key.startswith("_"):
                series.setdefault(key, {})[step] = _number(value)
    return series


def mlflow(uri: str, experiment: str) -> tuple[Series, Any]:
    """The metrics of the one run of `experiment`, and that run (tags, status)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} at {uri}"
    (run,) = client.search_runs([found.experiment_id])
    series = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
              for key in run.data.metrics}
    return series, run


def same(got: Series, want: Series, rel: float = 0.0) -> list[str]:
    """Differences between two series (NaN equals NaN); `rel` allows float32 rounding."""
    diffs = []
    for key in sorted(set(got) | set(want)):
        a, b = got.get(key, {}), want.get(key, {})
        if a.keys() != b.keys():
            diffs.append(f"{key}: steps {sorted(a)} != {sorted(b)}")
            continue
        for step, value in b.items():
            g = a[step]
            if math.isnan(value) and math.isnan(g):
                continue
            if not (g == value or (math.isfinite(value) and math.isclose(g, value, rel_tol=rel,
                                                                         abs_tol=1e-30))):
                diffs.append(f"{key}@{step}: {g!r} != {value!r}")
    return diffs
