"""Reading the test control plane's audit log: the one place that sees every request of a
client, exactly, with its verb, resource and user agent."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

Event = dict[str, Any]
# A watch is counted when its response starts, any other request when it completes.
WRITES = frozenset({"create", "update", "patch", "delete", "deletecollection"})


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def audit_requests(log: Path, start: datetime, end: datetime) -> list[Event]:
    """One audit event per request received in [start, end)."""
    out = []
    with log.open() as f:
        for line in f:
            event = json.loads(line)
            counted = "ResponseStarted" if event["verb"] == "watch" else "ResponseComplete"
            if event["stage"] == counted and \
                    start <= parse_time(event["requestReceivedTimestamp"]) < end:
                out.append(event)
    return out


def describe_request(event: Event) -> str:
    """`verb resource[/subresource]`, e.g. `patch rljobs/status`."""
    ref = event.get("objectRef") or {}
    resource = ref.get("resource", event.get("requestURI", "?"))
    if ref.get("subresource"):
        resource += "/" + ref["subresource"]
    return f"{event['verb']} {resource}"
