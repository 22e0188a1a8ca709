"""Small RLJob files for the runtime tests, derived from examples/tiny-cpu.yaml."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from rljob.reporting import metrics_log
from rljob_api.spec import RLJobSpec
from rljob_api.validate import load_job
from tests.controlplane import REPO

BASE = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())

# 8 prompts × 4 samples = 16 × 2 optimizer steps per rollout step: fast on 2 cores.
SMALL = {
    "algorithm": {"rolloutBatchSize": 8, "nSamplesPerPrompt": 4, "globalBatchSize": 16,
                  "stepsPerRollout": 2, "microBatchSize": 8, "totalSteps": 4},
    "checkpoint": {"interval": 2, "keepLast": 2},
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def job_file(tmp: Path, *overrides: dict[str, Any], name: str = "job") -> Path:
    doc = copy.deepcopy(BASE)
    doc["spec"] = _merge(doc["spec"], SMALL)
    for over in overrides:
        doc["spec"] = _merge(doc["spec"], over)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def job_spec(tmp: Path, *overrides: dict[str, Any]) -> RLJobSpec:
    return load_job(job_file(tmp, *overrides))[1]


# Figures that depend on the machine's speed, not on what was trained.
TIMING = {"tokens_per_second", "rollout_seconds", "rollout_wait_seconds", "train_seconds",
          "step_seconds"}


def metric_rows(workdir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl of a run without its timings: equal for runs that trained the same."""
    return [{k: v for k, v in r.items() if k not in TIMING}
            for r in metrics_log.read(workdir / metrics_log.METRICS_FILE)]
