"""Edits of every mutable spec field of a running job, shared by the builders' unit test
(each edit has the effect rljob_api.mutability says) and the control-plane test (each edit
takes that effect on a real cluster and the job runs again).

Edits apply in order to the harness's job (`tests.operator.harness.job_manifest`): every
prefix of the list is a valid spec that fits two 8-GPU nodes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from rljob_api.crd import spec_schema
from rljob_api.mutability import Effect, effect_of
from tests.operator_process import POOL_LABEL

Obj = dict[str, Any]
ZONE_LABEL = "rljob.io/test-zone"

# Covered by tests/operator/test_operator_lifecycle.py (suspend and resume), not here: it
# does not leave the job running.
ELSEWHERE = {"scheduling.suspend"}


@dataclass(frozen=True)
class Edit:
    id: str
    patch: Obj  # merged into spec (a JSON merge patch)

    def paths(self) -> set[str]:
        """The spec fields this edit sets: leaves of the spec's schema (a map such as
        `nodeSelector` is one field)."""
        return set(_leaves(self.patch, spec_schema(), ""))

    @property
    def effect(self) -> Effect:
        (effect,) = {effect_of(p).effect for p in self.paths()}
        return effect

    def apply_to(self, spec: Obj) -> Obj:
        return merge(spec, self.patch)


def _leaves(node: Obj, schema: Obj, prefix: str) -> list[str]:
    out: list[str] = []
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else key
        sub = schema["properties"][key]
        if isinstance(value, dict) and "properties" in sub:
            out += _leaves(value, sub, path)
        else:
            out.append(path)
    return out


def merge(base: Obj, patch: Obj) -> Obj:
    """`patch` laid over `base` as a JSON merge patch (what `kubectl patch --type=merge`
    does): objects merge, anything else (a list, a map's new value) replaces."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def edits(pool: str, priority_class: str) -> list[Edit]:
    """Every mutable field, edited; `pool` is the job's node pool, whose nodes also carry
    ZONE_LABEL=a, and `priority_class` an existing PriorityClass."""
    return [
        Edit("recovery", {"recovery": {
            "maxRestarts": 5, "backoffSeconds": 2, "maxBackoffSeconds": 4,
            "retryOn": ["PodFailed", "PodEvicted", "NodeLost", "DriverFailed"],
            "startupTimeoutSeconds": 900, "stopGracePeriodSeconds": 120,
            "maxEngineRestarts": 3, "engineRestartWindowSeconds": 600}}),
        Edit("trainer-replicas", {"trainer": {"replicas": 2}}),
        Edit("trainer-gpus", {"trainer": {"gpusPerReplica": 4}}),
        Edit("trainer-image-resources", {"trainer": {
            "image": "ghcr.io/rljob/trainer:0.1.1",
            "resources": {"requests": {"cpu": "2", "memory": "8Gi"},
                          "limits": {"memory": "16Gi"}}}}),
        Edit("rollout-engines", {"rollout": {"engines": 4}}),
        Edit("rollout-gpus-per-engine", {"rollout": {"gpusPerEngine": 2, "engines": 2}}),
        # The deprecated spelling, still a compute edit: 2 GPUs of gpusPerEngine 2 are one
        # engine (a JSON merge patch's null removes engines, which gpus may not contradict).
        Edit("rollout-gpus-deprecated", {"rollout": {"engines": None, "gpus": 2}}),
        Edit("rollout-image-resources", {"rollout": {
            "image": "ghcr.io/rljob/rollout:0.1.1",
            "resources": {"requests": {"cpu": "1", "memory": "4Gi"},
                          "limits": {"memory": "8Gi"}}}}),
        Edit("scheduling", {"scheduling": {
            "nodeSelector": {POOL_LABEL: pool, ZONE_LABEL: "a"},
            "tolerations": [{"key": "rljob.io/test-taint", "operator": "Exists",
                             "effect": "NoSchedule"}],
            "priorityClassName": priority_class}}),
        Edit("megatron-args", {"trainer": {"megatronArgs": ["--use-flash-attn"]}}),
        Edit("sglang-args-and-sampling", {"rollout": {
            "sglangArgs": {"mem-fraction-static": "0.7"},
            "sampling": {"temperature": 0.7, "topP": 0.9, "topK": 50, "maxNewTokens": 256,
                         "stop": ["</answer>"]}}}),
        Edit("partial-rollout", {"rollout": {"partialRollout": {
            "enabled": True, "overSampling": 8, "maskOffPolicyTokens": True}}}),
        Edit("async-rollout", {"rollout": {"mode": "async", "maxStaleness": 2}}),
        Edit("algorithm", {"algorithm": {
            "rolloutBatchSize": 64, "nSamplesPerPrompt": 4, "globalBatchSize": 128,
            "stepsPerRollout": 2, "microBatchSize": 16, "totalSteps": 200, "lr": 2e-6,
            "criticLr": 2e-5, "weightDecay": 0.01, "maxGradNorm": 0.5, "clipEps": 0.1,
            "clipEpsHigh": 0.3, "klMode": "reward", "klCoef": 0.05, "entropyCoef": 0.001,
            "gamma": 0.99, "lam": 0.95, "logprobChunkTokens": 512,
            "maxConsecutiveNonfinite": 5, "gspo": {"clipEps": 2e-4, "clipEpsHigh": 5e-4},
            "tis": {"enabled": True, "cap": 3.0}, "oldLogprobs": "trainer",
            "dynamicSampling": {"enabled": True, "maxRounds": 3}}}),
        Edit("data", {"data": {"promptKey": "question", "labelKey": "answer"}}),
        Edit("eval", {"eval": {"dataset": "builtin:reverse", "interval": 5,
                               "samplesPerPrompt": 4, "maxNewTokens": 16}}),
        Edit("eval-greedy", {"eval": {"greedy": True, "samplesPerPrompt": 1}}),
        Edit("hooks", {"reward": {"function": "my_rewards:score"},
                       "generate": {"function": "my_generate:generate"}}),
        Edit("checkpoint", {"checkpoint": {"interval": 5, "keepLast": 4, "format": "hf"}}),
        Edit("weight-sync", {"weightSync": {"mode": "disk", "verifyDigest": False,
                                            "scanNonfinite": False, "ackTimeoutSeconds": 600}}),
        Edit("weight-sync-bucket", {"weightSync": {"bucketSizeMb": 256}}),
        Edit("tracking", {"tracking": {
            "tensorboard": {"enabled": True, "logDir": "/checkpoints/tensorboard/rl"},
            "wandb": {"enabled": True, "project": "rl", "entity": "team-a", "mode": "online",
                      "dir": "/checkpoints/wandb"},
            "mlflow": {"enabled": True, "trackingUri": "http://mlflow.team-a:5000",
                       "experimentName": "rl"},
            "envSecret": "rl-trackers"}}),
    ]
