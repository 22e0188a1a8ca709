"""metrics.jsonl rows with evaluations on some steps only, read back and drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from rljob.reporting import metrics_log


def _write_run(path: Path) -> None:
    """Five steps as the driver writes them: eval figures on steps 2 and 4 and the last one,
    step 4's eval reward non-finite (written as the string "NaN")."""
    evals = {2: 0.25, 4: float("nan"), 5: 0.5}
    for step in range(1, 6):
        row = {"step": step, "reward": step / 10, "kl": step / 100}
        if step in evals:
            row |= {"eval_reward": evals[step], "eval_reward_max": 0.75, "eval_seconds": 1.0}
        metrics_log.append(path, row)


def test_sparse_eval_rows_keep_their_steps_in_the_curves(tmp_path: Path) -> None:
    path = tmp_path / metrics_log.METRICS_FILE
    _write_run(path)
    rows = metrics_log.read(path)
    assert rows[3]["eval_reward"] == "NaN"  # strict JSON on disk
    curves: dict[str, Any] = metrics_log.reward_curves(rows)  # compared with pytest.approx
    assert curves["train reward"] == ([1, 2, 3, 4, 5], pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5]))
    assert curves["eval reward"] == ([2, 5], [0.25, 0.5])  # the NaN left out, not a 0
    assert curves["eval best-of-n"] == ([2, 4, 5], [0.75, 0.75, 0.75])
    assert metrics_log.last_eval(path) == (5, 0.5)
    metrics_log.append(path, {"step": 6, "reward": 0.6, "eval_reward": float("inf")})
    assert metrics_log.last_eval(path) == (6, float("inf"))

    metrics_log.plot(metrics_log.read(path), tmp_path / metrics_log.PLOT_FILE)
    image = matplotlib.image.imread(tmp_path / metrics_log.PLOT_FILE)
    assert image.shape[:2] == (600, 700)  # 7 × 6 inches at 100 dpi


def test_a_run_without_evaluations_draws_the_training_curve_alone(tmp_path: Path) -> None:
    rows = [{"step": s, "reward": 0.5, "kl": 0.0} for s in (1, 2)]
    assert list(metrics_log.reward_curves(rows)) == ["train reward"]
    metrics_log.plot(rows, tmp_path / metrics_log.PLOT_FILE)
    assert (tmp_path / metrics_log.PLOT_FILE).stat().st_size > 0
    assert metrics_log.last_eval(tmp_path / metrics_log.METRICS_FILE) is None
