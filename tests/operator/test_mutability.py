"""Every spec field has one documented effect on a running job (rljob_api.mutability), and
the builders honour it edit by edit: an `operator` edit changes nothing that was built, a
`restart` edit only the driver, a `compute` edit the RayCluster (and so the driver); an
immutable field has a transition rule, and a bad-update case in tests/specs.py."""

from __future__ import annotations

from typing import Any

import pytest

from rljob_api.crd import spec_schema
from rljob_api.mutability import FIELD_EFFECTS, Effect, effect_of
from rljob_api.rules import TRANSITION_RULES
from rljob_api.spec import RLJobSpec
from rljob_api.validate import spec_problems, update_problems
from rljob_operator.builders import JobRef, revisions
from tests.operator.edits import ELSEWHERE, Edit, edits
from tests.operator.harness import job_manifest
from tests.specs import BAD_UPDATES

pytestmark = pytest.mark.unit
JOB = JobRef("rl", "team-a", "uid-1")
EDITS = edits("pool-a", "high")


def _leaves(node: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for name, child in node.get("properties", {}).items():
        path = f"{prefix}.{name}" if prefix else name
        out |= _leaves(child, path) if "properties" in child else {path}
    return out


LEAVES = _leaves(spec_schema())


def test_every_field_has_exactly_one_effect_and_every_entry_a_field() -> None:
    for leaf in LEAVES:
        effect_of(leaf)  # raises for a field the table forgot
    for entry in FIELD_EFFECTS:
        assert any(leaf == entry.path or leaf.startswith(entry.path + ".") for leaf in LEAVES), \
            f"{entry.path} names no field of the spec"
    paths = [e.path for e in FIELD_EFFECTS]
    assert len(paths) == len(set(paths))


def test_every_mutable_field_is_edited_and_no_edit_touches_an_immutable_one() -> None:
    mutable = {leaf for leaf in LEAVES if effect_of(leaf).effect != Effect.immutable}
    edited = set().union(*(e.paths() for e in EDITS))
    assert mutable - ELSEWHERE <= edited, f"no edit for {sorted(mutable - ELSEWHERE - edited)}"
    assert all(effect_of(p).effect != Effect.immutable for p in edited)


def test_every_immutable_field_has_its_rule_and_a_shared_bad_update() -> None:
    immutable = [e for e in FIELD_EFFECTS if e.effect == Effect.immutable]
    messages = [r.message for r in TRANSITION_RULES]
    for entry in immutable:
        assert messages.count(entry.immutable_message()) == 1, entry.path
        assert entry.immutable_message().startswith(f"spec.{entry.path} is immutable")
    refused = {b.message for b in BAD_UPDATES}
    assert {e.immutable_message() for e in immutable} <= refused


def _cumulative() -> list[tuple[Edit, dict[str, Any], dict[str, Any]]]:
    spec = job_manifest("rl", "pool-a")["spec"]
    steps = []
    for edit in EDITS:
        after = edit.apply_to(spec)
        steps.append((edit, spec, after))
        spec = after
    return steps


@pytest.mark.parametrize(("edit", "before", "after"), _cumulative(),
                         ids=[e.id for e in EDITS])
def test_the_builders_take_each_edit_as_the_table_says(
        edit: Edit, before: dict[str, Any], after: dict[str, Any]) -> None:
    assert spec_problems(after) == [] and update_problems(before, after) == []
    old = revisions(JOB, RLJobSpec.model_validate(before))
    new = revisions(JOB, RLJobSpec.model_validate(after))
    if edit.effect == Effect.operator:
        assert new == old, "an edit the operator applies itself must rebuild nothing"
    elif edit.effect == Effect.restart:
        assert (new.cluster, new.templates) == (old.cluster, old.templates)
        assert new.driver != old.driver
    else:
        assert new.cluster != old.cluster and new.driver != old.driver
