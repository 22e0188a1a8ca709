"""Validate RLJob manifests in Python with the API server's rules, reporting every problem.

`rljob validate` and `rljob run` use this so a bad job fails before any work, with the same
messages `kubectl apply` would give.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rljob_api import API_VERSION, KIND
from rljob_api.rules import ROOT_RULES, RULES, TRANSITION_RULES
from rljob_api.spec import RLJobSpec

Obj = dict[str, Any]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a manifest: where, and what to do about it."""

    field: str
    message: str

    def __str__(self) -> str:
        # Rule messages already start with the field they are about.
        if self.message.startswith(("spec", self.field)):
            return self.message
        return f"{self.field}: {self.message}"


class InvalidJob(Exception):
    """A manifest that breaks at least one rule; carries every problem found."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")


def _loc(loc: tuple[int | str, ...]) -> str:
    out = "spec"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _defaulted(raw: Any, defaults: Any) -> Any:
    """User values laid over the model's defaults: the object CEL sees after defaulting."""
    if isinstance(raw, dict) and isinstance(defaults, dict):
        merged = dict(defaults)
        for key, value in raw.items():
            merged[key] = _defaulted(value, defaults.get(key))
        return merged
    return raw


def _dig(obj: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        obj = obj[part]
    return obj


_DEFAULT_SPEC: Obj = RLJobSpec().model_dump(by_alias=True, mode="json")


# Renamed fields: the old path (below `spec`) and the field that takes its place, so a
# manifest that still sets the old one is told where it goes.
MOVED_FIELDS: dict[tuple[str, ...], str] = {
    ("data", "evalDataset"): "spec.eval.dataset",
    ("data", "evalInterval"): "spec.eval.interval",
}


# pydantic error types whose Kubernetes counterpart is an "Invalid value" (a bound or a
# pattern): the API server still evaluates every CEL rule of an object with such an error.
# Every other schema error (a wrong type, an enum value not supported, a string, list or map
# too long, a missing field) is "blocking": the API server then evaluates no CEL rule at all
# (apiextensions-apiserver, customresource strategy's hasBlockingErr). An unknown field is
# refused before any validation (strict field validation); the rest is still reported here,
# as the API server reports it once that field is gone.
_NON_BLOCKING = frozenset({
    "greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of",
    "string_pattern_mismatch", "string_too_short", "too_short", "extra_forbidden",
})


def _schema_errors(spec: Obj) -> tuple[list[Problem], bool]:
    """Type and value problems, found as the API server finds them: strictly, on the JSON the
    manifest becomes (the string "16" is no integer there, so it is none here either); and
    whether one of them keeps the API server from evaluating the cross-field rules."""
    try:
        RLJobSpec.model_validate_json(json.dumps(spec, default=str), strict=True)
    except ValidationError as err:
        found, blocking = [], False
        for e in _one_per_union(err.errors(include_url=False)):
            msg = e["msg"]
            if e["type"] == "extra_forbidden":
                moved = MOVED_FIELDS.get(tuple(str(part) for part in e["loc"]))
                msg = (f"moved to {moved}; set it there" if moved else
                       "unknown field; remove it or check its spelling (see docs/reference.md)")
            elif "input" in e and not isinstance(e["input"], dict | list):
                msg = f"{msg} (got {e['input']!r})"
            blocking = blocking or e["type"] not in _NON_BLOCKING
            found.append(Problem(_loc(e["loc"]), msg))
        return found, blocking
    return [], False


# How pydantic names the branches of a union in an error's location (`int | str` quantities).
_UNION_BRANCHES = frozenset({"int", "str", "constrained-str"})


def _one_per_union(errors: list[Any]) -> list[Any]:
    """An `int | str` field's value matches neither branch: pydantic reports one error per
    branch, the API server one (the string's pattern or length, or the wrong type). Keep the
    string branch's error where the value is a string, the integer's where it is not, at
    the field's own location."""
    kept: dict[tuple[Any, ...], Any] = {}
    out: list[Any] = []
    for e in errors:
        loc = tuple(e["loc"])
        if not any(part in _UNION_BRANCHES for part in loc):
            out.append(e)
            continue
        field = tuple(part for part in loc if part not in _UNION_BRANCHES)
        wants_str = isinstance(e.get("input"), str)
        on_str = any(part in ("str", "constrained-str") for part in loc)
        if field not in kept or wants_str == on_str:
            if field not in kept:
                out.append(field)  # a placeholder, filled below
            kept[field] = {**e, "loc": field}
    return [kept[e] if isinstance(e, tuple) else e for e in out]


def _without_nulls(value: Any) -> Any:
    """`value` with every null field left out, as the API server stores it (it drops a null
    it is sent for a field that is not nullable, and no RLJob field is), so a null section
    takes its default there and here alike."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def spec_problems(spec: Any) -> list[Problem]:
    """Every schema and cross-field problem of one `spec` object, as the API server finds it.

    Like the API server, the cross-field rules are not evaluated at all once a field has the
    wrong type, an unsupported enum value or is too long (they would judge a value that is not
    one), and are all evaluated next to a value out of its bounds; a rule that cannot be
    evaluated (a modulus by zero) is reported at its object, as the API server reports it.
    """
    return _spec_problems(spec)[0]


def _spec_problems(spec: Any) -> tuple[list[Problem], bool]:
    """spec_problems, and whether a schema error kept the cross-field rules from running."""
    if not isinstance(spec, dict):
        return [Problem("spec", "must be a mapping of RLJob fields (see docs/reference.md)")], True
    spec = _without_nulls(spec)
    problems, blocked = _schema_errors(spec)
    if blocked:
        return problems, True
    view = _defaulted(spec, _DEFAULT_SPEC)
    for rule in RULES:
        try:
            holds = rule.check(_dig(view, rule.at))
        except (KeyError, TypeError, ZeroDivisionError, AttributeError):
            problems.append(Problem(_loc(rule.at), rule.message))
            continue
        if not holds:
            problems.append(Problem(_loc(rule.at) + (rule.field_path or ""), rule.message))
    return problems, False


def update_problems(old_spec: Obj, new_spec: Obj) -> list[Problem]:
    """Problems of changing a running job's spec from `old_spec` to `new_spec`."""
    old = _defaulted(old_spec, _DEFAULT_SPEC)
    new = _defaulted(new_spec, _DEFAULT_SPEC)
    return [
        Problem(_loc(t.at), t.message)
        for t in TRANSITION_RULES
        if not t.check(_dig(old, t.at), _dig(new, t.at))
    ]


def manifest_problems(doc: Any) -> list[Problem]:
    """Every problem of one RLJob manifest (apiVersion, kind, metadata.name and spec)."""
    if not isinstance(doc, dict):
        return [Problem("(document)", "must be a mapping with apiVersion, kind, metadata, spec")]
    problems: list[Problem] = []
    if doc.get("apiVersion") != API_VERSION:
        problems.append(
            Problem("apiVersion", f"must be {API_VERSION} (got {doc.get('apiVersion')!r})")
        )
    if doc.get("kind") != KIND:
        problems.append(Problem("kind", f"must be {KIND} (got {doc.get('kind')!r})"))
    unknown = sorted(set(doc) - {"apiVersion", "kind", "metadata", "spec", "status"})
    problems += [Problem(k, "unknown top-level field; remove it") for k in unknown]
    blocked = False
    if "spec" not in doc:
        problems.append(Problem("spec", "is required"))
    else:
        found, blocked = _spec_problems(doc["spec"])
        problems += found
    # The API server evaluates the name's rules only where it evaluates the spec's.
    return [*name_problems(doc.get("metadata"), rules=not blocked),
            *(queue_problems(doc.get("metadata"), doc.get("spec"))
              or queue_name_problems(doc.get("metadata"), doc.get("spec"))), *problems]


# Kueue's label naming the LocalQueue a job waits in.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def _queues(meta: Any, spec: Any) -> tuple[Any, Any]:
    """The queue a manifest names in its label and in its field (either may be None)."""
    labels = meta.get("labels") if isinstance(meta, dict) else None
    sched = spec.get("scheduling") if isinstance(spec, dict) else None
    return (labels.get(QUEUE_LABEL) if isinstance(labels, dict) else None,
            sched.get("queue") if isinstance(sched, dict) else None)


def queue_name(meta: Any, spec: Any) -> str | None:
    """The Kueue LocalQueue a job waits in: its `kueue.x-k8s.io/queue-name` label, else
    `spec.scheduling.queue` (None: not queued)."""
    label, field = _queues(meta, spec)
    return str(label or field) if (label or field) else None


def queue_problems(meta: Any, spec: Any) -> list[Problem]:
    """The label and the field name one queue, when both are set."""
    label, field = _queues(meta, spec)
    if label and field and label != field:
        return [Problem("spec.scheduling.queue",
                        f"is {field!r} but the label {QUEUE_LABEL} is {label!r}: name one "
                        "LocalQueue (drop one of them or make them equal)")]
    return []


def queue_name_problems(meta: Any, spec: Any) -> list[Problem]:
    """A queue name Kueue takes: its Workload's `spec.queueName` is a DNS-1123 subdomain,
    and any other name is refused there. `rljob validate` refuses it; the operator queues no
    Workload for it (with `--kueue`: the job waits, saying why) and never fails a job for
    it (without `--kueue` the name means nothing to it)."""
    label, field = _queues(meta, spec)
    where = f"metadata.labels[{QUEUE_LABEL}]" if label else "spec.scheduling.queue"
    name = label or field
    if name and (not isinstance(name, str) or len(name) > 253
                 or not re.fullmatch(_DNS_1123_SUBDOMAIN, name)):
        return [Problem(where, f"is {name!r}, which is no LocalQueue name: use lower-case "
                        "letters, digits, '-' and '.' (a DNS-1123 subdomain), as the "
                        "LocalQueue's own name is")]
    return []


_DNS_1123_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"


def name_problems(meta: Any, rules: bool = True) -> list[Problem]:
    """Problems of a job's `metadata.name`: the root rules the API server checks at admission
    (rules.ROOT_RULES), which the operator checks again before it builds anything."""
    name = meta.get("name") if isinstance(meta, dict) else None
    if not name:
        return [Problem("metadata.name", "is required: give the job a name")]
    if not isinstance(name, str):
        return [Problem("metadata.name", f"must be a string (got {name!r})")]
    problems = []
    if len(name) > 253 or not re.fullmatch(_DNS_1123_SUBDOMAIN, name):
        # The API server's own check of every object's name, before any rule of ours.
        problems.append(Problem("metadata.name", "must be a lowercase RFC 1123 subdomain "
                                "(lower-case letters, digits, '-' and '.', at most 253)"))
    return problems + [Problem("metadata.name", rule.message) for rule in ROOT_RULES
                       if rules and not rule.check({"metadata": {"name": name}})]


def load_job(path: str | Path) -> tuple[Obj, RLJobSpec]:
    """Read and validate one RLJob file; raise InvalidJob listing every problem."""
    source = str(path)
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except OSError as err:
        raise InvalidJob(source, [Problem("(file)", f"cannot read: {err.strerror}")]) from None
    except yaml.YAMLError as err:
        raise InvalidJob(source, [Problem("(file)", f"not valid YAML: {err}")]) from None
    if len(docs) != 1:
        raise InvalidJob(
            source, [Problem("(file)", f"must hold exactly one RLJob, found {len(docs)} documents")]
        )
    problems = manifest_problems(docs[0])
    if problems:
        raise InvalidJob(source, problems)
    return docs[0], RLJobSpec.model_validate(docs[0]["spec"])
