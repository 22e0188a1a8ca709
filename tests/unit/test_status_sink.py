"""What the driver pod's status writer takes from the driver container: the runtime's status
fields as their models read them, nothing else (`status_sink.checked_fields`)."""

from __future__ import annotations

import pytest

from rljob.reporting.reporter import finite_progress
from rljob.reporting.status_sink import checked_fields
from rljob_api.status import CheckpointStatus, Progress, RuntimeStop


def test_the_runtimes_own_reports_pass_unchanged() -> None:
    progress = finite_progress(Progress(rollout_step=3, train_step=6, total_steps=10,
                                        mean_reward=float("nan"),
                                        updated_at="2026-01-01T00:00:00Z"))
    checkpoint = CheckpointStatus(step=2, path="/c/step_2", verified=True).model_dump(
        by_alias=True, exclude_none=True)
    stop = RuntimeStop(signal="SIGTERM", attempt=0, step=3, exit_code=143,
                       time="2026-01-01T00:00:00Z").model_dump(by_alias=True, exclude_none=True)
    fields = {"progress": progress, "checkpoint": checkpoint, "stopped": stop}
    assert checked_fields(fields) == fields
    assert fields["progress"]["nonFinite"] == "meanReward"


@pytest.mark.parametrize(("raw", "named"), [
    ([], "fields: expected an object"),
    ({"phase": "Succeeded"}, "fields: phase not a runtime status field"),
    ({"recovery": {"restarts": 0}}, "fields: recovery not a runtime status field"),
    ({"progress": {"rolloutStep": "many"}}, "progress.rolloutStep:"),
    ({"progress": {"rolloutStep": 1, "extra": 1}}, "progress.extra:"),
    ({"stopped": {"signal": "SIGTERM"}}, "stopped.attempt:"),
    ({"checkpoint": {"history": [{"step": 1}] * 17}}, "checkpoint.history:"),
    ({"progress": {"meanReward": float("inf")}}, "progress.meanReward: inf is not a finite"),
    ({"checkpoint": {"history": [{"step": 2**63, "path": "/c", "savedAt": "now"}]}},
     "checkpoint.history.0.step: 9223372036854775808 is beyond a 64-bit integer"),
])
def test_anything_else_is_refused_naming_the_field(raw: object, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace(".", r"\.").replace("(", r"\(")):
        checked_fields(raw)
