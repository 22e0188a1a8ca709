"""The operator's engine gauges follow each job's `status.engines`: ready and total, and
the version of each serving engine, with no sample left for an engine that stopped serving
or a job that went."""

from __future__ import annotations

from typing import Any

import pytest

from rljob_operator.metrics import Metrics

pytestmark = pytest.mark.unit

KEY = ("team-a", "grpo")


def engines(*rows: tuple[str, int | None]) -> dict[str, Any]:
    listed = [{"name": f"engine-{i}", "state": state, "weightVersion": version}
              for i, (state, version) in enumerate(rows)]
    return {"ready": sum(1 for e in listed if e["state"] == "Serving"), "total": len(listed),
            "engines": listed}


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"namespace": KEY[0], "job": KEY[1],
                                                    **labels})


def test_engine_gauges_follow_the_reported_engines() -> None:
    metrics = Metrics()
    metrics.set_engines(KEY, engines(("Serving", 7), ("Serving", 7)))
    assert sample(metrics, "rljob_engines_ready") == 2
    assert sample(metrics, "rljob_engines_total") == 2
    assert sample(metrics, "rljob_engine_weight_version", engine="engine-1") == 7

    metrics.set_engines(KEY, engines(("Serving", 8), ("Lost", None)))
    assert sample(metrics, "rljob_engines_ready") == 1
    assert sample(metrics, "rljob_engine_weight_version", engine="engine-0") == 8
    assert sample(metrics, "rljob_engine_weight_version", engine="engine-1") is None

    metrics.set_engines(KEY, None)  # the job was deleted
    assert sample(metrics, "rljob_engines_ready") is None
    assert sample(metrics, "rljob_engines_total") is None
    assert sample(metrics, "rljob_engine_weight_version", engine="engine-0") is None
