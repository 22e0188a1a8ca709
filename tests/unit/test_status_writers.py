"""Every status field has exactly one writer, and both writers stamp times alike."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from rljob_api.status import (
    OPERATOR_FIELDS,
    RUNTIME_CARRIED_FIELDS,
    RUNTIME_FIELDS,
    RLJobStatus,
    parse_timestamp,
    timestamp,
)

pytestmark = pytest.mark.unit


def test_operator_and_runtime_fields_split_the_status() -> None:
    fields = {f.alias for f in RLJobStatus.model_fields.values()}
    assert set(OPERATOR_FIELDS) | set(RUNTIME_FIELDS) == fields
    assert not set(OPERATOR_FIELDS) & set(RUNTIME_FIELDS)
    assert set(RUNTIME_CARRIED_FIELDS) < set(RUNTIME_FIELDS)


def test_timestamps_are_utc_seconds_and_read_back() -> None:
    t = datetime(2026, 1, 2, 5, 4, 5, 999, tzinfo=timezone(timedelta(hours=2)))
    assert timestamp(t) == "2026-01-02T03:04:05Z"
    assert parse_timestamp(timestamp(t)) == t.replace(microsecond=0)
    assert parse_timestamp("2026-01-02T03:04:05") == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_timestamp("") is None and parse_timestamp("yesterday") is None
