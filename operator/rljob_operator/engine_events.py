"""Events for the rollout engines the runtime reports in `status.engines`: which engine was
lost, why and when, and when it rejoined with which weight version. The runtime replaces
engines without a restart of the job, so these Events are where `kubectl describe` tells
that story. The operator remembers the last report it saw of each job; one it sees for the
first time (a new operator) or one of another attempt (each attempt starts its engines
afresh) is taken as it is, without Events."""

from __future__ import annotations

from typing import Any

from rljob_api.status import EngineState
from rljob_operator.decision import Event

# The attempt that reported, and engine name → (state, since, restarts), as last seen.
Seen = tuple[Any, dict[str, tuple[str, str, int]]]


def seen(engines: dict[str, Any] | None) -> Seen:
    """What `status.engines` says of each engine, to compare the next report against."""
    report = engines or {}
    return report.get("attempt"), {
        str(e.get("name")): (str(e.get("state")), str(e.get("since")), _restarts(e))
        for e in report.get("engines") or []}


def _restarts(engine: dict[str, Any]) -> int:
    value = engine.get("restarts")
    return value if isinstance(value, int) else 0


def engine_events(before: Seen | None, engines: dict[str, Any] | None) -> list[Event]:
    """The Events of the changes between the report last seen (`before`, None when none
    was) and `engines` (`status.engines` now)."""
    if before is None or not engines or before[0] != engines.get("attempt"):
        return []
    last = before[1]
    events = []
    for e in engines.get("engines") or []:
        name, state, since = str(e.get("name")), str(e.get("state")), str(e.get("since"))
        was = last.get(name)
        if was is not None and was[:2] == (state, since):
            continue
        missed = state == EngineState.rejoining.value and was is not None and (
            was[0] == EngineState.serving.value or _restarts(e) > was[2])
        if state == EngineState.lost.value or missed:
            # A loss whose Lost report was overwritten before this operator read it (the
            # runtime's reports coalesce) shows as Rejoining with more restarts.
            left = (f"the job goes on with {engines.get('ready')}/{engines.get('total')} "
                    "engines" if engines.get("ready") else "generation pauses")
            when = "" if missed else f" at {since}"
            events.append(Event("Warning", "EngineLost", (
                f"{name} lost{when}: {e.get('reason') or 'no reason given'}; {left} "
                "while it is started again")))
        elif state == EngineState.serving.value and was is not None and (
                was[0] != EngineState.serving.value or _restarts(e) > was[2]):
            # A loss between two reports shows only as more restarts. A new driver pod of
            # the same attempt (after a suspension) starts its engines afresh: a later
            # `since`, no more restarts, no Event.
            events.append(Event("Normal", "EngineRejoined", (
                f"{name} rejoined at {since}, serving weight version "
                f"{e.get('weightVersion')} (started again {e.get('restarts')} times in this "
                "attempt)")))
    return events
