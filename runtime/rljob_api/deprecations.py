"""Deprecated spec fields: still accepted, and warned about wherever a job is submitted.

One table, read by three places so they say the same words:
- the API server, through a ValidatingAdmissionPolicy whose binding only warns
  (`validationActions: [Warn]`): a CRD schema cannot warn about one field, an admission
  policy can, and `kubectl apply`/`create`/`edit` prints its message as `Warning: ...`.
  `build_policy` generates it into `crds/` beside the CRD (and the chart's copy);
- `rljob validate` and `rljob run`, which print the same message and go on
  (`deprecation_warnings`).
A deprecated field keeps its meaning until it is removed; the spec model turns it into its
replacement (`RolloutSpec`), so the operator and the runtime read only the new field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob_api import GROUP, PLURAL, VERSION


@dataclass(frozen=True)
class Deprecated:
    """A field below `spec` (camelCase path) that is still accepted, and what to use instead."""

    path: tuple[str, ...]
    instead: str

    @property
    def field(self) -> str:
        return "spec." + ".".join(self.path)

    @property
    def message(self) -> str:
        return (f"{self.field} is deprecated: use {self.instead} instead; a later API "
                f"version drops {self.path[-1]}")

    def set_in(self, spec: Any) -> bool:
        """Whether a manifest's `spec` sets the field (a null counts as unset, as the API server
        drops it)."""
        node = spec
        for part in self.path:
            if not isinstance(node, dict) or node.get(part) is None:
                return False
            node = node[part]
        return True

    def cel(self) -> str:
        """The policy's check on the admitted object: true (no warning) unless it sets the
        field. An update that leaves the spec as it was (the operator's finalizer, labels,
        annotations) is not warned about again."""
        has = " && ".join(f"has(object.spec.{'.'.join(self.path[: i + 1])})"
                          for i in range(len(self.path)))
        return (f"!(has(object.spec) && {has}) || "
                "(oldObject != null && has(oldObject.spec) && object.spec == oldObject.spec)")


DEPRECATED_FIELDS: tuple[Deprecated, ...] = (
    Deprecated(("rollout", "gpus"),
               "spec.rollout.engines (= gpus / gpusPerEngine)"),
)


def deprecation_warnings(doc: Any) -> list[str]:
    """The warnings the API server gives for an RLJob manifest, in the table's order."""
    spec = doc.get("spec") if isinstance(doc, dict) else None
    return [d.message for d in DEPRECATED_FIELDS if d.set_in(spec)]


POLICY_NAME = f"deprecated-fields.{PLURAL}.{GROUP}"
POLICY_FILE = f"crds/{GROUP}_{PLURAL}_deprecations.yaml"
# Helm cannot read files outside a chart, so the chart carries a byte copy (a test checks it).
CHART_POLICY_FILE = f"charts/rljob-operator/files/{GROUP}_{PLURAL}_deprecations.yaml"


def build_policy() -> list[dict[str, Any]]:
    """The ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, Kubernetes 1.30+) and
    its binding: every deprecated field a created or updated RLJob sets is answered with a
    warning, never a refusal (`validationActions: [Warn]`, `failurePolicy: Ignore`)."""
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME},
        "spec": {
            "failurePolicy": "Ignore",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [GROUP],
                "apiVersions": [VERSION],
                "operations": ["CREATE", "UPDATE"],
                "resources": [PLURAL],
            }]},
            "validations": [
                {"expression": d.cel(), "message": d.message, "reason": "Invalid"}
                for d in DEPRECATED_FIELDS
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY_NAME},
        "spec": {"policyName": POLICY_NAME, "validationActions": ["Warn"]},
    }
    return [policy, binding]
