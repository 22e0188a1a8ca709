"""`helm install` into the real control plane, and the operator run with exactly the rights
the chart gives its ServiceAccount: enough to reconcile a job, and a removed verb breaks it
loudly."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_api.deprecations import POLICY_NAME
from tests.chart.helm import CHART, helm
from tests.controlplane import REPO, ControlPlane, free_port
from tests.polling import wait_for

pytestmark = pytest.mark.controlplane

CRD = "rljobs.rljob.io"
# The CRD's deprecation-warning admission policy and its binding, installed beside it.
POLICY = [f"{kind}/{POLICY_NAME}" for kind in ("validatingadmissionpolicy",
                                                "validatingadmissionpolicybinding")]
OPERATOR = REPO / ".venv" / "bin" / "rljob-operator"


@dataclass
class Release:
    name: str
    namespace: str
    notes: str

    @property
    def service_account(self) -> str:
        return f"{self.name}-rljob-operator"


def _install(cp: ControlPlane, name: str, namespace: str, *values: str) -> Release:
    sets = [a for v in values for a in ("--set", v)]
    proc = helm(cp.bins, "install", name, str(CHART), "--namespace", namespace,
                "--create-namespace", *sets, kubeconfig=cp.kubeconfig)
    return Release(name, namespace, proc.stdout.split("NOTES:", 1)[-1])


def _adopt_crd(cp: ControlPlane, release: str, namespace: str) -> None:
    """The documented path for a CRD (and its deprecation policy) applied before the chart
    (docs/install.md)."""
    for obj in (f"crd/{CRD}", *POLICY):
        cp.kubectl("label", "--overwrite", obj, "app.kubernetes.io/managed-by=Helm")
        cp.kubectl("annotate", "--overwrite", obj, f"meta.helm.sh/release-name={release}",
                   f"meta.helm.sh/release-namespace={namespace}")


@pytest.fixture(scope="module")
def cluster_release(cluster: ControlPlane) -> Iterator[Release]:
    """The chart in cluster scope, owning the CRD (adopted from the harness's install)."""
    suffix = uuid.uuid4().hex[:6]
    name, namespace = f"rljob-{suffix}", f"rljob-system-{suffix}"
    _adopt_crd(cluster, name, namespace)
    release = _install(cluster, name, namespace)
    try:
        yield release
    finally:
        helm(cluster.bins, "uninstall", name, "--namespace", namespace,
             kubeconfig=cluster.kubeconfig, check=False)


def _token_kubeconfig(cp: ControlPlane, release: Release, path: Path) -> Path:
    token = cp.kubectl("create", "token", release.service_account, "-n", release.namespace,
                       "--duration=1h").stdout.strip()
    config = yaml.safe_load(cp.kubeconfig.read_text())
    config["users"] = [{"name": "admin", "user": {"token": token}}]
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Operator:
    popen: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.text().splitlines()[-n:])


@pytest.fixture
def run_operator(tmp_path: Path) -> Iterator[Any]:
    """Start `rljob-operator` processes; every one is stopped after the test."""
    started: list[Operator] = []

    def start(kubeconfig: Path, *args: str) -> Operator:
        log = tmp_path / f"operator-{len(started)}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [str(OPERATOR), "--kubeconfig", str(kubeconfig), "--metrics-port", "0",
                 f"--liveness=http://127.0.0.1:{free_port()}/healthz", "--interval", "1",
                 *args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"})
        op = Operator(popen, log)
        started.append(op)
        return op

    try:
        yield start
    finally:
        for op in started:
            op.popen.terminate()
            try:
                op.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                op.popen.kill()
                op.popen.wait(timeout=10)


def _job(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    doc["metadata"]["name"] = name
    return doc


def _exists(cp: ControlPlane, *args: str) -> bool:
    return bool(cp.kubectl("get", *args, "-o", "name", check=False).returncode == 0)


def _phase(cp: ControlPlane, namespace: str, name: str) -> str | None:
    status = cp.get_json("rljob", name, "-n", namespace).get("status") or {}
    phase: str | None = status.get("phase")
    return phase


def test_install_creates_everything_and_notes_say_what_next(
        cluster: ControlPlane, cluster_release: Release) -> None:
    ns, name = cluster_release.namespace, cluster_release.name
    for kind in ("serviceaccount", "deployment", "service"):
        assert _exists(cluster, kind, "-n", ns, "-l", f"app.kubernetes.io/instance={name}")
    assert _exists(cluster, "clusterrole", cluster_release.service_account)
    crd = cluster.get_json("crd", CRD)
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["metadata"]["labels"]["app.kubernetes.io/instance"] == name
    for obj in POLICY:
        meta = cluster.get_json(obj)["metadata"]
        assert meta["labels"]["app.kubernetes.io/instance"] == name, obj
        assert meta["annotations"]["helm.sh/resource-policy"] == "keep", obj
    deploy = cluster.get_json("deployment", cluster_release.service_account, "-n", ns)
    assert deploy["spec"]["strategy"]["type"] == "Recreate"
    notes = cluster_release.notes
    assert f"kubectl -n {ns} rollout status deployment/{cluster_release.service_account}" in notes
    assert "kubectl apply -f examples/tiny-cpu.yaml" in notes and "kubectl get rljobs" in notes


def test_upgrade_to_several_replicas_is_refused_and_changes_nothing(
        cluster: ControlPlane, cluster_release: Release) -> None:
    """No leader election: helm refuses a second operator pod, and the release keeps one."""
    ns, name = cluster_release.namespace, cluster_release.name
    proc = helm(cluster.bins, "upgrade", name, str(CHART), "--namespace", ns, "--reuse-values",
                "--set", "replicaCount=2", kubeconfig=cluster.kubeconfig, check=False)
    assert proc.returncode != 0
    assert "at '/replicaCount': value must be 1" in proc.stderr, proc.stderr
    deploy = cluster.get_json("deployment", cluster_release.service_account, "-n", ns)
    assert (deploy["spec"]["replicas"], deploy["spec"]["strategy"]["type"]) == (1, "Recreate")
    assert cluster.get_json("pdb", "-n", ns)["items"] == []


def _can(cp: ControlPlane, token: str, verb: str, resource: str, namespace: str | None) -> bool:
    ns = ["-n", namespace] if namespace else []
    resource, _, sub = resource.partition("/")
    extra = [f"--subresource={sub}"] if sub else []
    out = cp.kubectl("auth", "can-i", verb, resource, *ns, *extra, token=token,
                     check=False).stdout
    return bool(out.strip() == "yes")


def test_service_account_holds_no_more_than_the_operator_uses(
        cluster: ControlPlane, cluster_release: Release, namespace: str) -> None:
    token = cluster.kubectl("create", "token", cluster_release.service_account, "-n",
                            cluster_release.namespace).stdout.strip()
    for verb, resource in [("watch", "rljobs.rljob.io"), ("patch", "rljobs.rljob.io/status"),
                           ("create", "rayclusters.ray.io"), ("delete", "pods"),
                           ("create", "roles.rbac.authorization.k8s.io"), ("create", "events"),
                           ("create", "secrets"), ("create", "persistentvolumeclaims"),
                           ("get", "configmaps"), ("get", "persistentvolumeclaims"),
                           ("patch", "rayclusters.ray.io"), ("patch", "pods"),
                           ("create", "networkpolicies.networking.k8s.io"),
                           ("get", "networkpolicies.networking.k8s.io")]:
        assert _can(cluster, token, verb, resource, namespace), f"cannot {verb} {resource}"
    assert _can(cluster, token, "list", "nodes", None)
    for verb, resource in [("get", "secrets"), ("update", "secrets"), ("list", "secrets"),
                           ("delete", "persistentvolumeclaims"), ("delete", "rljobs.rljob.io"),
                           ("patch", "rljobs.rljob.io"), ("create", "pods/exec"),
                           ("update", "rayclusters.ray.io"), ("patch", "nodes"),
                           ("create", "deployments.apps"),
                           ("delete", "networkpolicies.networking.k8s.io"),
                           ("patch", "networkpolicies.networking.k8s.io"),
                           ("escalate", "roles.rbac.authorization.k8s.io"),
                           ("bind", "clusterroles.rbac.authorization.k8s.io"),
                           ("create", "clusterroles.rbac.authorization.k8s.io"),
                           ("delete", "customresourcedefinitions.apiextensions.k8s.io")]:
        assert not _can(cluster, token, verb, resource, namespace), f"may {verb} {resource}"


def _without_verb(rules: list[dict[str, Any]], resource: str, verb: str) -> list[dict[str, Any]]:
    out = []
    for rule in rules:
        rule = dict(rule)
        if resource in rule["resources"]:
            rule["verbs"] = [v for v in rule["verbs"] if v != verb]
        out.append(rule)
    return out


def test_operator_with_the_chart_token_reconciles_and_a_removed_verb_fails_loudly(
        cluster: ControlPlane, cluster_release: Release, namespace: str, tmp_path: Path,
        run_operator: Any) -> None:
    kubeconfig = _token_kubeconfig(cluster, cluster_release, tmp_path / "sa.kubeconfig")
    operator = run_operator(kubeconfig)

    cluster.apply({**_job("granted"), "metadata": {"name": "granted", "namespace": namespace}})
    wait_for(lambda: _exists(cluster, "raycluster", "granted", "-n", namespace)
             and _phase(cluster, namespace, "granted") is not None,
             timeout=60, what="the operator (chart token) to create the RayCluster and a phase",
             describe=operator.tail)
    for kind, child in [("serviceaccount", "granted-runtime"), ("role", "granted-status-writer"),
                        ("rolebinding", "granted-status-writer"), ("configmap", "granted-spec"),
                        ("networkpolicy", "granted-peers-only")]:
        assert _exists(cluster, kind, child, "-n", namespace), f"{kind}/{child} missing"
    wait_for(lambda: _phase(cluster, namespace, "granted") == "Running", timeout=90,
             what="job Running under the chart's RBAC", describe=lambda: json.dumps(
                 cluster.get_json("rljob", "granted", "-n", namespace).get("status"))
             + "\n" + operator.tail())
    assert "forbidden" not in operator.text().lower(), operator.tail()

    role = cluster.get_json("clusterrole", cluster_release.service_account)
    original = role["rules"]
    broken = {**role, "rules": _without_verb(original, "rayclusters", "create")}
    broken["metadata"] = {"name": role["metadata"]["name"]}
    try:
        cluster.kubectl("replace", "-f", "-", input=json.dumps(broken))
        cluster.apply({**_job("denied"), "metadata": {"name": "denied", "namespace": namespace}})
        wait_for(lambda: f"{namespace}/denied failed" in operator.text()
                 and "cannot create resource" in operator.text(),
                 timeout=60, what="the operator to report the forbidden create",
                 describe=operator.tail)
        report = operator.text().split(f"{namespace}/denied failed", 1)[1]
        assert "Forbidden" in report and "rayclusters" in report, report[:2000]
        assert not _exists(cluster, "raycluster", "denied", "-n", namespace)
    finally:
        restored = {**role, "rules": original, "metadata": {"name": role["metadata"]["name"]}}
        cluster.kubectl("replace", "-f", "-", input=json.dumps(restored))
    wait_for(lambda: _exists(cluster, "raycluster", "denied", "-n", namespace), timeout=60,
             what="the job to proceed once the verb is back", describe=operator.tail)

    cluster.kubectl("delete", "rljob", "granted", "-n", namespace, "--wait=false")
    wait_for(lambda: not _exists(cluster, "raycluster", "granted", "-n", namespace), timeout=60,
             what="children of a deleted job to be garbage-collected")


def test_namespace_scope_reconciles_only_its_namespace(
        cluster: ControlPlane, namespace: str, tmp_path: Path, run_operator: Any) -> None:
    suffix = uuid.uuid4().hex[:6]
    release = _install(cluster, f"rljns-{suffix}", f"rljob-ns-{suffix}", "crds.install=false",
                       "rbac.scope=namespace", f"watchNamespace={namespace}")
    other = f"other-{suffix}"
    cluster.kubectl("create", "namespace", other)
    try:
        assert "watching RLJobs in namespace " + namespace in release.notes
        token = cluster.kubectl("create", "token", release.service_account, "-n",
                                release.namespace).stdout.strip()
        assert _can(cluster, token, "create", "rayclusters.ray.io", namespace)
        assert not _can(cluster, token, "create", "rayclusters.ray.io", other)
        assert not _can(cluster, token, "list", "customresourcedefinitions", None)
        kubeconfig = _token_kubeconfig(cluster, release, tmp_path / "ns.kubeconfig")
        operator = run_operator(kubeconfig, f"--namespace={namespace}")
        cluster.apply({**_job("mine"), "metadata": {"name": "mine", "namespace": namespace}})
        cluster.apply({**_job("theirs"), "metadata": {"name": "theirs", "namespace": other}})
        wait_for(lambda: _exists(cluster, "raycluster", "mine", "-n", namespace), timeout=60,
                 what="the namespaced operator to reconcile its namespace",
                 describe=operator.tail)
        assert _phase(cluster, other, "theirs") is None
        assert "forbidden" not in operator.text().lower(), operator.tail()
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
        helm(cluster.bins, "uninstall", release.name, "--namespace", release.namespace,
             kubeconfig=cluster.kubeconfig, check=False)


def test_uninstall_keeps_the_crd_and_the_jobs(cluster: ControlPlane, namespace: str) -> None:
    suffix = uuid.uuid4().hex[:6]
    name, ns = f"rljob-keep-{suffix}", f"rljob-keep-{suffix}"
    previous = cluster.get_json("crd", CRD)["metadata"].get("annotations", {})
    _adopt_crd(cluster, name, ns)
    try:
        _install(cluster, name, ns)
        cluster.apply({**_job("kept"), "metadata": {"name": "kept", "namespace": namespace}})
        helm(cluster.bins, "uninstall", name, "--namespace", ns, kubeconfig=cluster.kubeconfig)
        assert _exists(cluster, "crd", CRD), "helm.sh/resource-policy: keep"
        assert all(_exists(cluster, obj) for obj in POLICY), "kept with the CRD"
        assert _exists(cluster, "rljob", "kept", "-n", namespace)
        assert not _exists(cluster, "clusterrole", f"{name}-rljob-operator")
    finally:
        owner = previous.get("meta.helm.sh/release-name")
        if owner:
            _adopt_crd(cluster, owner, previous["meta.helm.sh/release-namespace"])
