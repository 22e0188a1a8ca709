"""The field reference in docs/ is generated from the API model and must stay in step with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rljob.cli.main import main
from rljob_api.crd import spec_schema, status_schema
from rljob_api.docs import DOCS_FILE, bounds, render_reference, type_name, walk
from rljob_api.rules import RULES

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit


def _leaf_paths(node: dict[str, Any], prefix: str) -> set[str]:
    paths: set[str] = set()
    for name, child in node.get("properties", {}).items():
        paths.add(f"{prefix}.{name}")
        paths |= _leaf_paths(child, f"{prefix}.{name}")
        paths |= _leaf_paths(child.get("items", {}), f"{prefix}.{name}[]")
    return paths


def test_committed_reference_matches_the_model() -> None:
    committed = (REPO / DOCS_FILE).read_text()
    assert committed == render_reference(), "docs/reference.md is stale: run `rljob docs --write`"


def test_every_spec_and_status_field_has_a_row() -> None:
    text = render_reference()
    expected = _leaf_paths(spec_schema(), "spec") | _leaf_paths(status_schema(), "status")
    missing = sorted(p for p in expected if f"| `{p}` |" not in text)
    assert not missing, f"fields without a row: {missing}"


def test_rows_carry_type_default_bounds_and_description() -> None:
    defaults = {"trainer": {"replicas": 1}}
    schema = spec_schema()
    rows = {r.path: r for r in walk(schema, "spec", (), defaults)}
    replicas = rows["spec.trainer.replicas"]
    assert (replicas.type, replicas.default, replicas.bounds) == ("integer", "`1`", "≥ 1; ≤ 4096")
    assert replicas.description == "Trainer pods."
    assert rows["spec.trainer.image"].default == "—", "defaults come from the given spec only"
    assert rows["spec.scheduling.tolerations[].effect"].bounds.startswith("one of `NoSchedule`")


def test_exclusive_bounds_and_item_bounds() -> None:
    assert bounds({"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1}) == (
        "> 0; ≤ 1")
    assert bounds({"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 9}}) \
        == "≤ 4 items; each: ≤ 9 chars"
    assert type_name({"type": "object", "additionalProperties": {"type": "array",
                                                                "items": {"type": "integer"}}}) \
        == "map of list of integer"
    assert type_name({"x-kubernetes-int-or-string": True}) == "integer or string"


def test_real_defaults_and_escaped_pipes() -> None:
    text = render_reference()
    row = next(line for line in text.splitlines() if line.startswith("| `spec.recovery.retryOn`"))
    assert '`["PodFailed", "PodDeleted"' in row, "default_factory defaults are rendered"
    pattern_row = next(line for line in text.splitlines()
                       if line.startswith("| `spec.reward.function`"))
    assert pattern_row.count(" | ") == 4, "a `|` inside a pattern must not split the cell"
    for rule in RULES:
        assert rule.message.replace("|", "\\|") in text


def test_cli_docs_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "ref.md"
    assert main(["docs", "--write", str(target)]) == 0
    assert target.read_text() == render_reference()
    assert main(["docs"]) == 0
    assert capsys.readouterr().out.endswith(render_reference())


def test_operator_doc_carries_the_current_field_effects_table() -> None:
    from rljob_api.docs import OPERATOR_DOC, render_field_effects, with_field_effects

    committed = (REPO / OPERATOR_DOC).read_text()
    assert committed == with_field_effects(committed), (
        f"the field-effects table in {OPERATOR_DOC} is stale: run `python -m rljob_api.docs`")
    table = render_field_effects()
    assert "| `spec.trainer.image` | RayCluster patched, then driver restarts |" in table
    assert "| `spec.model` | refused |" in table and "| `spec.recovery` | applies at once |" \
        in table
