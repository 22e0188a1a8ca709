"""The API server's own warning for a deprecated RLJob field (spec.rollout.gpus): the
ValidatingAdmissionPolicy generated into crds/ (rljob_api.deprecations) and installed with
the CRD answers a create or update that sets it with a `Warning` header, which kubectl prints
on stderr; the job is admitted all the same. A job that uses spec.rollout.engines gets none,
and moving a job from gpus to engines is an ordinary `kubectl apply`."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from rljob_api.deprecations import DEPRECATED_FIELDS, POLICY_NAME, deprecation_warnings
from tests.controlplane import ControlPlane, temporary_namespace
from tests.polling import wait_for
from tests.specs import base_job

pytestmark = pytest.mark.controlplane

(GPUS,) = DEPRECATED_FIELDS
Obj = dict[str, Any]


def _job(name: str, **rollout: Any) -> Obj:
    doc = base_job(name)
    doc["spec"]["rollout"].pop("engines", None)
    doc["spec"]["rollout"].update(rollout)
    return doc


def _kubectl(cp: ControlPlane, ns: str, verb: str, doc: Obj, *extra: str) -> Any:
    return cp.kubectl(verb, "-n", ns, "-f", "-", *extra, input=yaml.safe_dump(doc))


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Warning:")]


@pytest.fixture(scope="module")
def policy_in_effect(control_plane: ControlPlane) -> Iterator[None]:
    """The API server loads admission policies asynchronously: wait until a server-side dry
    run of a job with gpus is answered with the warning."""
    with temporary_namespace(control_plane, "deprecation-wait") as ns:
        def warned() -> bool:
            proc = _kubectl(control_plane, ns, "create", _job("probe", gpus=1),
                            "--dry-run=server")
            return bool(_warnings(proc.stderr))

        wait_for(warned, timeout=60, interval=1.0,
                 what=f"admission policy {POLICY_NAME} warning")
        yield


def test_creating_a_job_with_gpus_is_warned_about_and_admitted(
        control_plane: ControlPlane, namespace: str, policy_in_effect: None) -> None:
    doc = _job("old-gpus", gpus=2, gpusPerEngine=1)
    proc = _kubectl(control_plane, namespace, "create", doc)
    assert "rljob.io/old-gpus created" in proc.stdout
    (warning,) = _warnings(proc.stderr)
    assert warning.endswith(GPUS.message), warning
    assert POLICY_NAME in warning
    # `rljob validate` gives the same words.
    assert deprecation_warnings(doc) == [GPUS.message]
    stored = control_plane.get_json("rljob", "old-gpus", "-n", namespace)["spec"]["rollout"]
    assert stored["gpus"] == 2 and "engines" not in stored, stored


def test_a_job_with_engines_gets_no_warning(
        control_plane: ControlPlane, namespace: str, policy_in_effect: None) -> None:
    doc = _job("new-engines", engines=2, gpusPerEngine=1)
    proc = _kubectl(control_plane, namespace, "apply", doc)
    assert "rljob.io/new-engines created" in proc.stdout
    assert _warnings(proc.stderr) == [], proc.stderr
    assert deprecation_warnings(doc) == []
    # An omitted rollout section is one engine, without the old default gpus: 1.
    bare = base_job("bare")
    bare["spec"].pop("rollout")
    proc = _kubectl(control_plane, namespace, "apply", bare)
    assert _warnings(proc.stderr) == [], proc.stderr
    stored = control_plane.get_json("rljob", "bare", "-n", namespace)["spec"]["rollout"]
    assert "gpus" not in stored and "engines" not in stored, stored


def test_updates_are_warned_about_until_the_job_moves_to_engines(
        control_plane: ControlPlane, namespace: str, policy_in_effect: None) -> None:
    doc = _job("moving", gpus=2, gpusPerEngine=1)
    assert _warnings(_kubectl(control_plane, namespace, "apply", doc).stderr)
    # A spec edit that keeps gpus: warned again.
    edited = copy.deepcopy(doc)
    edited["spec"]["algorithm"]["totalSteps"] = 7
    proc = _kubectl(control_plane, namespace, "apply", edited)
    assert "configured" in proc.stdout
    (warning,) = _warnings(proc.stderr)
    assert warning.endswith(GPUS.message), warning
    # A change that leaves the spec alone (as the operator's finalizer does): not warned.
    proc = control_plane.kubectl("label", "rljob", "moving", "-n", namespace, "team=a")
    assert _warnings(proc.stderr) == [], proc.stderr
    # gpus 2 replaced by engines 2: `kubectl apply` drops the gpus it applied before, so the
    # two never meet, and the job is no longer warned about.
    moved = copy.deepcopy(edited)
    moved["spec"]["rollout"].pop("gpus")
    moved["spec"]["rollout"]["engines"] = 2
    proc = _kubectl(control_plane, namespace, "apply", moved)
    assert "configured" in proc.stdout and _warnings(proc.stderr) == [], proc.stderr
    stored = control_plane.get_json("rljob", "moving", "-n", namespace)["spec"]["rollout"]
    assert stored["engines"] == 2 and "gpus" not in stored, stored


def test_gpus_that_disagree_with_engines_are_refused_naming_both(
        control_plane: ControlPlane, namespace: str, policy_in_effect: None) -> None:
    doc = _job("both", gpus=4, engines=2, gpusPerEngine=1)
    proc = control_plane.kubectl("apply", "-n", namespace, "-f", "-",
                                 input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0
    assert "spec.rollout.gpus (deprecated) and spec.rollout.engines disagree" in proc.stderr
    assert "remove spec.rollout.gpus" in proc.stderr
