"""Generate the RLJob CustomResourceDefinition from the API model.

pydantic's JSON Schema is close to, but not, a Kubernetes structural schema: references are
inlined, `Optional` unions collapse to their type, `int | str` becomes int-or-string,
exclusive bounds switch to the OpenAPI v3.0 boolean form, and nested spec objects get
their full default value so the API server fills them too. Cross-field rules come from
`rljob_api.rules`.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from rljob_api import GROUP, KIND, PLURAL, SHORT_NAME, SINGULAR, VERSION
from rljob_api.deprecations import build_policy
from rljob_api.rules import ROOT_RULES, RULES, TRANSITION_RULES
from rljob_api.spec import RLJobSpec
from rljob_api.status import RLJobStatus

Schema = dict[str, Any]

CRD_FILE = "crds/rljob.io_rljobs.yaml"
# Helm cannot read files outside a chart, so the chart carries a byte copy (a test checks it).
CHART_CRD_FILE = "charts/rljob-operator/files/rljob.io_rljobs.yaml"
HEADER = "# Generated from the API model by `rljob crd --write`; do not edit by hand.\n"

PRINTER_COLUMNS: list[Schema] = [
    {
        "name": "PHASE",
        "type": "string",
        "jsonPath": ".status.phase",
        "description": "Lifecycle phase.",
    },
    {
        "name": "STEP",
        "type": "integer",
        "jsonPath": ".status.progress.rolloutStep",
        "description": "Rollout steps completed.",
    },
    {
        "name": "REWARD",
        "type": "number",
        "jsonPath": ".status.progress.meanReward",
        "description": "Mean reward of the last rollout step.",
    },
    {
        "name": "CHECKPOINT",
        "type": "integer",
        "jsonPath": ".status.checkpoint.step",
        "description": "Step of the latest verified checkpoint.",
    },
    {
        "name": "RESTARTS",
        "type": "integer",
        "jsonPath": ".status.recovery.restarts",
        "description": "Restarts after failures.",
    },
    {
        "name": "ENGINES",
        "type": "string",
        "jsonPath": ".status.engines.summary",
        "description": "Rollout engines serving / engines the job runs.",
        "priority": 1,
    },
    {"name": "AGE", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROP = {"title", "$defs"}


def _resolve(node: Any, defs: Schema) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return _resolve({**target, **rest}, defs)
    return {k: _resolve(v, defs) for k, v in node.items() if k not in _DROP}


def _structural(node: Schema) -> Schema:
    """Rewrite one resolved JSON Schema node (and its children) into structural form."""
    node = dict(node)
    variants = node.pop("anyOf", None)
    if variants is not None:
        real = [v for v in variants if v.get("type") != "null"]
        types = sorted(v.get("type", "") for v in real)
        if types == ["integer", "string"]:
            node["x-kubernetes-int-or-string"] = True
            # The string's pattern applies to the string form only, as in Kubernetes' own
            # int-or-string quantities; without it any string would be admitted.
            for v in real:
                node.update({k: v[k] for k in ("pattern", "maxLength") if k in v})
        elif len(real) == 1:
            node = {**real[0], **node}
        else:
            raise ValueError(f"cannot express union {variants} in a structural schema")
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    for key, flag in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if key in node and not isinstance(node[key], bool):
            node[flag] = node.pop(key)
            node[key] = True
    if node.get("default", 0) is None:
        del node["default"]
    if "properties" in node:
        node["properties"] = {k: _structural(v) for k, v in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"])
    if "items" in node:
        node["items"] = _structural(node["items"])
    return node


def _default_nested_objects(node: Schema, defaults: Schema) -> None:
    """Give optional nested objects their full default value, so an omitted section is
    defaulted by the API server and its validation rules see every field."""
    required = set(node.get("required", []))
    for name, prop in node.get("properties", {}).items():
        if prop.get("type") == "object" and "properties" in prop:
            sub = defaults.get(name) or {}
            if name not in required and "default" not in prop:
                prop["default"] = sub
            _default_nested_objects(prop, sub)


def _strip_defaults(node: Any) -> None:
    if isinstance(node, dict):
        node.pop("default", None)
        for v in node.values():
            _strip_defaults(v)
    elif isinstance(node, list):
        for v in node:
            _strip_defaults(v)


def _schema_of(model: type[RLJobSpec] | type[RLJobStatus]) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(_resolve(raw, raw.get("$defs", {})))


def _at(schema: Schema, path: tuple[str, ...]) -> Schema:
    for part in path:
        schema = schema["properties"][part]
    return schema


def spec_schema() -> Schema:
    """The structural schema of `spec`, with defaults and every validation rule."""
    schema = _schema_of(RLJobSpec)
    _default_nested_objects(
        schema, RLJobSpec().model_dump(by_alias=True, mode="json", exclude_none=True)
    )
    for rule in RULES:
        entry: Schema = {"rule": rule.cel, "message": rule.message}
        if rule.field_path:
            entry["fieldPath"] = rule.field_path
        _at(schema, rule.at).setdefault("x-kubernetes-validations", []).append(entry)
    for trule in TRANSITION_RULES:
        _at(schema, trule.at).setdefault("x-kubernetes-validations", []).append(
            {"rule": trule.cel, "message": trule.message}
        )
    return schema


def status_schema() -> Schema:
    """The structural schema of `status`; no defaults, status is only what was reported."""
    schema = _schema_of(RLJobStatus)
    _strip_defaults(schema)
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return schema


def build_crd() -> Schema:
    """The full CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": [SHORT_NAME],
                "categories": ["rljob"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "RLJob runs RL post-training (trainer + rollout "
                            "engines on Ray) and reports its progress.",
                            "required": ["spec"],
                            "x-kubernetes-validations": [
                                {"rule": rule.cel, "message": rule.message}
                                for rule in ROOT_RULES
                            ],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd() -> str:
    """The CRD as the YAML text committed at `crds/rljob.io_rljobs.yaml`."""
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=100, allow_unicode=True)


def render_policy() -> str:
    """The deprecation-warning admission policy and its binding (`rljob_api.deprecations`), as
    the YAML text committed at `crds/rljob.io_rljobs_deprecations.yaml` beside the CRD."""
    return HEADER + yaml.safe_dump_all(build_policy(), sort_keys=False, width=100,
                                       allow_unicode=True)
