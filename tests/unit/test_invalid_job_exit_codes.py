"""An invalid job gets the same exit code from `rljob validate` and `rljob run`, and one
mistake gets one message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_api.exits import INVALID
from rljob_api.validate import manifest_problems
from tests.specs import base_job

pytestmark = pytest.mark.unit

RLJOB = [sys.executable, "-m", "rljob.cli"]
BATCH_RULE = "rolloutBatchSize × nSamplesPerPrompt must equal"


def _with_algorithm(**fields: Any) -> dict[str, Any]:
    doc = base_job()
    doc["spec"]["algorithm"].update(fields)
    return doc


def _write(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


INVALID_FILES: dict[str, Any] = {
    "rule": _with_algorithm(globalBatchSize=96),
    "type": _with_algorithm(globalBatchSize="abc"),
    "unknown-field": {**base_job(), "extra": 1},
    "not-yaml": "spec: [unclosed\n",
    "two-documents": yaml.safe_dump(base_job()) + "---\n" + yaml.safe_dump(base_job()),
    "two-queues": {**base_job(), "metadata": {"name": "job", "labels": {
        "kueue.x-k8s.io/queue-name": "team"}}, "spec": {**base_job()["spec"], "scheduling": {
            "queue": "other"}}},
    "bad-queue-label": {**base_job(), "metadata": {"name": "job", "labels": {
        "kueue.x-k8s.io/queue-name": "Team_A"}}},
}


def test_a_queue_named_twice_must_be_one_queue() -> None:
    """The Kueue label and spec.scheduling.queue name one LocalQueue, or the job is refused
    naming the field (the operator fails such a stored job with the same message)."""
    problems = [str(p) for p in manifest_problems(INVALID_FILES["two-queues"])]
    assert problems == ["spec.scheduling.queue: is 'other' but the label "
                        "kueue.x-k8s.io/queue-name is 'team': name one LocalQueue (drop one "
                        "of them or make them equal)"], problems
    same = INVALID_FILES["two-queues"]
    same = {**same, "spec": {**same["spec"], "scheduling": {"queue": "team"}}}
    assert manifest_problems(same) == []


def test_a_queue_name_kueue_would_refuse_is_refused_naming_where_it_is() -> None:
    """Kueue takes only a DNS-1123 subdomain as a Workload's queue: any other name would
    leave the job waiting for ever, so it is refused up front."""
    assert [str(p) for p in manifest_problems(INVALID_FILES["bad-queue-label"])] == [
        "metadata.labels[kueue.x-k8s.io/queue-name]: is 'Team_A', which is no LocalQueue "
        "name: use lower-case letters, digits, '-' and '.' (a DNS-1123 subdomain), as the "
        "LocalQueue's own name is"]
    field = {**base_job(), "spec": {**base_job()["spec"], "scheduling": {"queue": "team.a-1"}}}
    assert manifest_problems(field) == []
    field["spec"]["scheduling"]["queue"] = "-team"
    assert [p.field for p in manifest_problems(field)] == ["spec.scheduling.queue"]


@pytest.mark.parametrize("case", sorted(INVALID_FILES))
def test_validate_and_run_exit_2_on_the_same_invalid_file(case: str, tmp_path: Path) -> None:
    path = _write(tmp_path, INVALID_FILES[case])
    workdir = tmp_path / "w"
    checked = subprocess.run([*RLJOB, "validate", str(path)], capture_output=True, text=True,
                             timeout=120)
    ran = subprocess.run([*RLJOB, "run", str(path), "--workdir", str(workdir)],
                         capture_output=True, text=True, timeout=120)
    assert (checked.returncode, ran.returncode) == (INVALID, INVALID), (checked.stderr,
                                                                         ran.stderr)
    # Both print the same problems, and `run` did no work.
    assert checked.stderr == ran.stderr and "Traceback" not in ran.stderr
    assert not workdir.exists()


def test_an_unreadable_file_is_invalid_for_both_commands(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere.yaml")
    codes = [subprocess.run([*RLJOB, cmd, missing], capture_output=True, timeout=120).returncode
             for cmd in ("validate", "run")]
    assert codes == [INVALID, INVALID]


@pytest.mark.parametrize("value", ["abc", 7.5, "16", [16], None],
                         ids=["word", "fraction", "quoted-number", "list", "null"])
def test_a_bad_global_batch_size_is_one_problem(value: Any) -> None:
    """The field's own error only: no cross-field rule is judged on a value of the wrong
    type, which the API server never evaluates rules on either (a string "16" would
    otherwise be multiplied as a string)."""
    problems = manifest_problems(_with_algorithm(globalBatchSize=value))
    assert [p.field for p in problems] == ["spec.algorithm.globalBatchSize"], problems


def test_a_batch_size_below_its_bound_also_breaks_the_rule_as_at_admission() -> None:
    """A value of the right type out of its bounds is not a blocking error for the API
    server, which still evaluates every rule (tests/apiserver/test_admission_parity.py):
    `rljob validate` names both, at the field."""
    problems = manifest_problems(_with_algorithm(globalBatchSize=0))
    assert [p.field for p in problems] == ["spec.algorithm.globalBatchSize"] * 2, problems
    assert "greater than or equal to 1" in problems[0].message
    assert BATCH_RULE in problems[1].message


def test_cli_prints_one_problem_for_one_mistake(tmp_path: Path) -> None:
    path = _write(tmp_path, _with_algorithm(globalBatchSize="abc"))
    out = subprocess.run([*RLJOB, "validate", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == INVALID
    assert "1 problem(s)" in out.stderr and BATCH_RULE not in out.stderr, out.stderr


def test_a_type_error_anywhere_holds_the_rules_back_as_at_admission() -> None:
    """A value of the wrong type is a blocking error for the API server, which then
    evaluates no rule at all (tests/apiserver/test_admission_parity.py): `rljob validate`
    names the type error alone, as `kubectl apply` would; the broken batch-size rule shows
    once `lr` is fixed."""
    problems = manifest_problems(_with_algorithm(globalBatchSize=96, lr="fast"))
    assert [p.field for p in problems] == ["spec.algorithm.lr"], problems
    fixed = manifest_problems(_with_algorithm(globalBatchSize=96))
    assert any(BATCH_RULE in p.message for p in fixed), fixed


def test_a_rule_over_a_nested_bad_field_is_skipped() -> None:
    """The parallelism rule reads parallelism.tensor: a non-integer there is one problem."""
    doc = base_job()
    doc["spec"]["trainer"]["parallelism"] = {"tensor": "four"}
    problems = manifest_problems(doc)
    assert [p.field for p in problems] == ["spec.trainer.parallelism.tensor"], problems
