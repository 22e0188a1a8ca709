"""Chart checks that need no binary: the CRD copy and values.schema.json."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import yaml

from rljob_api.crd import CRD_FILE, render_crd, render_policy
from rljob_api.deprecations import CHART_POLICY_FILE, POLICY_FILE
from tests.chart.helm import CHART, CHART_CRD, REPO

pytestmark = pytest.mark.unit

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())


def test_chart_crd_is_the_generated_crd() -> None:
    """One source: the chart ships a byte copy of crds/, which is generated from the model."""
    source = (REPO / CRD_FILE).read_text()
    assert source == render_crd(), "crds/ is stale: run `rljob crd --write`"
    assert CHART_CRD.read_text() == source, (
        f"{CHART_CRD.relative_to(REPO)} differs from {CRD_FILE}: run `rljob crd --write`")


def test_chart_policy_is_the_generated_policy() -> None:
    """The deprecation-warning admission policy ships the same way: generated into crds/,
    copied byte for byte into the chart."""
    source = (REPO / POLICY_FILE).read_text()
    assert source == render_policy(), f"{POLICY_FILE} is stale: run `rljob crd --write`"
    assert (REPO / CHART_POLICY_FILE).read_text() == source, (
        f"{CHART_POLICY_FILE} differs from {POLICY_FILE}: run `rljob crd --write`")


def test_default_values_satisfy_the_schema() -> None:
    jsonschema.validate(VALUES, SCHEMA)


def test_schema_refuses_unknown_top_level_keys() -> None:
    assert SCHEMA["additionalProperties"] is False
    assert set(SCHEMA["properties"]) >= set(VALUES), "every default value is described"


def _with(path: str, value: Any) -> dict[str, Any]:
    values: dict[str, Any] = json.loads(json.dumps(VALUES))
    *parents, leaf = path.split(".")
    node = values
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return values


BAD_VALUES = [
    ("replicas", 2, "'replicas'"),
    ("image.tag", "latest", "does not match"),
    ("image.digest", "sha256:abc", "does not match"),
    ("replicaCount", 0, "1 was expected"),
    ("replicaCount", 2, "1 was expected"),
    ("podDisruptionBudget", {"minAvailable": 1}, "'podDisruptionBudget'"),
    ("rbac.scope", "cluster-wide", "is not one of"),
    ("metrics.port", 80, "minimum"),
    ("resources.requests.cpu", "lots", "does not match"),
    ("operator.workers", 0, "minimum"),
    ("operator.interval", 0, "less than or equal to the minimum"),
    ("crds.install", "yes", "is not of type 'boolean'"),
    ("metrics.serviceMonitor.interval", "30", "does not match"),
    ("watchNamespace", "Team_A", "does not match"),
]


@pytest.mark.parametrize(("path", "value", "expected"), BAD_VALUES, ids=lambda v: str(v))
def test_schema_rejects_bad_values(path: str, value: Any, expected: str) -> None:
    errors = list(jsonschema.Draft7Validator(SCHEMA).iter_errors(_with(path, value)))
    assert errors, f"{path}={value!r} was accepted"
    messages = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
    leaf_parent = path.rsplit(".", 1)[0] if "." in path else ""
    assert any(expected in m and m.startswith(leaf_parent) for m in messages), messages
