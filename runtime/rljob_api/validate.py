"""Validate RLJob manifests in Python with the API server's rules, reporting every problem.

`rljob validate` and `rljob run` use this so a bad job fails before any work, with the same
messages `kubectl apply` would give.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rljob_api import API_VERSION, KIND
from rljob_api.rules import RULES, TRANSITION_RULES
from rljob_api.spec import RLJobSpec

Obj = dict[str, Any]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a manifest: where, and what to do about it."""

    field: str
    message: str

    def __str__(self) -> str:
        # Rule messages already start with the field they are about.
        return self.message if self.message.startswith("spec") else f"{self.field}: {self.message}"


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


class _Reads(Mapping[str, Any]):
    """A read-only view of a spec object that records the field paths a rule consumes, so a
    rule can be skipped when it consumed a field that failed its own validation.

    A value is consumed when a leaf is read or an object is iterated; stepping through an
    object to one of its fields consumes only that field, so an unknown sibling field does
    not silence a rule."""

    def __init__(self, obj: dict[str, Any], at: tuple[str, ...], seen: set[tuple[str, ...]]):
        self._obj = obj
        self._at = at
        self._seen = seen

    def __getitem__(self, key: str) -> Any:
        path = (*self._at, key)
        value = self._obj[key]
        if isinstance(value, dict):
            return _Reads(value, path, self._seen)
        self._seen.add(path)
        return value

    def __iter__(self) -> Iterator[str]:
        self._seen.add(self._at)
        return iter(self._obj)

    def __len__(self) -> int:
        self._seen.add(self._at)
        return len(self._obj)


def _overlaps(read: tuple[str, ...], bad: tuple[str, ...]) -> bool:
    """True when one path lies within the other (a rule read the bad field or its parent)."""
    shorter = min(len(read), len(bad))
    return read[:shorter] == bad[:shorter]


# Renamed fields: the old path (below `spec`) and the field that takes its place, so a
# manifest that still sets the old one is told where it goes.
MOVED_FIELDS: dict[tuple[str, ...], str] = {
    ("data", "evalDataset"): "spec.eval.dataset",
    ("data", "evalInterval"): "spec.eval.interval",
}


def _schema_errors(spec: Obj) -> list[tuple[tuple[str, ...], Problem]]:
    """Type and value problems, found as the API server finds them: strictly, on the JSON the
    manifest becomes (the string "16" is no integer there, so it is none here either)."""
    try:
        RLJobSpec.model_validate_json(json.dumps(spec, default=str), strict=True)
    except ValidationError as err:
        found = []
        for e in err.errors(include_url=False):
            msg = e["msg"]
            if e["type"] == "extra_forbidden":
                moved = MOVED_FIELDS.get(tuple(str(part) for part in e["loc"]))
                msg = (f"moved to {moved}; set it there" if moved else
                       "unknown field; remove it or check its spelling (see docs/reference.md)")
            elif "input" in e and not isinstance(e["input"], dict | list):
                msg = f"{msg} (got {e['input']!r})"
            loc = tuple(str(part) for part in e["loc"])
            found.append((loc, Problem(_loc(e["loc"]), msg)))
        return found
    return []


def spec_problems(spec: Any) -> list[Problem]:
    """Every schema and cross-field problem of one `spec` object, one message per mistake.

    A cross-field rule that read a field which failed its own type or range check is not
    reported: it would judge a value the API server never accepts, and name a second
    "problem" for the same mistake.
    """
    if not isinstance(spec, dict):
        return [Problem("spec", "must be a mapping of RLJob fields (see docs/reference.md)")]
    errors = _schema_errors(spec)
    problems = [problem for _, problem in errors]
    bad = [loc for loc, _ in errors]
    view = _defaulted(spec, _DEFAULT_SPEC)
    for rule in RULES:
        seen: set[tuple[str, ...]] = set()
        try:
            target = _dig(view, rule.at)
            holds = rule.check(_Reads(target, rule.at, seen) if isinstance(target, dict)
                               else target)
        except (KeyError, TypeError, ZeroDivisionError, AttributeError):
            continue  # a type problem in an input, reported above
        if holds or any(_overlaps(read, loc) for read in seen for loc in bad):
            continue
        problems.append(Problem(_loc(rule.at) + (rule.field_path or ""), rule.message))
    return problems


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
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or not meta.get("name"):
        problems.append(Problem("metadata.name", "is required: give the job a name"))
    unknown = sorted(set(doc) - {"apiVersion", "kind", "metadata", "spec", "status"})
    problems += [Problem(k, "unknown top-level field; remove it") for k in unknown]
    if "spec" not in doc:
        problems.append(Problem("spec", "is required"))
    else:
        problems += spec_problems(doc["spec"])
    return problems


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
