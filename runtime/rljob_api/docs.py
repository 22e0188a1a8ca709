"""Render the RLJob field reference (Markdown) from the API model.

Structure, types and bounds come from the same structural schema the CRD carries
(`rljob_api.crd`), defaults from a default-constructed `RLJobSpec`, so the table can only
say what the API server and `rljob validate` enforce. `docs/reference.md` is this output;
a unit test fails when the committed file is stale.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rljob_api import API_VERSION, KIND, SHORT_NAME
from rljob_api.crd import PRINTER_COLUMNS, spec_schema, status_schema
from rljob_api.deprecations import DEPRECATED_FIELDS, POLICY_FILE
from rljob_api.mutability import EFFECT_WORDS, FIELD_EFFECTS, Effect
from rljob_api.rules import (
    ADMISSION,
    OPERATOR,
    ROOT_RULES,
    RULES,
    RUNTIME,
    TRANSITION_RULES,
    VALIDATE,
    enforcement,
)
from rljob_api.sglang_releases import NEWEST_CHECKED, RELEASE, SUPPORTED_RANGE
from rljob_api.spec import RLJobSpec
from rljob_api.status import OPERATOR_FIELDS, RUNTIME_FIELDS

Schema = dict[str, Any]

DOCS_FILE = "docs/reference.md"
# docs/operator.md carries the field-effects table between these markers; `python -m
# rljob_api.docs` rewrites it (and docs/reference.md), a unit test fails when it is stale.
OPERATOR_DOC = "docs/operator.md"
EFFECTS_BEGIN = ("<!-- field-effects: generated from rljob_api.mutability by "
                 "`python -m rljob_api.docs`; do not edit by hand -->")
EFFECTS_END = "<!-- /field-effects -->"
HEADER = "<!-- Generated from the API model by `rljob docs --write`; do not edit by hand. -->\n"
NO_VALUE = "—"


@dataclass(frozen=True)
class Row:
    """One documented field."""

    path: str
    type: str
    default: str
    bounds: str
    description: str


def _cell(text: str) -> str:
    """Make text safe inside a Markdown table cell (pipes split cells, newlines end rows)."""
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: str) -> str:
    return f"`{value}`"


def _code_list(values: tuple[str, ...]) -> str:
    return ", ".join(_code(v) for v in values)


def _literal(value: Any) -> str:
    if isinstance(value, str):
        return _code(value)
    return _code(json.dumps(value, ensure_ascii=False))


def type_name(node: Schema) -> str:
    """A reader's name for a schema node's type: `integer`, `list of string`, `map of ...`."""
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = node.get("type", "any")
    if kind == "array":
        return f"list of {type_name(node.get('items', {}))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {type_name(node['additionalProperties'])}"
    if "enum" in node:
        return f"{kind} (enum)"
    return str(kind)


def bounds(node: Schema) -> str:
    """Every constraint on one node: enum values, numeric bounds, lengths, sizes, pattern."""
    parts: list[str] = []
    if "enum" in node:
        parts.append("one of " + ", ".join(_literal(v) for v in node["enum"]))
    for key, strict, weak in (("minimum", ">", "≥"), ("maximum", "<", "≤")):
        if key in node:
            exclusive = node.get("exclusiveM" + key[1:], False)
            parts.append(f"{strict if exclusive else weak} {node[key]}")
    lengths = [
        (node.get("minLength"), node.get("maxLength"), "chars"),
        (node.get("minItems"), node.get("maxItems"), "items"),
        (node.get("minProperties"), node.get("maxProperties"), "entries"),
    ]
    for low, high, unit in lengths:
        if low is not None and high is not None:
            parts.append(f"{low} to {high} {unit}")
        elif high is not None:
            parts.append(f"≤ {high} {unit}")
        elif low is not None:
            parts.append(f"≥ {low} {unit}")
    if "pattern" in node:
        parts.append("pattern " + _code(node["pattern"]))
    item = node.get("items") or node.get("additionalProperties")
    if isinstance(item, dict) and not item.get("properties"):
        inner = bounds(item)
        if inner:
            parts.append(f"each: {inner}")
    return "; ".join(parts)


def _default_at(defaults: Any, path: tuple[str, ...]) -> str:
    value = defaults
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return NO_VALUE
        value = value[part]
    if value is None or (isinstance(value, dict) and value):
        return NO_VALUE
    return _literal(value)


def walk(node: Schema, prefix: str, path: tuple[str, ...], defaults: Any) -> Iterator[Row]:
    """Rows for every property below `node`, depth first, in declaration order.

    `path` locates defaults in `defaults`; fields inside list items have none of their own.
    """
    for name, child in node.get("properties", {}).items():
        field_path = f"{prefix}.{name}"
        child_path = (*path, name)
        yield Row(
            path=field_path,
            type=type_name(child),
            default=_default_at(defaults, child_path) if "properties" not in child else NO_VALUE,
            bounds=bounds(child),
            description=child.get("description", ""),
        )
        if "properties" in child:
            yield from walk(child, field_path, child_path, defaults)
        items = child.get("items", {})
        if "properties" in items:
            yield from walk(items, f"{field_path}[]", ("[]",), None)


def _table(rows: Iterator[Row], with_default: bool) -> list[str]:
    if with_default:
        lines = [
            "| Field | Type | Default | Bounds / values | Description |",
            "| --- | --- | --- | --- | --- |",
        ]
    else:
        lines = ["| Field | Type | Values | Description |", "| --- | --- | --- | --- |"]
    for row in rows:
        cells = [_code(row.path), row.type]
        if with_default:
            cells.append(row.default)
        cells += [row.bounds or NO_VALUE, row.description]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def _where(at: tuple[str, ...]) -> str:
    return _code(".".join(("spec", *at)))


_PLACES = {
    ADMISSION: "API server (`kubectl apply`)",
    VALIDATE: "`rljob validate`",
    OPERATOR: "operator (before it builds anything)",
    RUNTIME: "`rljob run` / the driver",
}


def render_enforcement() -> list[str]:
    """Where each check made before any work is enforced, and why any is not at admission."""
    lines = [
        "| Check | " + " | ".join(_PLACES.values()) + " | Why not at admission |",
        "| --- | " + " | ".join("---" for _ in _PLACES) + " | --- |",
    ]
    for entry in enforcement():
        marks = ["yes" if place in entry.where else NO_VALUE for place in _PLACES]
        lines.append("| " + " | ".join(_cell(c) for c in (
            entry.check, *marks, entry.why_not_admission or NO_VALUE)) + " |")
    return lines


_EFFECT_CELL = {
    Effect.immutable: "refused",
    Effect.operator: "applies at once",
    Effect.restart: "driver restarts",
    Effect.compute: "RayCluster patched, then driver restarts",
}


def render_field_effects() -> str:
    """What editing each spec field of an existing job does, one row per table entry."""
    lines = [
        "| Field | On a running job | Why / what happens |",
        "| --- | --- | --- |",
    ]
    for entry in FIELD_EFFECTS:
        narrower = any(e.path.startswith(entry.path + ".") for e in FIELD_EFFECTS)
        field = _code(f"spec.{entry.path}") + (" (its other fields)" if narrower else "")
        why = entry.why[0].upper() + entry.why[1:]
        lines.append("| " + " | ".join(_cell(c) for c in (
            field, _EFFECT_CELL[Effect(entry.effect)], why)) + " |")
    lines += ["", "Effects: " + "; ".join(
        f"*{_EFFECT_CELL[e]}*: {EFFECT_WORDS[e]}" for e in Effect) + "."]
    return "\n".join(lines) + "\n"


def with_field_effects(doc: str) -> str:
    """`doc` (docs/operator.md) with the generated table between its markers."""
    head, begin, rest = doc.partition(EFFECTS_BEGIN)
    _, end, tail = rest.partition(EFFECTS_END)
    if not begin or not end:
        raise ValueError(f"{OPERATOR_DOC} lacks the field-effects markers")
    return f"{head}{EFFECTS_BEGIN}\n{render_field_effects()}{EFFECTS_END}{tail}"


def render_reference() -> str:
    """The whole reference page, as committed at `docs/reference.md`."""
    defaults = RLJobSpec.model_validate({}).model_dump(by_alias=True, mode="json")
    lines = [
        HEADER.rstrip("\n"),
        "",
        f"# {KIND} reference (`{API_VERSION}`)",
        "",
        f"`kind: {KIND}`, short name `{SHORT_NAME}`. Every field is optional; a missing field "
        "takes its default, which the API server fills in at `kubectl apply` and `rljob run` "
        "fills in locally. Unknown fields are rejected by `kubectl apply` (strict field "
        "validation) and by `rljob validate`.",
        "",
        "## spec",
        "",
        *_table(walk(spec_schema(), "spec", (), defaults), with_default=True),
        "",
        "## Cross-field rules",
        "",
        "Checked by the API server (CEL) at `kubectl apply` and by `rljob validate` / "
        "`rljob run` before any work; the message is what you see. Rules on `metadata.name` "
        "apply to `self` (the whole RLJob), the only place the API server lets CEL read it.",
        "",
        "| Applies to | Rule | Message |",
        "| --- | --- | --- |",
    ]
    for rule in (*ROOT_RULES, *RULES):
        where = _code("metadata.name") if rule in ROOT_RULES else _where(rule.at)
        lines.append(
            "| "
            + " | ".join(_cell(c) for c in (where, _code(rule.cel), rule.message))
            + " |"
        )
    for trule in TRANSITION_RULES:
        lines.append(
            "| "
            + " | ".join(_cell(c) for c in (_where(trule.at), _code(trule.cel), trule.message))
            + " |"
        )
    lines += [
        "",
        "## Deprecated fields",
        "",
        "Still accepted, with the meaning they had. The API server answers `kubectl apply` "
        "(create or update) of a job that sets one with a warning (a ValidatingAdmissionPolicy "
        f"whose binding only warns, `{POLICY_FILE}`, installed with the CRD and by the Helm "
        "chart on Kubernetes 1.30 and later), and `rljob validate` and `rljob run` print the "
        "same one; the operator and the runtime read the replacement only.",
        "",
        "| Field | Warning |",
        "| --- | --- |",
        *(f"| {_cell(_code(d.field))} | {_cell(d.message)} |" for d in DEPRECATED_FIELDS),
        "",
        "## Where each check is enforced",
        "",
        "Every check made before a job does any work. A job the API server admits passes "
        "every check it can make, so the operator and the runtime fail it only for what the "
        "last column names (tests/apiserver/test_admission_parity.py checks this over "
        "generated specs).",
        "",
        *render_enforcement(),
        "",
        "## SGLang releases",
        "",
        f"`rollout.backend: sglang` supports SGLang {SUPPORTED_RANGE}. The rollout image is "
        f"built on {RELEASE}, whose own code reads every request rljob sends in the tests; "
        f"the routes, request types and weight-update code of {NEWEST_CHECKED} are read from "
        "its source too. At connect the runtime reads the engine's `version` "
        "(`GET /get_server_info`) and refuses a release outside the range, naming it and "
        "the range. What differs in "
        f"{NEWEST_CHECKED} (docs/weight-sync.md, *SGLang releases*, says more): "
        "`/get_weight_version` is gone (rljob reads `weight_version` from "
        "`/get_model_info`); `/get_model_info` and `/get_server_info` are kept as deprecated "
        "aliases of `/model_info` and `/server_info`, and rljob reads the old names, served "
        "by every supported release; `/release_memory_occupation` without tags also frees "
        "CUDA graphs and is refused while requests run.",
        "",
        "## Editing a running job",
        "",
        "Every field either takes effect on a running job or is refused by a transition rule "
        "above (docs/operator.md, \"Editing a running job\", says how).",
        "",
        render_field_effects().rstrip("\n"),
        "",
        "## status",
        "",
        f"Written by the operator ({_code_list(OPERATOR_FIELDS)}) and by the job's runtime "
        f"({_code_list(RUNTIME_FIELDS)}). Read it with `kubectl get rljob NAME -o yaml`.",
        "",
        *_table(walk(status_schema(), "status", (), None), with_default=False),
        "",
        "## `kubectl get rljobs` columns",
        "",
        "| Column | From | Meaning |",
        "| --- | --- | --- |",
    ]
    for column in PRINTER_COLUMNS:
        lines.append(
            "| "
            + " | ".join(
                _cell(c)
                for c in (
                    column["name"],
                    _code(column["jsonPath"]),
                    column.get("description", "Time since the job was created."),
                )
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    # `python -m rljob_api.docs`: rewrite the generated docs (run from the repository root).
    from pathlib import Path

    Path(DOCS_FILE).write_text(render_reference())
    Path(OPERATOR_DOC).write_text(with_field_effects(Path(OPERATOR_DOC).read_text()))
    print(f"wrote {DOCS_FILE} and the field-effects table of {OPERATOR_DOC}")
