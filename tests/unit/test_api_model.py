"""The API model: defaults, layout, CRD freshness and the Python validator."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from rljob_api.crd import CRD_FILE, build_crd, render_crd, render_policy
from rljob_api.deprecations import POLICY_FILE
from rljob_api.spec import RLJobSpec
from rljob_api.validate import load_job, manifest_problems, update_problems
from tests.controlplane import REPO
from tests.specs import BAD_SPECS, BadSpec, base_job

pytestmark = pytest.mark.unit

TOP_LEVEL = [
    "operator",
    "runtime",
    "crds",
    "charts",
    "images/trainer",
    "images/rollout",
    "e2e",
    "tests",
    "pyproject.toml",
    "README.md",
]


def test_layout_has_the_fixed_top_level() -> None:
    missing = [p for p in TOP_LEVEL if not (REPO / p).exists()]
    assert not missing, f"missing top-level entries: {missing}"
    assert not (REPO / "operator" / "__init__.py").exists(), "no top-level package 'operator'"


def test_api_model_imports_without_torch_ray_or_kopf() -> None:
    code = (
        "import sys, rljob_api.spec, rljob_api.status, rljob_api.crd, rljob_api.validate\n"
        "bad = {'torch', 'ray', 'kopf', 'kubernetes'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_committed_crd_matches_the_model() -> None:
    committed = (REPO / CRD_FILE).read_text()
    assert committed == render_crd(), "crds/ is stale: run `rljob crd --write`"
    policy = (REPO / POLICY_FILE).read_text()
    assert policy == render_policy(), f"{POLICY_FILE} is stale: run `rljob crd --write`"


def test_crd_shape() -> None:
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["rlj"]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["PHASE", "STEP", "REWARD", "CHECKPOINT", "RESTARTS", "ENGINES", "AGE"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def walk(node: dict[str, object], path: str) -> None:
        assert "anyOf" not in node and "$ref" not in node, path
        props = node.get("properties")
        if isinstance(props, dict):
            for name, child in props.items():
                assert child.get("description"), f"{path}.{name} has no description"
                walk(child, f"{path}.{name}")

    walk(spec, "spec")


def test_defaults_are_complete() -> None:
    spec = RLJobSpec()
    assert spec.algorithm.estimator == "grpo"
    assert spec.weight_sync.mode == "nccl-broadcast"
    assert spec.placement == "disaggregated"


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path: object) -> None:
    load_job(str(path))


@pytest.mark.parametrize("bad", BAD_SPECS, ids=lambda b: b.id)
def test_python_validator_rejects(bad: BadSpec) -> None:
    problems = manifest_problems(bad.apply_to(base_job()))
    assert problems, "accepted a bad spec"
    text = "\n".join(str(p) for p in problems)
    assert bad.field in text
    if bad.message:
        assert bad.message in text


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
def test_dynamic_sampling_and_tis_are_accepted_with_a_group_baseline(estimator: str) -> None:
    doc = BadSpec("ok", {"algorithm.estimator": estimator,
                         "algorithm.dynamicSampling": {"enabled": True, "maxRounds": 3},
                         "algorithm.tis": {"enabled": True, "cap": 5}}, "").apply_to(base_job())
    assert manifest_problems(doc) == []


def test_partial_rollout_is_accepted_with_dynamic_sampling_and_a_custom_generate() -> None:
    doc = BadSpec("ok", {"rollout.partialRollout": {"enabled": True, "overSampling": 3,
                                                    "maskOffPolicyTokens": True},
                         "algorithm.dynamicSampling": {"enabled": True},
                         "generate.function": "my_generate:generate"}, "").apply_to(base_job())
    assert manifest_problems(doc) == []


@pytest.mark.parametrize(("batch", "over", "extra"),
                         [(32, None, 16), (1, None, 1), (32, 3, 3)])
def test_partial_rollout_over_sampling_defaults_to_half_the_batch(
        batch: int, over: int | None, extra: int) -> None:
    spec = RLJobSpec.model_validate({"rollout": {"partialRollout": {
        "enabled": True, "overSampling": over}}})
    assert spec.rollout.partial_rollout.extra_groups(batch) == extra
    assert RLJobSpec().rollout.partial_rollout.extra_groups(batch) == 0  # disabled: none


def test_validator_reports_every_problem_at_once() -> None:
    chosen = [
        b
        for b in BAD_SPECS
        if b.id in {"batch-rule", "rollout-gpus", "lr-positive", "unknown-field", "colocated-gpus"}
    ]
    doc = base_job()
    for bad in chosen:
        doc = bad.apply_to(doc)
    text = "\n".join(str(p) for p in manifest_problems(doc))
    for bad in chosen:
        assert bad.field in text and (bad.message or "") in text


def test_immutable_fields_on_update() -> None:
    old = base_job()["spec"]
    assert update_problems(old, old) == []
    new = BadSpec("x", {"model.dtype": "bfloat16", "placement": "colocated"}, "").apply_to(
        {"spec": old}
    )["spec"]
    fields = {p.field for p in update_problems(old, new)}
    assert fields == {"spec.model", "spec"}


def test_cli_validate_prints_all_problems_and_exits_nonzero(tmp_path: object) -> None:
    from pathlib import Path

    bad = BAD_SPECS[0].apply_to(BAD_SPECS[3].apply_to(base_job()))
    path = Path(str(tmp_path)) / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    proc = subprocess.run(
        [sys.executable, "-m", "rljob.cli", "validate", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "2 problem(s)" in proc.stderr
    assert "rolloutBatchSize" in proc.stderr and "gpusPerEngine" in proc.stderr


def test_cli_validate_unreadable_file() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rljob.cli", "validate", "/nonexistent.yaml"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_validate_old_refuses_an_edit_the_api_server_refuses(tmp_path: object) -> None:
    from pathlib import Path

    tmp = Path(str(tmp_path))
    old = base_job()
    (tmp / "old.yaml").write_text(yaml.safe_dump(old))
    edit = copy.deepcopy(old)
    edit["spec"]["model"]["dtype"] = "float16" if old["spec"]["model"].get(
        "dtype") == "bfloat16" else "bfloat16"
    (tmp / "edit.yaml").write_text(yaml.safe_dump(edit))
    ok = copy.deepcopy(old)
    ok["spec"]["recovery"] = {"maxRestarts": 9}
    (tmp / "ok.yaml").write_text(yaml.safe_dump(ok))

    def validate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rljob.cli", "validate", *args],
                              capture_output=True, text=True, cwd=tmp)

    refused = validate("--old", "old.yaml", "edit.yaml")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "edit.yaml (as an edit of old.yaml): 1 problem(s)" in refused.stderr
    assert "spec.model" in refused.stderr
    assert validate("edit.yaml").returncode == 0  # valid as a new job
    fine = validate("--old", "old.yaml", "ok.yaml")
    assert fine.returncode == 0 and "a valid edit of old.yaml" in fine.stdout


def test_eval_settings_are_accepted_and_the_old_data_fields_refused() -> None:
    doc = BadSpec("ok", {"eval.dataset": "builtin:reverse", "eval.interval": 5,
                         "eval.greedy": True, "eval.maxNewTokens": 8}, "").apply_to(base_job())
    assert manifest_problems(doc) == []
    sampled = BadSpec("ok", {"eval.dataset": "builtin:reverse", "eval.interval": 5,
                             "eval.samplesPerPrompt": 8}, "").apply_to(base_job())
    assert manifest_problems(sampled) == []
    # spec.data.evalDataset/evalInterval moved to spec.eval: the old place is refused
    moved = BadSpec("x", {"data.evalDataset": "builtin:reverse"}, "").apply_to(base_job())
    assert [(p.field, p.message) for p in manifest_problems(moved)] == [
        ("spec.data.evalDataset", "moved to spec.eval.dataset; set it there")]
