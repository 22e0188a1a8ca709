"""Shared RLJob fixtures: a valid base job, a table of bad variants (one per rule) and a
table of refused edits (one per immutable field).

The same tables drive the Python validator tests and the API-server admission tests, so the
two implementations of every rule are checked against each other.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import yaml

from rljob_api.mutability import FIELD_EFFECTS
from rljob_api.rules import RULES, TRANSITION_RULES, Rule, TransitionRule
from tests.controlplane import REPO

BASE_FILE = REPO / "examples" / "tiny-cpu.yaml"


def base_job(name: str = "tiny") -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(BASE_FILE.read_text())
    doc["metadata"] = {"name": name}
    return doc


def rule_message(cel_fragment: str) -> str:
    """The message of the one rule whose CEL contains `cel_fragment`."""
    rules: list[Rule | TransitionRule] = [*RULES, *TRANSITION_RULES]
    (msg,) = [r.message for r in rules if cel_fragment in r.cel]
    return msg


@dataclass(frozen=True)
class BadSpec:
    id: str
    changes: dict[str, Any]  # dotted path under spec -> value
    field: str  # the field every error must name
    message: str | None = None  # exact rule message, for CEL rules

    def apply_to(self, doc: dict[str, Any]) -> dict[str, Any]:
        doc = copy.deepcopy(doc)
        for path, value in self.changes.items():
            node = doc["spec"]
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return doc


BAD_SPECS: list[BadSpec] = [
    BadSpec(
        "batch-rule",
        {"algorithm.globalBatchSize": 96},
        "spec.algorithm",
        rule_message("self.rolloutBatchSize * self.nSamplesPerPrompt"),
    ),
    BadSpec(
        "micro-batch",
        {"algorithm.microBatchSize": 24},
        "spec.algorithm",
        rule_message("self.globalBatchSize % self.microBatchSize"),
    ),
    BadSpec(
        "clip-high",
        {"algorithm.clipEpsHigh": 0.1},
        "spec.algorithm",
        rule_message("self.clipEpsHigh >= self.clipEps"),
    ),
    BadSpec(
        "rollout-gpus",
        {"rollout.engines": None, "rollout.gpus": 3, "rollout.gpusPerEngine": 2},
        "spec.rollout",
        rule_message("self.gpus % self.gpusPerEngine"),
    ),
    BadSpec(
        "rollout-gpus-disagree-with-engines",
        {"rollout.engines": 2, "rollout.gpus": 4, "rollout.gpusPerEngine": 1},
        "spec.rollout",
        rule_message("self.gpus == self.engines * self.gpusPerEngine"),
    ),
    BadSpec(
        "sglang-owned-arg",
        {"rollout.sglangArgs": {"port": "30000"}},
        "spec.rollout",
        rule_message("self.sglangArgs.all"),
    ),
    BadSpec(
        "megatron-cpu",
        {"trainer.backend": "megatron"},
        "spec.trainer",
        rule_message("self.gpusPerReplica >= 1"),
    ),
    BadSpec(
        "megatron-model-parallel",
        {"trainer.backend": "megatron", "trainer.gpusPerReplica": 8,
         "trainer.parallelism": {"tensor": 2, "pipeline": 2}},
        "spec.trainer",
        rule_message("self.parallelism.tensor"),
    ),
    BadSpec(
        "megatron-ppo",
        {"trainer.backend": "megatron", "trainer.gpusPerReplica": 1,
         "algorithm.estimator": "ppo"},
        "spec",
        rule_message("self.algorithm.estimator != 'ppo'"),
    ),
    BadSpec(
        "colocated-gpus",
        {"placement": "colocated", "trainer.gpusPerReplica": 2},
        "spec",
        rule_message("== self.trainer.replicas * self.trainer.gpusPerReplica"),
    ),
    BadSpec(
        "colocated-engine-spans-pods",
        {"placement": "colocated", "trainer.replicas": 2, "trainer.gpusPerReplica": 2,
         "rollout.engines": 1, "rollout.gpusPerEngine": 4},
        "spec",
        rule_message("self.trainer.gpusPerReplica % self.rollout.gpusPerEngine"),
    ),
    BadSpec(
        "colocated-sglang-in-the-trainer-image",
        {"placement": "colocated", "trainer.gpusPerReplica": 1, "rollout.backend": "sglang"},
        "spec",
        rule_message("self.trainer.image.startsWith("),
    ),
    BadSpec(
        "async-colocated",
        {"placement": "colocated", "rollout.mode": "async"},
        "spec",
        rule_message("self.rollout.mode != 'async'"),
    ),
    BadSpec(
        "staleness-without-async",
        {"rollout.maxStaleness": 2},
        "spec.rollout",
        rule_message("!has(self.maxStaleness)"),
    ),
    BadSpec(
        "partial-async-bound-1",
        {"rollout.mode": "async", "rollout.partialRollout": {"enabled": True}},
        "spec.rollout",
        rule_message("self.partialRollout.enabled"),
    ),
    BadSpec(
        "partial-options-without-enabled",
        {"rollout.partialRollout": {"overSampling": 3}},
        "spec.rollout.partialRollout",
        rule_message("!has(self.overSampling)"),
    ),
    BadSpec(
        "eval-dataset-without-interval",
        {"eval.dataset": "builtin:reverse"},
        "spec.eval",
        rule_message("self.interval > 0"),
    ),
    BadSpec("staleness-zero", {"rollout.mode": "async", "rollout.maxStaleness": 0},
            "spec.rollout.maxStaleness"),
    BadSpec(
        "backoff",
        {"recovery.backoffSeconds": 60, "recovery.maxBackoffSeconds": 30},
        "spec.recovery",
        rule_message("self.maxBackoffSeconds >= self.backoffSeconds"),
    ),
    BadSpec(
        "tis-with-rollout-old-logprobs",
        {"algorithm.tis": {"enabled": True}, "algorithm.oldLogprobs": "rollout"},
        "spec.algorithm",
        rule_message("self.oldLogprobs != 'rollout'"),
    ),
    BadSpec(
        "dynamic-sampling-one-sample",
        {"algorithm.dynamicSampling": {"enabled": True}, "algorithm.nSamplesPerPrompt": 1,
         "algorithm.rolloutBatchSize": 128},
        "spec.algorithm",
        rule_message("self.nSamplesPerPrompt >= 2"),
    ),
    BadSpec(
        "dynamic-sampling-estimator",
        {"algorithm.dynamicSampling": {"enabled": True}, "algorithm.estimator": "reinforce++"},
        "spec.algorithm",
        rule_message("self.estimator in"),
    ),
    BadSpec(
        "dynamic-sampling-baseline-estimator",
        {"algorithm.dynamicSampling": {"enabled": True},
         "algorithm.estimator": "reinforce++_baseline"},
        "spec.algorithm",
        rule_message("self.estimator in"),
    ),
    BadSpec(
        "eval-interval-without-dataset",
        {"eval.interval": 5},
        "spec.eval",
        rule_message("self.interval == 0 || has(self.dataset)"),
    ),
    BadSpec(
        "eval-greedy-several-samples",
        {"eval.dataset": "builtin:arithmetic", "eval.interval": 5, "eval.greedy": True,
         "eval.samplesPerPrompt": 4},
        "spec.eval",
        rule_message("self.samplesPerPrompt == 1"),
    ),
    BadSpec("eval-samples-positive", {"eval.samplesPerPrompt": 0}, "spec.eval.samplesPerPrompt"),
    BadSpec("tis-cap", {"algorithm.tis": {"enabled": True, "cap": 0.5}},
            "spec.algorithm.tis.cap"),
    BadSpec("dynamic-sampling-rounds", {"algorithm.dynamicSampling": {"maxRounds": 1}},
            "spec.algorithm.dynamicSampling.maxRounds"),
    BadSpec("partial-rollout-over-sampling", {"rollout.partialRollout": {"overSampling": 0}},
            "spec.rollout.partialRollout.overSampling"),
    BadSpec("lr-positive", {"algorithm.lr": 0}, "spec.algorithm.lr"),
    BadSpec("clip-range", {"algorithm.clipEps": 1.5}, "spec.algorithm.clipEps"),
    BadSpec(
        "temperature", {"rollout.sampling.temperature": 0}, "spec.rollout.sampling.temperature"
    ),
    BadSpec("count-positive", {"trainer.replicas": 0}, "spec.trainer.replicas"),
    BadSpec("estimator-enum", {"algorithm.estimator": "dpo"}, "spec.algorithm.estimator"),
    BadSpec("trainer-backend-enum", {"trainer.backend": "jax"}, "spec.trainer.backend"),
    BadSpec("rollout-backend-enum", {"rollout.backend": "vllm"}, "spec.rollout.backend"),
    BadSpec("placement-enum", {"placement": "spread"}, "spec.placement"),
    BadSpec("weight-sync-enum", {"weightSync.mode": "rdma"}, "spec.weightSync.mode"),
    BadSpec("wrong-type", {"algorithm.lr": "fast"}, "spec.algorithm.lr"),
    BadSpec("unknown-field", {"trainer.gpuCount": 4}, "spec.trainer.gpuCount"),
]


def immutable_message(path: str) -> str:
    """The API server's (and `rljob validate`'s) message refusing an edit of `path`."""
    (msg,) = [e.immutable_message() for e in FIELD_EFFECTS if e.path == path]
    return msg


@dataclass(frozen=True)
class BadUpdate:
    """An edit of an existing job that both the API server and `update_problems` refuse."""

    id: str
    changes: dict[str, Any]  # dotted path under spec -> new value
    message: str  # the one rule message both must give
    before: dict[str, Any] = field(default_factory=dict)  # set at creation, if anything

    def docs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The job as created, and as edited."""
        created = BadSpec(self.id, self.before, "").apply_to(base_job(f"upd-{self.id}"))
        return created, BadSpec(self.id, self.changes, "").apply_to(created)


# One per immutable field of rljob_api.mutability (a unit test checks none is missing).
BAD_UPDATES: list[BadUpdate] = [
    BadUpdate("model", {"model.dtype": "bfloat16"}, immutable_message("model")),
    BadUpdate("trainer-backend", {"trainer.backend": "megatron", "trainer.gpusPerReplica": 1},
              immutable_message("trainer.backend")),
    BadUpdate("trainer-parallelism", {"trainer.parallelism": {"tensor": 2}},
              immutable_message("trainer.parallelism")),
    BadUpdate("rollout-backend", {"rollout.backend": "sglang"},
              immutable_message("rollout.backend")),
    BadUpdate("plan-only", {"planOnly": True}, immutable_message("planOnly")),
    BadUpdate("placement", {"placement": "colocated", "rollout.engines": 1,
                            "trainer.gpusPerReplica": 1}, immutable_message("placement")),
    BadUpdate("estimator", {"algorithm.estimator": "reinforce++"},
              immutable_message("algorithm.estimator")),
    BadUpdate("seed", {"algorithm.seed": 7}, immutable_message("algorithm.seed")),
    BadUpdate("dataset", {"data.dataset": "builtin:reverse"},
              immutable_message("data.dataset")),
    BadUpdate("data-pvc-set", {"data.pvc": "prompts"}, immutable_message("data.pvc")),
    BadUpdate("shuffle", {"data.shuffle": False}, immutable_message("data.shuffle")),
    BadUpdate("checkpoint-pvc-set", {"checkpoint.pvc": "team-nfs"},
              immutable_message("checkpoint.pvc")),
    BadUpdate("checkpoint-pvc-changed", {"checkpoint.pvc": "other-nfs"},
              immutable_message("checkpoint.pvc"), before={"checkpoint.pvc": "team-nfs"}),
    BadUpdate("checkpoint-size", {"checkpoint.size": "20Gi"},
              immutable_message("checkpoint.size")),
    BadUpdate("storage-class-set", {"checkpoint.storageClassName": "nfs"},
              immutable_message("checkpoint.storageClassName")),
    BadUpdate("checkpoint-path", {"checkpoint.path": "/ckpt"},
              immutable_message("checkpoint.path")),
    BadUpdate("queue-set", {"scheduling.queue": "team-a"},
              immutable_message("scheduling.queue")),
]
