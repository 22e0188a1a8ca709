"""Events from the rollout engines the runtime reports: a loss and a rejoin each get one, a
report seen for the first time gets none, and a loss between two reports still shows."""

from __future__ import annotations

from typing import Any

import pytest

from rljob_operator.engine_events import engine_events, seen

pytestmark = pytest.mark.unit


def report(*engines: tuple[str, str, int | None], attempt: int = 0,
           restarts: int = 1) -> dict[str, Any]:
    rows = [{"name": f"engine-{i}", "state": state, "since": since, "weightVersion": version,
             "restarts": restarts, "reason": "Ray lost its process"}
            for i, (state, since, version) in enumerate(engines)]
    ready = sum(1 for r in rows if r["state"] == "Serving")
    return {"attempt": attempt, "ready": ready, "total": len(rows), "engines": rows}


def test_a_first_report_is_taken_as_it_is() -> None:
    assert engine_events(None, report(("Lost", "t1", None))) == []


def test_a_loss_and_a_rejoin_each_get_an_event() -> None:
    first = report(("Serving", "t0", 3), ("Serving", "t0", 3))
    lost = report(("Serving", "t0", 3), ("Lost", "t1", None))
    [event] = engine_events(seen(first), lost)
    assert (event.type, event.reason) == ("Warning", "EngineLost")
    assert "engine-1 lost at t1: Ray lost its process" in event.message
    assert "1/2 engines" in event.message
    assert engine_events(seen(lost), report(("Serving", "t0", 3), ("Rejoining", "t2", None))) \
        == []
    back = report(("Serving", "t0", 4), ("Serving", "t3", 4))
    [event] = engine_events(seen(lost), back)
    assert (event.type, event.reason) == ("Normal", "EngineRejoined")
    assert "engine-1 rejoined at t3, serving weight version 4" in event.message
    assert engine_events(seen(back), back) == []


def test_a_new_attempts_first_report_gets_no_event() -> None:
    before = report(("Serving", "t0", 3), ("Lost", "t1", None))
    assert engine_events(seen(before), report(("Serving", "t5", 3), ("Serving", "t5", 3),
                                              attempt=1)) == []


def test_a_loss_between_two_reports_shows_as_a_rejoin() -> None:
    before = report(("Serving", "t0", 3), ("Serving", "t0", 3), restarts=0)
    [event] = engine_events(seen(before), report(("Serving", "t0", 5), ("Serving", "t4", 5)))
    assert event.reason == "EngineRejoined"


def test_a_new_driver_of_the_same_attempt_starts_its_engines_without_events() -> None:
    """After a suspension the attempt number stays, and the new runtime's engines all start
    Serving at a later time with no restarts: nothing was lost or rejoined."""
    before = report(("Serving", "t0", 3), ("Serving", "t0", 3))
    after = report(("Serving", "t9", 3), ("Serving", "t9", 3), restarts=0)
    assert engine_events(seen(before), after) == []


def test_the_only_engine_lost_says_generation_pauses() -> None:
    first = report(("Serving", "t0", 3))
    [event] = engine_events(seen(first), report(("Lost", "t1", None)))
    assert "engine-0 lost at t1" in event.message and "generation pauses" in event.message
    assert "0/1 engines" not in event.message


def test_a_loss_whose_lost_report_was_overwritten_still_gets_its_event() -> None:
    """The runtime's reports coalesce: the operator may read Serving, then Rejoining with one
    more restart, and never Lost."""
    before = report(("Serving", "t0", 3), ("Serving", "t0", 3), restarts=0)
    rejoining = report(("Serving", "t0", 3), ("Rejoining", "t2", None))
    [event] = engine_events(seen(before), rejoining)
    assert (event.type, event.reason) == ("Warning", "EngineLost")
    assert event.message.startswith("engine-1 lost: Ray lost its process; the job goes on")
    [event] = engine_events(seen(rejoining), report(("Serving", "t0", 4), ("Serving", "t3", 4)))
    assert event.reason == "EngineRejoined"
