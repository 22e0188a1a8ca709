"""spec.rollout.engines, and the deprecated spec.rollout.gpus it replaces: one normalised
engine count for the operator and the runtime, the rules that relate the two fields, and the
deprecation warning `rljob validate` and `rljob run` print (the API server's is checked in
tests/apiserver/test_deprecation_warnings.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.cluster.placement import plan
from rljob_api.deprecations import DEPRECATED_FIELDS, build_policy, deprecation_warnings
from rljob_api.layout import engine_count
from rljob_api.spec import RLJobSpec
from rljob_api.validate import spec_problems
from rljob_operator.builders import JobRef, build_raycluster, revisions, runtime_config
from tests.specs import base_job, rule_message

pytestmark = pytest.mark.unit

RLJOB = [sys.executable, "-m", "rljob.cli"]
(GPUS,) = DEPRECATED_FIELDS
JOB = JobRef("rl", "ns", "uid")
DIVISIBLE = rule_message("self.gpus % self.gpusPerEngine")
DISAGREE = rule_message("self.gpus == self.engines * self.gpusPerEngine")
COLOCATED = rule_message("== self.trainer.replicas * self.trainer.gpusPerReplica")


def _rollout(**rollout: Any) -> RLJobSpec:
    return RLJobSpec.model_validate({"rollout": rollout})


@pytest.mark.parametrize(("rollout", "engines", "slots"), [
    ({}, 1, 1),
    ({"gpusPerEngine": 2}, 1, 2),  # one engine of TP 2 (the old default gpus 1 was refused)
    ({"engines": 3}, 3, 3),
    ({"engines": 3, "gpusPerEngine": 2}, 3, 6),
    ({"gpus": 8, "gpusPerEngine": 2}, 4, 8),  # deprecated: engines = gpus / gpusPerEngine
    ({"gpus": 1}, 1, 1),
    ({"gpus": 6, "engines": 3, "gpusPerEngine": 2}, 3, 6),  # both, agreeing
])
def test_one_engine_count_whichever_field_the_spec_sets(
        rollout: dict[str, int], engines: int, slots: int) -> None:
    spec = _rollout(**rollout)
    assert spec.rollout.engine_count == engine_count(spec) == engines
    assert spec.rollout.engine_slots == slots
    assert spec.rollout.gpus is None, "the deprecated field never reaches a consumer"
    dumped = spec.model_dump(by_alias=True, mode="json", exclude_none=True)["rollout"]
    assert "gpus" not in dumped


def test_gpus_and_engines_build_the_same_cluster_and_restart_nothing() -> None:
    """Replacing `gpus: 8` (gpusPerEngine 2) by `engines: 4` changes no child of the job: the
    same RayCluster, pod templates and driver, so the operator restarts nothing."""
    old = RLJobSpec.model_validate({"rollout": {"gpus": 8, "gpusPerEngine": 2}})
    new = RLJobSpec.model_validate({"rollout": {"engines": 4, "gpusPerEngine": 2}})
    assert revisions(JOB, old) == revisions(JOB, new)
    assert runtime_config(old) == runtime_config(new)
    groups = {g["groupName"]: g["replicas"]
              for g in build_raycluster(JOB, new)["spec"]["workerGroupSpecs"]}
    assert groups["rollout"] == 4
    more = RLJobSpec.model_validate({"rollout": {"engines": 5, "gpusPerEngine": 2}})
    assert revisions(JOB, more).cluster != revisions(JOB, new).cluster


def test_placement_counts_engines_times_gpus_per_engine() -> None:
    spec = RLJobSpec.model_validate({
        "trainer": {"backend": "torch", "replicas": 1, "gpusPerReplica": 2},
        "rollout": {"engines": 3, "gpusPerEngine": 2}})
    layout = plan(spec)
    assert layout.slots == 2 + 6 and layout.engine_slots == (2, 4, 6)


def _problems(rollout: dict[str, Any], **spec: Any) -> list[str]:
    return [p.message for p in spec_problems({**spec, "rollout": rollout})]


@pytest.mark.parametrize(("rollout", "expected"), [
    ({"engines": 2, "gpusPerEngine": 2}, []),
    ({"gpus": 4, "gpusPerEngine": 2}, []),
    ({"gpus": 4, "engines": 2, "gpusPerEngine": 2}, []),
    ({"gpus": 3, "gpusPerEngine": 2}, [DIVISIBLE]),  # today's rule and message, kept
    ({"gpus": 4, "engines": 4, "gpusPerEngine": 2}, [DISAGREE]),
    ({"gpus": 2, "engines": 1}, [DISAGREE]),
    ({"gpus": 3, "engines": 1, "gpusPerEngine": 2}, [DIVISIBLE, DISAGREE]),
    ({"gpus": None, "engines": 2}, []),  # a null is no value, as at the API server
])
def test_rules_relate_the_two_fields(rollout: dict[str, Any], expected: list[str]) -> None:
    assert _problems(rollout) == expected


def test_the_disagreement_names_both_fields_and_the_fix() -> None:
    assert DISAGREE.startswith("spec.rollout.gpus (deprecated) and spec.rollout.engines")
    assert "remove spec.rollout.gpus" in DISAGREE and '"/spec/rollout/gpus"' in DISAGREE


@pytest.mark.parametrize(("rollout", "ok"), [
    ({"engines": 2, "gpusPerEngine": 2}, True),
    ({"engines": 4}, True),
    ({"engines": 2}, False),
    ({"gpus": 4, "gpusPerEngine": 2}, True),
    ({"gpus": 2}, False),
    ({"gpusPerEngine": 4}, True),  # unset: one engine, of 4 GPUs
    ({}, False),
])
def test_colocated_engines_cover_the_trainers_gpus(rollout: dict[str, Any], ok: bool) -> None:
    problems = _problems(rollout, placement="colocated",
                         trainer={"backend": "torch", "gpusPerReplica": 4})
    assert (COLOCATED not in problems) is ok, problems


def test_the_warning_is_for_a_set_gpus_only() -> None:
    assert deprecation_warnings({"spec": {"rollout": {"gpus": 2}}}) == [GPUS.message]
    assert deprecation_warnings({"spec": {"rollout": {"engines": 2}}}) == []
    assert deprecation_warnings({"spec": {"rollout": {"gpus": None}}}) == []
    assert deprecation_warnings({"spec": None}) == []
    assert GPUS.message.startswith("spec.rollout.gpus is deprecated: use spec.rollout.engines")
    (policy, binding) = build_policy()
    assert [v["message"] for v in policy["spec"]["validations"]] == [GPUS.message]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"],
                               "validationActions": ["Warn"]}


def _job(tmp_path: Path, rollout: dict[str, Any]) -> Path:
    doc = base_job()
    doc["spec"]["rollout"].pop("engines", None)
    doc["spec"]["rollout"].update(rollout)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_rljob_validate_warns_and_accepts(tmp_path: Path) -> None:
    old = _job(tmp_path, {"gpus": 1})
    out = subprocess.run([*RLJOB, "validate", str(old)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"{old}: valid RLJob" in out.stdout
    assert f"{old}: warning: {GPUS.message}" in out.stderr.splitlines()
    new = _job(tmp_path, {"engines": 1})
    out = subprocess.run([*RLJOB, "validate", str(new)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "deprecated" not in out.stderr, out.stderr


def test_rljob_run_warns_before_it_starts(tmp_path: Path) -> None:
    """`rljob run` prints the warning once the file is valid, before anything else: here the
    run then stops at once on `--max-steps 0` (exit 2), so nothing is started."""
    path = _job(tmp_path, {"gpus": 1})
    out = subprocess.run([*RLJOB, "run", str(path), "--max-steps", "0", "--workdir",
                          str(tmp_path / "w")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[:2] == [f"{path}: warning: {GPUS.message}",
                                          "--max-steps must be at least 1"]
    refused = _job(tmp_path, {"gpus": 2, "engines": 1})
    out = subprocess.run([*RLJOB, "run", str(refused)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and DISAGREE in out.stderr and "warning" not in out.stderr
