"""Generated RLJobs against the real API server: what it admits `rljob validate` accepts, and
the other way round, naming the same fields; and what it admits the operator either builds or
fails naming a field, never raising.

The rule-by-rule tables (tests/specs.py) check each rule once; this walks the space around
the rules' edges, where two rules, a bound and a rule, or a rule and a default meet. Examples
are drawn from a fixed seed (derandomize) and bounded, so CI sees the same specs every run.
"""

from __future__ import annotations

import copy
import json
import re
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rljob_api import GROUP, PLURAL, VERSION
from rljob_api.spec import COLOCATED_IMAGE, IMAGE_VERSION, TRAINER_IMAGE
from rljob_api.status import Phase
from rljob_api.validate import manifest_problems
from rljob_operator.builders import (
    JobRef,
    build_checkpoint_claim,
    build_configmap,
    build_driver,
    build_raycluster,
    build_rbac,
)
from rljob_operator.observe import observe
from rljob_operator.phases import decide
from rljob_operator.situation import parse_job
from tests.controlplane import ControlPlane
from tests.specs import base_job

pytestmark = pytest.mark.controlplane

Obj = dict[str, Any]
EXAMPLES = 400
NOW = datetime(2026, 1, 1, tzinfo=UTC)

# Values around each rule's edges (None: leave the field out); a drawn spec changes a few.
EDGES: dict[str, list[Any]] = {
    "algorithm.rolloutBatchSize": [1, 2, 4, 32],
    "algorithm.nSamplesPerPrompt": [1, 2, 8],
    "algorithm.globalBatchSize": [0, 1, 4, 8, 16, 64, 96],
    "algorithm.stepsPerRollout": [1, 2, 4],
    "algorithm.microBatchSize": [0, 1, 3, 8, 24],
    "algorithm.clipEpsHigh": [None, 0.1, 0.2, 0.3],
    "algorithm.estimator": ["grpo", "ppo", "reinforce++", "reinforce++_baseline", "dpo"],
    "algorithm.dynamicSampling": [{"enabled": True}, {"enabled": False}, {"maxRounds": 1}],
    "algorithm.tis": [{"enabled": True}, {"enabled": True, "cap": 0.5}],
    "algorithm.oldLogprobs": ["trainer", "rollout"],
    "algorithm.lr": [0, 1e-5, "fast", True],
    "trainer.backend": ["torch", "megatron", "jax"],
    "trainer.replicas": [0, 1, 2],
    "trainer.gpusPerReplica": [0, 1, 2, 4],
    "trainer.parallelism": [{"tensor": 2}, {"pipeline": 1}],
    "trainer.image": [f"{TRAINER_IMAGE}:{IMAGE_VERSION}", f"{COLOCATED_IMAGE}:{IMAGE_VERSION}",
                      "x" * 513],
    "trainer.resources": [{"limits": {"memory": "64Gi"}}, {"limits": {"memory": "1.2.3Gi"}},
                          {"requests": {"memory": "x5", "cpu": 2}},
                          {"requests": {"cpu": "500m"}}],
    "rollout.backend": ["hf", "sglang", "vllm"],
    "rollout.engines": [None, 2, 4],
    "rollout.gpus": [1, 2, 3, 4],
    "rollout.gpusPerEngine": [1, 2, 4],
    "rollout.mode": ["sync", "async"],
    "rollout.maxStaleness": [None, 0, 1, 2],
    "rollout.partialRollout": [{"enabled": True}, {"overSampling": 3},
                               {"enabled": True, "overSampling": 0}],
    "rollout.sglangArgs": [{"port": "1"}, {"mem-fraction-static": "0.8"}],
    "placement": ["colocated", "disaggregated"],
    "eval": [None, {"interval": 5}, {"dataset": "builtin:reverse"},
             {"dataset": "builtin:reverse", "interval": 5, "greedy": True,
              "samplesPerPrompt": 4}, {"samplesPerPrompt": 0}],
    "recovery": [{"backoffSeconds": 60, "maxBackoffSeconds": 30},
                 {"backoffSeconds": 10, "maxBackoffSeconds": 10}],
    "model.tiny": [{"hiddenSize": 24, "numHeads": 8}, {"hiddenSize": 30, "numHeads": 3},
                   {"hiddenSize": 64, "numHeads": 4}],
    "model.source": ["builtin:tiny", "/models/qwen"],
    "trainer.gpuCount": [4],
}
# Mostly valid names, so that enough drawn specs are admitted for the operator's half.
NAMES = ["tiny", "j-1", "a" * 53, "tiny", "a" * 54, "1job", "job.x", "Job", "job-", "j-1"]


@st.composite
def jobs(draw: st.DrawFn) -> Obj:
    """The base job (examples/tiny-cpu.yaml) with a drawn name and up to three edge values."""
    doc = base_job(draw(st.sampled_from(NAMES)))
    fields = draw(st.sets(st.sampled_from(sorted(EDGES)), max_size=3))
    for path in sorted(fields):
        value = draw(st.sampled_from(EDGES[path]))
        node = doc["spec"]
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = copy.deepcopy(value)
    return doc


def _server_fields(status: Obj) -> set[str]:
    """The fields the API server's refusal names (its `causes`); a rule on the whole object
    (`metadata.name`) is reported at `<nil>`, and is named by the message it gives."""
    fields: set[str] = set()
    for cause in (status.get("details") or {}).get("causes") or []:
        field, message = cause.get("field", ""), cause.get("message", "")
        if "some validation rules were not checked" in message:
            continue  # the API server's note that a blocking error stopped the CEL rules
        if field == "<nil>":
            match = re.search(r"(metadata\.name|spec[\w.\[\]]*)", message)
            assert match, f"a refusal naming no field: {cause}"
            field = match.group(1)
        fields.add(field)
    return fields


def _unknown_fields(message: str) -> set[str]:
    """Fields a strict-decoding refusal (unknown fields, refused before validation) names."""
    return set(re.findall(r'unknown field "([^"]+)"', message))


def _operator_decides(admitted: Obj) -> None:
    """The operator's decision path on the job as stored: it builds the children, or fails
    the job naming a field; it never raises."""
    body = copy.deepcopy(admitted)
    body["metadata"].update(uid="0123456789abcdef", generation=1)
    job = parse_job(body)
    obs = observe(job.name, None, [], [], now=NOW)
    decision = decide(job, obs, NOW)
    conditions = {c["type"]: c for c in decision.status.get("conditions", [])}
    assert conditions, f"a decision without a condition: {decision.status}"
    if job.spec is None:
        assert decision.phase == Phase.failed.value
        assert re.search(r"(spec\.|metadata\.name)", conditions["Failed"]["message"])
        return
    assert decision.phase != Phase.failed.value, decision.status
    ref = JobRef.of(body)
    assert build_raycluster(ref, job.spec)["metadata"]["name"] == job.name
    assert build_driver(ref, job.spec, 0, [])["metadata"]["name"]
    build_configmap(ref, body["spec"])
    build_rbac(ref)
    build_checkpoint_claim(ref, job.spec)


@pytest.fixture(scope="module")
def rljobs(control_plane: ControlPlane) -> Any:
    """The RLJob API of the control plane, in a namespace of this module's own."""
    from kubernetes import client, config

    api = client.CustomObjectsApi(
        config.new_client_from_config(config_file=str(control_plane.kubeconfig)))
    control_plane.kubectl("create", "namespace", "parity")
    return api


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(doc=jobs())
def test_admitted_exactly_when_validate_accepts(rljobs: Any, doc: Obj) -> None:
    from kubernetes.client.exceptions import ApiException

    problems = manifest_problems(doc)
    named = {p.field for p in problems}
    try:
        admitted = rljobs.create_namespaced_custom_object(
            GROUP, VERSION, "parity", PLURAL, doc, dry_run="All", field_validation="Strict")
    except ApiException as err:
        status = json.loads(err.body or "{}")
        event(f"refused ({err.status})")
        assert problems, f"refused by the API server, accepted by rljob validate: {status}"
        if err.status == 400:  # unknown fields: refused before any validation
            assert _unknown_fields(status["message"]) <= named, (status, problems)
        else:
            assert err.status == 422, status
            assert _server_fields(status) == named, (status["message"], problems)
        return
    assert not problems, f"admitted by the API server, refused by rljob validate: {problems}"
    event("admitted")
    _operator_decides(admitted)
