"""The chart rendered by the pinned helm: lint, Kubernetes schemas, RBAC, security, toggles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from rljob_api.deprecations import build_policy
from tests.chart.helm import (
    CHART,
    CHART_CRD,
    KUBE_VERSION,
    SERVICE_MONITOR_API,
    Manifest,
    by_kind,
    helm,
    one,
    render,
)

pytestmark = pytest.mark.controlplane

# Kinds that are not part of Kubernetes itself; their schemas live in other projects' CRDs.
NON_CORE_KINDS = {"ServiceMonitor"}

COMBINATIONS: dict[str, dict[str, str]] = {
    "defaults": {},
    "namespace-scope": {"rbac.scope": "namespace", "watchNamespace": "team-a"},
    "no-crds": {"crds.install": "false", "crds.keep": "false"},
    "existing-sa": {"serviceAccount.create": "false", "serviceAccount.name": "ops"},
    "digest-and-extras": {
        "image.digest": "sha256:" + "a" * 64, "operator.extraArgs[0]=--verbose": "",
        "nodeSelector.pool": "system", "tolerations[0].operator": "Exists",
        "imagePullSecrets[0].name": "regcred", "priorityClassName": "system-cluster-critical",
    },
    "service-monitor": {"metrics.serviceMonitor.enabled": "true"},
    "kueue": {"kueue.enabled": "true"},
    "kueue-namespace-scope": {"kueue.enabled": "true", "rbac.scope": "namespace",
                              "watchNamespace": "team-a"},
}


def _values(combo: dict[str, str]) -> dict[str, str]:
    """Allow `key=value` keys for list items whose value is inside the key."""
    out: dict[str, str] = {}
    for key, value in combo.items():
        if "=" in key:
            key, value = key.split("=", 1)
        out[key] = value
    return out


@pytest.mark.parametrize("combo", sorted(COMBINATIONS))
def test_lint_strict(k8s_bins: Path, tmp_path: Path, combo: str) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({}))
    sets = [a for k, v in _values(COMBINATIONS[combo]).items() for a in ("--set", f"{k}={v}")]
    proc = helm(k8s_bins, "lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART), *sets)
    assert "0 chart(s) failed" in proc.stdout, proc.stdout


@pytest.mark.parametrize("combo", sorted(COMBINATIONS))
@pytest.mark.parametrize("with_monitoring", [False, True], ids=["plain", "prometheus-operator"])
def test_every_manifest_matches_the_kubernetes_schema(
        k8s_bins: Path, combo: str, with_monitoring: bool) -> None:
    apis = (SERVICE_MONITOR_API,) if with_monitoring else ()
    manifests = render(k8s_bins, _values(COMBINATIONS[combo]), api_versions=apis)
    assert manifests
    for m in manifests:
        if m["kind"] in NON_CORE_KINDS:
            continue
        try:
            kubernetes_validate.validate(m, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            where = "/".join(map(str, err.path))
            pytest.fail(f"{m['kind']}/{m['metadata']['name']} at {where}: {err.message}")


def _rules(manifests: list[Manifest]) -> list[dict[str, Any]]:
    return [r for kind in ("ClusterRole", "Role") for m in by_kind(manifests, kind)
            for r in m["rules"]]


@pytest.mark.parametrize("combo", ["defaults", "namespace-scope", "kueue",
                                   "kueue-namespace-scope"])
def test_rbac_has_no_wildcards_and_never_reads_secrets(k8s_bins: Path, combo: str) -> None:
    rules = _rules(render(k8s_bins, _values(COMBINATIONS[combo])))
    assert rules
    for rule in rules:
        for key in ("verbs", "resources", "apiGroups"):
            assert "*" not in rule[key], f"wildcard in {key}: {rule}"
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
        if "secrets" in rule["resources"]:  # the job's Ray token: created, never read back
            assert rule["verbs"] == ["create"], rule
    assert any("secrets" in r["resources"] for r in rules)


def test_cluster_scope_uses_one_cluster_role(k8s_bins: Path) -> None:
    manifests = render(k8s_bins)
    assert not by_kind(manifests, "Role")
    binding = one(manifests, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rljob-rljob-operator",
                                    "namespace": "rljob-system"}]
    args = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith("--namespace")], "no --namespace: all of them"


def test_namespace_scope_grants_namespaced_rights_only_in_the_watched_namespace(
        k8s_bins: Path) -> None:
    manifests = render(k8s_bins, _values(COMBINATIONS["namespace-scope"]))
    role = one(manifests, "Role")
    assert role["metadata"]["namespace"] == "team-a"
    assert one(manifests, "RoleBinding")["metadata"]["namespace"] == "team-a"
    cluster = one(manifests, "ClusterRole")
    assert cluster["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    args = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a"]


def test_kueue_rights_come_only_with_the_integration(k8s_bins: Path) -> None:
    """kueue.enabled: the operator may write Workloads and read flavors and priorities, runs
    with --kueue, and Kueue's ServiceAccount may read RLJobs; without it, none of that."""
    def granted(manifests: list[Manifest]) -> set[tuple[str, str, str]]:
        return {(g, r, v) for rule in _rules(manifests) for g in rule["apiGroups"]
                for r in rule["resources"] for v in rule["verbs"]}

    def args(manifests: list[Manifest]) -> list[str]:
        return list(one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"][0][
            "args"])

    for combo in ("defaults", "namespace-scope"):
        plain = render(k8s_bins, _values(COMBINATIONS[combo]))
        assert not {g for g, _, _ in granted(plain)} & {"kueue.x-k8s.io", "scheduling.k8s.io"}
        assert "--kueue" not in args(plain)
    for combo in ("kueue", "kueue-namespace-scope"):
        manifests = render(k8s_bins, _values(COMBINATIONS[combo]))
        rights = granted(manifests)
        for verb in ("list", "watch", "create", "patch", "delete"):
            assert ("kueue.x-k8s.io", "workloads", verb) in rights
        assert ("kueue.x-k8s.io", "workloads", "get") not in rights  # a job's are listed
        assert ("kueue.x-k8s.io", "workloads/status", "patch") in rights
        assert ("kueue.x-k8s.io", "resourceflavors", "get") in rights
        assert ("rljob.io", "rljobs/finalizers", "update") in rights
        assert "--kueue" in args(manifests)
        reader = [b for b in by_kind(manifests, "ClusterRoleBinding")
                  if b["metadata"]["name"].endswith("kueue-reads-rljobs")]
        assert [b["subjects"] for b in reader] == [[{
            "kind": "ServiceAccount", "name": "kueue-controller-manager",
            "namespace": "kueue-system"}]]


def test_deployment_is_restricted_probed_and_pinned(k8s_bins: Path) -> None:
    deploy = one(render(k8s_bins), "Deployment")
    spec = deploy["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in pod["volumes"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "readinessProbe" in container
    assert container["resources"]["requests"] and container["resources"]["limits"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert container["image"] == f"{values['image']['repository']}:{values['image']['tag']}"
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert values["image"]["tag"] == chart["appVersion"], "the default image is the app version"


def test_digest_replaces_the_tag(k8s_bins: Path) -> None:
    digest = "sha256:" + "b" * 64
    deploy = one(render(k8s_bins, {"image.digest": digest}), "Deployment")
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"].endswith("@" + digest)


@pytest.mark.parametrize("combo", sorted(COMBINATIONS))
def test_exactly_one_operator_pod_and_no_pdb(k8s_bins: Path, combo: str) -> None:
    """The operator has no leader election: one pod, replaced (never overlapped) by Recreate,
    and no PodDisruptionBudget, which over one pod would only block node drains."""
    manifests = render(k8s_bins, _values(COMBINATIONS[combo]))
    spec = one(manifests, "Deployment")["spec"]
    assert (spec["replicas"], spec["strategy"]) == (1, {"type": "Recreate"})
    assert not by_kind(manifests, "PodDisruptionBudget")


@pytest.mark.parametrize(("enabled", "api", "expected"), [
    ("false", False, 0), ("false", True, 0), ("true", False, 0), ("true", True, 1)])
def test_service_monitor_needs_the_flag_and_the_api(k8s_bins: Path, enabled: str, api: bool,
                                                    expected: int) -> None:
    manifests = render(k8s_bins, {"metrics.serviceMonitor.enabled": enabled},
                       api_versions=(SERVICE_MONITOR_API,) if api else ())
    monitors = by_kind(manifests, "ServiceMonitor")
    assert len(monitors) == expected
    service = one(manifests, "Service")
    assert service["spec"]["ports"][0]["name"] == "metrics"
    if monitors:
        assert monitors[0]["spec"]["endpoints"][0]["port"] == "metrics"
        assert monitors[0]["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]


def test_rendered_crd_is_the_generated_crd(k8s_bins: Path) -> None:
    crd = one(render(k8s_bins), "CustomResourceDefinition")
    source = yaml.safe_load(CHART_CRD.read_text())
    assert crd["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert crd["metadata"].pop("labels")["app.kubernetes.io/part-of"] == "rljob"
    assert crd == source, "the chart must render crds/rljob.io_rljobs.yaml unchanged"
    assert not by_kind(render(k8s_bins, {"crds.install": "false"}), "CustomResourceDefinition")
    kept = one(render(k8s_bins, {"crds.keep": "false"}), "CustomResourceDefinition")
    assert "annotations" not in kept["metadata"]


def test_rendered_deprecation_policy_is_the_generated_one(k8s_bins: Path) -> None:
    """The admission policy that warns about deprecated RLJob fields ships with the CRD:
    the generated objects, labelled and kept like the CRD; left out with crds.install=false,
    and on a cluster older than 1.30 (no admissionregistration.k8s.io/v1
    ValidatingAdmissionPolicy)."""
    kinds = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    manifests = render(k8s_bins)
    rendered = [m for kind in kinds for m in by_kind(manifests, kind)]
    for m in rendered:
        assert m["metadata"].pop("labels")["app.kubernetes.io/part-of"] == "rljob"
        assert m["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert rendered == build_policy()
    unkept = render(k8s_bins, {"crds.keep": "false"})
    assert all("annotations" not in m["metadata"] for kind in kinds
               for m in by_kind(unkept, kind))
    for values, kube in (({"crds.install": "false"}, KUBE_VERSION), ({}, "1.29.0")):
        out = helm(k8s_bins, "template", "r", str(CHART), "--kube-version", kube,
                   *[a for k, v in values.items() for a in ("--set", f"{k}={v}")]).stdout
        kinds = {d["kind"] for d in yaml.safe_load_all(out) if d}
        assert "CustomResourceDefinition" in kinds or values
        assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


@pytest.mark.parametrize(("values", "expected"), [
    ({"image.tag": "latest"}, "at '/image/tag': 'latest' does not match pattern"),
    ({"rbac.scope": "all"}, "at '/rbac/scope': value must be one of 'cluster', 'namespace'"),
    ({"replicas": "2"}, "additional properties 'replicas' not allowed"),
    ({"replicaCount": "2"}, "at '/replicaCount': value must be 1"),
    ({"podDisruptionBudget.minAvailable": "1"},
     "additional properties 'podDisruptionBudget' not allowed"),
])
def test_helm_refuses_bad_values_naming_the_value(k8s_bins: Path, values: dict[str, str],
                                                  expected: str) -> None:
    sets = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    proc = helm(k8s_bins, "template", "r", str(CHART), "--kube-version", KUBE_VERSION, *sets,
                check=False)
    assert proc.returncode != 0
    assert expected in proc.stderr, proc.stderr

