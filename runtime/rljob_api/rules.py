"""Cross-field rules, each written once as CEL (for the API server) and once in Python.

The CRD generator places every rule's CEL at its `at` path as `x-kubernetes-validations`
(`ROOT_RULES`, on `metadata.name`, at the root of the schema: the only place Kubernetes lets
CEL read the object's name); `rljob validate` runs the Python twin on the defaulted spec and
the operator runs the same twins before it builds anything. All give the same message, and
the control-plane tests check that the API server and Python agree rule by rule and over
generated specs (tests/apiserver/test_admission_parity.py).
Python twins take plain camelCase dicts (the same view CEL has), so they still run when
an unrelated field failed type validation.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rljob_api.mutability import FIELD_EFFECTS, Effect, FieldEffect
from rljob_api.spec import (
    BUILTIN_TINY,
    COLOCATED_IMAGE,
    GROUP_BASELINE_ESTIMATORS,
    IMAGE_VERSION,
    TRAINER_IMAGE,
    RLJobSpec,
)

Obj = dict[str, Any]

# SGLang server arguments that rljob sets itself; a user value would break the wiring.
RESERVED_SGLANG_ARGS = (
    # The job's peer key: engines serve only the job's own processes.
    "api-key",
    "host",
    "port",
    "model-path",
    "tokenizer-path",
    "tp-size",
    "tensor-parallel-size",
    "dp-size",
    "data-parallel-size",
    "nccl-port",
    "base-gpu-id",
    "dist-init-addr",
    "nnodes",
    "node-rank",
)


@dataclass(frozen=True)
class Rule:
    """A rule on the object at `at` (path below `spec`); `check` returns True when it holds."""

    at: tuple[str, ...]
    cel: str
    message: str
    check: Callable[[Mapping[str, Any]], bool]  # on the defaulted object, camelCase
    field_path: str | None = None


@dataclass(frozen=True)
class TransitionRule:
    """A rule comparing the object at `at` before (`oldSelf`) and after (`self`) an update."""

    at: tuple[str, ...]
    cel: str
    message: str
    check: Callable[[Obj, Obj], bool]


def _quoted(names: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


# KubeRay (v1.5, utils.ValidateRayClusterMetadata) refuses a RayCluster whose name is longer
# than this or is no DNS-1035 label, and the job's RayCluster carries the job's name: a job
# whose name breaks either would be admitted and never get a cluster.
MAX_JOB_NAME = 53
DNS_1035_LABEL = "^[a-z]([-a-z0-9]*[a-z0-9])?$"

# The built-in tiny model's shape, checked again where it is built (rljob.model.tiny_model).
TINY_SHAPE_MESSAGE = (
    "spec.model.tiny.hiddenSize must be a multiple of 2 × numHeads (each head's width, "
    "hiddenSize / numHeads, must be even for the rotary position embedding); change "
    "hiddenSize or numHeads"
)

# The engines' slots (GPUs, or CPU slots) of `self.rollout`, whichever of engines and the
# deprecated gpus the spec sets (`RolloutSpec.engine_slots`; the rollout rules below refuse
# the two where they disagree): engines × gpusPerEngine, gpus, or one engine's gpusPerEngine.
ENGINE_SLOTS_CEL = (
    "(has(self.rollout.engines) ? self.rollout.engines * self.rollout.gpusPerEngine : "
    "has(self.rollout.gpus) ? self.rollout.gpus : self.rollout.gpusPerEngine)"
)


def engine_slots(rollout: Mapping[str, Any]) -> int:
    """ENGINE_SLOTS_CEL's Python twin, on the camelCase view of spec.rollout."""
    if rollout.get("engines") is not None:
        return int(rollout["engines"] * rollout["gpusPerEngine"])
    if rollout.get("gpus") is not None:
        return int(rollout["gpus"])
    return int(rollout["gpusPerEngine"])


# Rules on the whole object (`self` is the RLJob; `at` is always the root). The API server
# lets CEL read `self.metadata.name` only here.
ROOT_RULES: tuple[Rule, ...] = (
    Rule(
        at=(),
        cel=f"size(self.metadata.name) <= {MAX_JOB_NAME}",
        message=f"metadata.name must be at most {MAX_JOB_NAME} characters: the job's "
        "RayCluster carries its name and KubeRay refuses longer ones; recreate the job with a "
        "shorter name",
        check=lambda doc: len(doc["metadata"]["name"]) <= MAX_JOB_NAME,
    ),
    Rule(
        at=(),
        cel=f"self.metadata.name.matches('{DNS_1035_LABEL}')",
        message="metadata.name must be a DNS-1035 label (lower-case letters, digits and '-', "
        "starting with a letter and ending with a letter or digit): the job's RayCluster and "
        "its Services carry the name, and KubeRay refuses any other; recreate the job with "
        "such a name",
        check=lambda doc: re.fullmatch(DNS_1035_LABEL, doc["metadata"]["name"]) is not None,
    ),
)


RULES: tuple[Rule, ...] = (
    Rule(
        at=("model",),
        cel=f"self.source != '{BUILTIN_TINY}' || "
        "self.tiny.hiddenSize % (2 * self.tiny.numHeads) == 0",
        message=TINY_SHAPE_MESSAGE,
        check=lambda m: (
            m["source"] != BUILTIN_TINY
            or m["tiny"]["hiddenSize"] % (2 * m["tiny"]["numHeads"]) == 0
        ),
        field_path=".tiny.hiddenSize",
    ),
    Rule(
        at=("algorithm",),
        cel="self.rolloutBatchSize * self.nSamplesPerPrompt == "
        "self.globalBatchSize * self.stepsPerRollout",
        message="spec.algorithm: rolloutBatchSize × nSamplesPerPrompt must equal "
        "globalBatchSize × stepsPerRollout (every generated sample is trained on exactly "
        "once); change globalBatchSize or stepsPerRollout to match",
        check=lambda a: (
            a["rolloutBatchSize"] * a["nSamplesPerPrompt"]
            == a["globalBatchSize"] * a["stepsPerRollout"]
        ),
        field_path=".globalBatchSize",
    ),
    Rule(
        at=("algorithm",),
        cel="self.globalBatchSize % self.microBatchSize == 0",
        message="spec.algorithm.globalBatchSize must be a multiple of microBatchSize; "
        "lower microBatchSize to a divisor of globalBatchSize",
        check=lambda a: a["globalBatchSize"] % a["microBatchSize"] == 0,
        field_path=".microBatchSize",
    ),
    Rule(
        at=("algorithm",),
        cel="!has(self.clipEpsHigh) || self.clipEpsHigh >= self.clipEps",
        message="spec.algorithm.clipEpsHigh must be >= clipEps; raise it or leave it unset",
        check=lambda a: a.get("clipEpsHigh") is None or a["clipEpsHigh"] >= a["clipEps"],
        field_path=".clipEpsHigh",
    ),
    Rule(
        at=("algorithm",),
        cel="!self.tis.enabled || !has(self.oldLogprobs) || self.oldLogprobs != 'rollout'",
        message="spec.algorithm.tis weighs each token by the trainer's log-prob over the "
        "engine's, and oldLogprobs rollout already takes the engine's as the old policy, so "
        "the two corrections would be applied together; set oldLogprobs trainer (or leave it "
        "unset), or tis.enabled false",
        check=lambda a: not a["tis"]["enabled"] or a.get("oldLogprobs") != "rollout",
        field_path=".oldLogprobs",
    ),
    Rule(
        at=("algorithm",),
        cel="!self.dynamicSampling.enabled || self.nSamplesPerPrompt >= 2",
        message="spec.algorithm.dynamicSampling needs nSamplesPerPrompt >= 2 (a group of one "
        "response always has equal rewards, so every group would be dropped); raise "
        "nSamplesPerPrompt or set dynamicSampling.enabled false",
        check=lambda a: not a["dynamicSampling"]["enabled"] or a["nSamplesPerPrompt"] >= 2,
        field_path=".dynamicSampling",
    ),
    Rule(
        at=("algorithm",),
        cel=f"!self.dynamicSampling.enabled || self.estimator in "
        f"{_quoted(GROUP_BASELINE_ESTIMATORS)}",
        message="spec.algorithm.dynamicSampling drops groups whose rewards are all equal, "
        "which carry no gradient only under a group-normalised advantage; use estimator "
        + ", ".join(GROUP_BASELINE_ESTIMATORS)
        + ", or set dynamicSampling.enabled false",
        check=lambda a: (
            not a["dynamicSampling"]["enabled"] or a["estimator"] in GROUP_BASELINE_ESTIMATORS
        ),
        field_path=".dynamicSampling",
    ),
    Rule(
        at=("rollout",),
        cel="!has(self.gpus) || self.gpus % self.gpusPerEngine == 0",
        message="spec.rollout.gpus must be a multiple of spec.rollout.gpusPerEngine; "
        "set gpus to engines × gpusPerEngine",
        check=lambda r: r.get("gpus") is None or r["gpus"] % r["gpusPerEngine"] == 0,
        field_path=".gpus",
    ),
    Rule(
        at=("rollout",),
        cel="!has(self.gpus) || !has(self.engines) || "
        "self.gpus == self.engines * self.gpusPerEngine",
        message="spec.rollout.gpus (deprecated) and spec.rollout.engines disagree: gpus must "
        "equal engines × gpusPerEngine; remove spec.rollout.gpus and keep engines (on an "
        "existing job: kubectl patch rljob NAME --type=json "
        "-p '[{\"op\": \"remove\", \"path\": \"/spec/rollout/gpus\"}]')",
        check=lambda r: (
            r.get("gpus") is None or r.get("engines") is None
            or r["gpus"] == r["engines"] * r["gpusPerEngine"]
        ),
        field_path=".gpus",
    ),
    Rule(
        at=("rollout",),
        cel=f"!has(self.sglangArgs) || self.sglangArgs.all(k, !(k in "
        f"{_quoted(RESERVED_SGLANG_ARGS)}))",
        message="spec.rollout.sglangArgs must not set "
        + ", ".join(RESERVED_SGLANG_ARGS)
        + ": rljob sets them (tensor parallel size comes from gpusPerEngine); remove them",
        check=lambda r: not any(k in RESERVED_SGLANG_ARGS for k in r.get("sglangArgs") or {}),
        field_path=".sglangArgs",
    ),
    Rule(
        at=("trainer",),
        cel="self.backend != 'megatron' || self.gpusPerReplica >= 1",
        message="spec.trainer.backend megatron needs gpusPerReplica >= 1; "
        "use backend torch to train on CPU",
        check=lambda t: t["backend"] != "megatron" or t["gpusPerReplica"] >= 1,
        field_path=".gpusPerReplica",
    ),
    Rule(
        at=("trainer",),
        cel="self.backend != 'megatron' || (self.parallelism.tensor == 1 && "
        "self.parallelism.pipeline == 1 && self.parallelism.context == 1)",
        message="spec.trainer.parallelism: the megatron backend needs tensor, pipeline and "
        "context 1 (it publishes the engines' weights from trainer rank 0 alone, without "
        "gathering them across model-parallel ranks); set them to 1: every trainer GPU "
        "(replicas × gpusPerReplica) is then a data-parallel rank",
        check=lambda t: t["backend"] != "megatron" or (
            t["parallelism"]["tensor"] == 1
            and t["parallelism"]["pipeline"] == 1
            and t["parallelism"]["context"] == 1
        ),
        field_path=".parallelism",
    ),
    Rule(
        at=(),
        cel="self.trainer.backend != 'megatron' || self.algorithm.estimator != 'ppo'",
        message="spec.algorithm.estimator ppo needs a critic, which the megatron backend does "
        "not train; use grpo, gspo, cispo, reinforce++ or reinforce++_baseline, or "
        "spec.trainer.backend torch",
        check=lambda s: (
            s["trainer"]["backend"] != "megatron" or s["algorithm"]["estimator"] != "ppo"
        ),
        field_path=".algorithm.estimator",
    ),
    Rule(
        at=(),
        cel=f"self.placement != 'colocated' || "
        f"{ENGINE_SLOTS_CEL} == self.trainer.replicas * self.trainer.gpusPerReplica",
        message="spec.placement colocated: spec.rollout.engines × gpusPerEngine must equal "
        "spec.trainer.replicas × spec.trainer.gpusPerReplica (trainer and rollout share the "
        "same GPUs); match them or use placement disaggregated",
        check=lambda s: (
            s["placement"] != "colocated"
            or engine_slots(s["rollout"])
            == s["trainer"]["replicas"] * s["trainer"]["gpusPerReplica"]
        ),
        field_path=".rollout.engines",
    ),
    Rule(
        at=(),
        cel="self.placement != 'colocated' || self.rollout.backend != 'sglang' || "
        f"!(self.trainer.image.startsWith('{TRAINER_IMAGE}:') || "
        f"self.trainer.image.startsWith('{TRAINER_IMAGE}@'))",
        message="spec.placement colocated: the engines start in the trainer's pods, from "
        f"spec.trainer.image, and the trainer image {TRAINER_IMAGE} has no SGLang; set "
        f"spec.trainer.image to {COLOCATED_IMAGE}:{IMAGE_VERSION} (images/Dockerfile "
        "ROLE=colocated) or an image of your own with both, or use rollout.backend hf",
        check=lambda s: (
            s["placement"] != "colocated" or s["rollout"]["backend"] != "sglang"
            or not s["trainer"]["image"].startswith((f"{TRAINER_IMAGE}:", f"{TRAINER_IMAGE}@"))
        ),
        field_path=".trainer.image",
    ),
    Rule(
        at=(),
        cel="self.placement == 'disaggregated' || "
        "self.trainer.gpusPerReplica % self.rollout.gpusPerEngine == 0",
        message="spec.placement colocated: spec.trainer.gpusPerReplica must be a multiple of "
        "spec.rollout.gpusPerEngine (an engine cannot span two pods); change either, or use "
        "placement disaggregated",
        check=lambda s: (
            s["placement"] == "disaggregated"
            or s["trainer"]["gpusPerReplica"] % s["rollout"]["gpusPerEngine"] == 0
        ),
        field_path=".rollout.gpusPerEngine",
    ),
    Rule(
        at=(),
        cel="self.rollout.mode != 'async' || self.placement != 'colocated'",
        message="spec.rollout.mode async generates while the trainer trains, which colocated "
        "placement cannot do: the engines give their GPUs to the trainer while it trains; use "
        "rollout.mode sync or placement disaggregated",
        check=lambda s: s["rollout"]["mode"] != "async" or s["placement"] != "colocated",
        field_path=".rollout.mode",
    ),
    Rule(
        at=("rollout",),
        cel="self.mode == 'async' || !has(self.maxStaleness)",
        message="spec.rollout.maxStaleness bounds how far async generation lags the trainer; "
        "a sync rollout never lags: set rollout.mode async or remove maxStaleness",
        check=lambda r: r["mode"] == "async" or r.get("maxStaleness") is None,
        field_path=".maxStaleness",
    ),
    Rule(
        at=("rollout",),
        cel="!self.partialRollout.enabled || self.mode != 'async' || "
        "(has(self.maxStaleness) && self.maxStaleness >= 2)",
        message="spec.rollout.partialRollout with mode async needs maxStaleness >= 2: a "
        "generation carried to the next step is trained two versions after it began, so "
        "under the default bound of 1 every carried group would be dropped; set "
        "rollout.maxStaleness 2 or more, or partialRollout.enabled false",
        check=lambda r: (not r["partialRollout"]["enabled"] or r["mode"] != "async"
                         or (r.get("maxStaleness") or 1) >= 2),
        field_path=".maxStaleness",
    ),
    Rule(
        at=("rollout", "partialRollout"),
        cel="self.enabled || (!has(self.overSampling) && !self.maskOffPolicyTokens)",
        message="spec.rollout.partialRollout.overSampling and maskOffPolicyTokens act only "
        "with partialRollout.enabled true; set enabled true, or remove them",
        check=lambda p: p["enabled"] or (p.get("overSampling") is None
                                          and not p["maskOffPolicyTokens"]),
        field_path=".enabled",
    ),
    Rule(
        at=("eval",),
        cel="self.interval == 0 || has(self.dataset)",
        message="spec.eval.interval > 0 needs spec.eval.dataset (the held-out prompts to "
        "evaluate on); set eval.dataset, or eval.interval 0 to disable evaluation",
        check=lambda e: e["interval"] == 0 or e.get("dataset") is not None,
        field_path=".dataset",
    ),
    Rule(
        at=("eval",),
        cel="!has(self.dataset) || self.interval > 0",
        message="spec.eval.dataset is set but eval.interval is 0, so it would never be "
        "evaluated; set eval.interval (rollout steps between evaluations), or remove "
        "eval.dataset",
        check=lambda e: e.get("dataset") is None or e["interval"] > 0,
        field_path=".interval",
    ),
    Rule(
        at=("eval",),
        cel="!self.greedy || self.samplesPerPrompt == 1",
        message="spec.eval.greedy decodes one deterministic response per prompt, so "
        "samplesPerPrompt > 1 would repeat it; set eval.samplesPerPrompt 1, or eval.greedy "
        "false to sample several responses with spec.rollout.sampling",
        check=lambda e: not e["greedy"] or e["samplesPerPrompt"] == 1,
        field_path=".samplesPerPrompt",
    ),
    Rule(
        at=("recovery",),
        cel="self.maxBackoffSeconds >= self.backoffSeconds",
        message="spec.recovery.maxBackoffSeconds must be >= backoffSeconds; raise it",
        check=lambda r: r["maxBackoffSeconds"] >= r["backoffSeconds"],
        field_path=".maxBackoffSeconds",
    ),
)

_DEFAULTS: Obj = RLJobSpec().model_dump(by_alias=True, mode="json")


def _default_at(parts: tuple[str, ...]) -> Any:
    value: Any = _DEFAULTS
    for part in parts:
        value = value[part]
    return value


def _transition(entry: FieldEffect) -> TransitionRule:
    """The API server's check that an immutable field keeps its value: a section at its own
    level (`self == oldSelf`), a field on its parent object; an optional field (no default)
    must also stay set or unset."""
    *parent, leaf = entry.parts
    message = entry.immutable_message()
    if not parent and isinstance(_default_at(entry.parts), dict):
        return TransitionRule(at=entry.parts, cel="self == oldSelf", message=message,
                              check=lambda old, new: old == new)
    if _default_at(entry.parts) is None:
        cel = (f"has(self.{leaf}) == has(oldSelf.{leaf}) && "
               f"(!has(self.{leaf}) || self.{leaf} == oldSelf.{leaf})")
    else:
        cel = f"self.{leaf} == oldSelf.{leaf}"

    def unchanged(old: Obj, new: Obj) -> bool:
        return bool(old.get(leaf) == new.get(leaf))

    return TransitionRule(at=tuple(parent), cel=cel, message=message, check=unchanged)


# One rule per immutable field of rljob_api.mutability, so the API server, `rljob validate`
# and the docs all refuse the same edits with the same words.
TRANSITION_RULES: tuple[TransitionRule, ...] = tuple(
    _transition(entry) for entry in FIELD_EFFECTS if entry.effect == Effect.immutable
)


# -- where each check is enforced -------------------------------------------------------------

ADMISSION, VALIDATE, OPERATOR, RUNTIME = "admission", "validate", "operator", "runtime"


@dataclass(frozen=True)
class Enforced:
    """One check made before a job does any work, where it is made, and why not at admission
    when it is not (docs/reference.md renders these as its enforcement table)."""

    check: str
    where: tuple[str, ...]
    why_not_admission: str = ""


# Checks the API server cannot make: each needs something CEL on the RLJob cannot read.
NOT_AT_ADMISSION: tuple[Enforced, ...] = (
    Enforced("spec.checkpoint.pvc must allow ReadWriteMany (every pod writes or reads the "
             "checkpoints)", (OPERATOR,),
             "it is a property of the PersistentVolumeClaim, another object"),
    Enforced("the names of the job's children must not be taken by objects the job does not "
             "own", (OPERATOR,), "it depends on other objects in the namespace"),
    Enforced("spec.trainer.backend megatron needs a GPU per trainer rank in the Ray cluster "
             "and megatron-core in the image", (RUNTIME,),
             "it depends on the machine or image the job runs on (`rljob run` on a laptop; on "
             "Kubernetes spec.trainer.gpusPerReplica >= 1 is checked at admission)"),
    Enforced("a CPU weight-sync staging must fit the free room of /dev/shm", (RUNTIME,),
             "it depends on the pod's memory and what else holds /dev/shm when the sidecar "
             "starts"),
)


def enforcement() -> tuple[Enforced, ...]:
    """Every check made before any work: the schema, each rule of this module (the API
    server, `rljob validate --old` for edits, the operator's parse_job and `rljob run`'s
    load_job all evaluate the same ones), and those only the operator or the runtime can
    make."""
    everywhere = (ADMISSION, VALIDATE, OPERATOR, RUNTIME)
    schema = Enforced("the schema: types, bounds, enums, patterns, unknown fields "
                      "(docs/reference.md, spec)", everywhere)
    rules = tuple(Enforced(r.message, everywhere) for r in (*ROOT_RULES, *RULES))
    edits = tuple(Enforced(t.message, (ADMISSION, VALIDATE)) for t in TRANSITION_RULES)
    return (schema, *rules, *edits, *NOT_AT_ADMISSION)
