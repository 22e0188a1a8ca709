"""The RLJob spec: what a user writes.

Every field has a type, a bound where one makes sense, a default and a description; the
CRD schema, the docs table and the Python validator are all generated from these classes,
so this file is the only place a field is declared.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic.alias_generators import to_camel

# Bounded strings keep CEL's cost estimator happy and reject runaway input early.
Name = Annotated[str, StringConstraints(min_length=1, max_length=253)]
ShortText = Annotated[str, StringConstraints(max_length=253)]
Path = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
Image = Annotated[str, StringConstraints(min_length=1, max_length=512)]
# Kubernetes' own quantity syntax (apimachinery resource.Quantity, as kubebuilder writes it
# into CRDs): a value the API server would refuse in the pods' resources is refused here,
# at the RLJob's admission, instead of when the operator makes the pods.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
Quantity = int | Annotated[str, StringConstraints(max_length=64, pattern=QUANTITY_PATTERN)]

# The project's images (images/Dockerfile, one per ROLE) and the version the defaults name.
IMAGE_VERSION = "0.1.0"
TRAINER_IMAGE = "ghcr.io/rljob/trainer"
ROLLOUT_IMAGE = "ghcr.io/rljob/rollout"
COLOCATED_IMAGE = "ghcr.io/rljob/colocated"
ImportPath = Annotated[
    str,
    StringConstraints(
        max_length=512,
        pattern=r"^(builtin:[a-z0-9-]+|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$",
    ),
]


class ApiModel(BaseModel):
    """Base of every API class: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=True,
        validate_default=True,
    )


class TrainerBackend(str, Enum):
    megatron = "megatron"
    torch = "torch"


class RolloutBackend(str, Enum):
    sglang = "sglang"
    hf = "hf"


class RolloutMode(str, Enum):
    sync = "sync"
    async_ = "async"


class OldLogprobs(str, Enum):
    trainer = "trainer"
    rollout = "rollout"


class Placement(str, Enum):
    colocated = "colocated"
    disaggregated = "disaggregated"


class Estimator(str, Enum):
    grpo = "grpo"
    gspo = "gspo"
    cispo = "cispo"
    ppo = "ppo"
    reinforce_pp = "reinforce++"
    reinforce_pp_baseline = "reinforce++_baseline"


# Estimators whose advantage is the group-normalised reward alone: a group whose rewards are
# all equal gets zero advantage on every token, which is what dynamic sampling drops.
# reinforce++_baseline is not one: its batch whitening subtracts the mean over tokens, so an
# equal-reward group of responses of other lengths than the batch's still has an advantage.
GROUP_BASELINE_ESTIMATORS = ("grpo", "gspo", "cispo")


class KLMode(str, Enum):
    loss = "loss"
    reward = "reward"
    none = "none"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class WeightSyncMode(str, Enum):
    nccl_broadcast = "nccl-broadcast"
    disk = "disk"


class FailureKind(str, Enum):
    pod_failed = "PodFailed"
    pod_deleted = "PodDeleted"
    pod_evicted = "PodEvicted"
    node_lost = "NodeLost"
    driver_failed = "DriverFailed"
    worker_lost = "WorkerLost"


class ResourceRequirements(ApiModel):
    """Kubernetes container resources; GPUs are added by the operator from the GPU counts."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict, max_length=16, description="Minimum resources, e.g. cpu: 8."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, max_length=16, description="Maximum resources, e.g. memory: 64Gi."
    )


class TinyModel(ApiModel):
    """Shape of the built-in tiny model (random init, character tokenizer)."""

    architecture: Literal["qwen2", "llama"] = Field(
        "qwen2", description="transformers architecture the tiny model is built from."
    )
    hidden_size: int = Field(64, ge=8, le=8192, description="Hidden size.")
    num_layers: int = Field(2, ge=1, le=128, description="Number of decoder layers.")
    num_heads: int = Field(4, ge=1, le=128, description="Attention heads.")
    intermediate_size: int = Field(128, ge=8, le=65536, description="MLP width.")


BUILTIN_TINY = "builtin:tiny"  # spec.model.source of the built-in tiny model


class ModelSpec(ApiModel):
    """The policy to train; immutable once the job exists."""

    source: Path = Field(
        BUILTIN_TINY,
        description=(
            "HF-format checkpoint directory (inside the pods, e.g. on `pvc`), or `builtin:tiny` "
            "for the built-in tiny model."
        ),
    )
    pvc: ShortText | None = Field(
        None, description="PersistentVolumeClaim holding `source`, mounted read-only at /model."
    )
    dtype: DType = Field(DType.bfloat16, description="Training and serving dtype.")
    tokenizer: Path | None = Field(None, description="Tokenizer path; defaults to `source`.")
    tiny: TinyModel = Field(
        default_factory=TinyModel, description="Shape of `builtin:tiny`; ignored otherwise."
    )


class Parallelism(ApiModel):
    """Megatron model parallelism; the data-parallel size is what remains.

    Kept in the API for when weight sync gathers across model-parallel ranks; until then a
    rule (`rljob_api.rules`) refuses sizes above 1 for the megatron backend at admission, so
    no job starts only to fail in the driver. The torch backend is data parallel only.
    """

    tensor: int = Field(
        1, ge=1, le=64, description="Tensor-parallel size (megatron: only 1 for now)."
    )
    pipeline: int = Field(
        1, ge=1, le=64, description="Pipeline-parallel size (megatron: only 1 for now)."
    )
    context: int = Field(
        1, ge=1, le=64, description="Context-parallel size (megatron: only 1 for now)."
    )


class TrainerSpec(ApiModel):
    """Where and how the policy is trained."""

    backend: TrainerBackend = Field(
        TrainerBackend.megatron,
        description="`megatron` (megatron-core, GPUs) or `torch` (plain PyTorch, CPU or GPU).",
    )
    replicas: int = Field(1, ge=1, le=4096, description="Trainer pods.")
    gpus_per_replica: int = Field(
        1, ge=0, le=16, description="GPUs per trainer pod (CPU slots on a machine without GPUs)."
    )
    image: Image = Field(
        f"{TRAINER_IMAGE}:{IMAGE_VERSION}",
        description="Trainer container image (the driver's too, and with placement colocated "
        "the image of the shared pods: with the sglang backend one that also holds SGLang, "
        f"such as {COLOCATED_IMAGE}:{IMAGE_VERSION}).",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Trainer pod resources besides GPUs."
    )
    megatron_args: list[Annotated[str, StringConstraints(max_length=256)]] = Field(
        default_factory=list,
        max_length=256,
        description="Extra Megatron command-line arguments, passed through verbatim.",
    )
    parallelism: Parallelism = Field(
        default_factory=Parallelism, description="Tensor/pipeline/context parallel sizes."
    )


class Sampling(ApiModel):
    """Generation settings of the rollout engines."""

    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature (> 0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(-1, ge=-1, description="Top-k cut-off; -1 disables it.")
    max_new_tokens: int = Field(512, ge=1, le=1048576, description="Longest response, in tokens.")
    stop: list[Annotated[str, StringConstraints(max_length=64)]] = Field(
        default_factory=list, max_length=16, description="Stop strings besides end-of-sequence."
    )


class PartialRolloutSpec(ApiModel):
    """Partial rollout with over-sampling (slime's): long generations stop holding a step back.

    Each rollout step starts rolloutBatchSize + `overSampling` groups at once. As soon as
    rolloutBatchSize of them are finished, the engines' requests in flight are aborted
    (SGLang's `/abort_request` with `abort_all`) and the unfinished groups are kept, with
    the tokens, log-probs and weight versions generated so far, in the rollout worker; the
    next step continues them first (prompt + partial response as the input, max_new_tokens
    reduced by what each already has), then new prompts fill the rest. Checkpoints carry
    the kept groups, so a resume loses none. A custom `spec.generate.function` must itself
    continue a sample that already holds a partial response (the built-in one does, see
    docs/hooks.md); one that regenerates from the prompt only wastes the partial tokens.
    """

    enabled: bool = Field(
        False, description="Abort unfinished generations at the step boundary and continue "
        "them in the next step."
    )
    over_sampling: int | None = Field(
        None,
        ge=1,
        le=1048576,
        description=(
            "Groups started per step beyond rolloutBatchSize; unset: max(1, "
            "rolloutBatchSize // 2)."
        ),
    )
    mask_off_policy_tokens: bool = Field(
        False,
        description=(
            "Give loss mask 0 to the response tokens a sample got from an older weight "
            "version than the one that finished it (they stay in the context, untrained)."
        ),
    )

    def extra_groups(self, rollout_batch_size: int) -> int:
        """Groups started per step beyond the batch (0 when disabled)."""
        if not self.enabled:
            return 0
        if self.over_sampling is not None:
            return self.over_sampling
        return max(1, rollout_batch_size // 2)


class RolloutSpec(ApiModel):
    """The generation engines."""

    backend: RolloutBackend = Field(
        RolloutBackend.sglang,
        description="`sglang` (SGLang server) or `hf` (built-in transformers server; its pods "
        "request no GPUs).",
    )
    engines: int | None = Field(
        None, ge=1, le=65536,
        description="Rollout engines (SGLang or hf servers), each of gpusPerEngine GPUs: "
        "engines × gpusPerEngine GPUs in all (as many CPU slots for hf pods and on a machine "
        "without GPUs). Unset: 1, or the deprecated gpus / gpusPerEngine.",
    )
    gpus: int | None = Field(
        None, ge=1, le=65536,
        description="Deprecated: use engines (= gpus / gpusPerEngine); the API server warns "
        "when it is set. Total GPUs of all engines, a multiple of gpusPerEngine; when set with "
        "engines it must equal engines × gpusPerEngine.",
    )
    gpus_per_engine: int = Field(
        1, ge=1, le=64,
        description="GPUs per engine (its TP size; CPU slots for hf pods and on a machine "
        "without GPUs).",
    )
    image: Image = Field(f"{ROLLOUT_IMAGE}:{IMAGE_VERSION}", description="Rollout container image.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Rollout pod resources besides GPUs."
    )
    sglang_args: dict[str, Annotated[str, StringConstraints(max_length=256)]] = Field(
        default_factory=dict,
        max_length=128,
        description=(
            "SGLang server arguments without leading dashes, e.g. `mem-fraction-static: "
            '"0.8"`; `"true"` for flags. Passed through to the server.'
        ),
    )
    sampling: Sampling = Field(default_factory=Sampling, description="Generation settings.")
    mode: RolloutMode = Field(
        RolloutMode.sync,
        description=(
            "`sync`: each step generates, then trains, then sends the new weights. `async`: the "
            "next step's batch is generated while the trainer trains, by the weights the "
            "engines have, so samples lag the trained policy by up to maxStaleness versions."
        ),
    )
    max_staleness: int | None = Field(
        None,
        ge=1,
        le=64,
        description=(
            "Async only (default 1): the most policy versions a trained sample may lag. The "
            "engines get new weights whenever the next batch would lag more; 1 sends them "
            "every step, n every n-th step."
        ),
    )
    partial_rollout: PartialRolloutSpec = Field(
        default_factory=PartialRolloutSpec,
        description="Over-sample, abort at the step boundary, continue unfinished "
        "generations in the next step.",
    )

    @model_validator(mode="after")
    def _engines_from_gpus(self) -> RolloutSpec:
        """One value from here on: the deprecated `gpus` becomes `engines` (gpus /
        gpusPerEngine) and is dropped, so the operator, the runtime and every dump of a
        validated spec see `engines` alone. Never refuses: a `gpus` that is no multiple of
        gpusPerEngine, or one that disagrees with `engines`, is refused by the rules
        (`rljob_api.rules`) at admission and by `rljob validate`, before a spec is built."""
        if self.gpus is not None:
            if self.engines is None:
                self.engines = max(self.gpus // self.gpus_per_engine, 1)
            self.gpus = None
        return self

    @property
    def engine_count(self) -> int:
        """The number of engines: `engines`, 1 when unset."""
        return self.engines if self.engines is not None else 1

    @property
    def engine_slots(self) -> int:
        """Placement slots of all engines: engine_count × gpusPerEngine, GPUs or (hf pods, a
        machine without GPUs) CPU slots."""
        return self.engine_count * self.gpus_per_engine


class GSPOSpec(ApiModel):
    """GSPO's sequence-level clip range.

    GSPO clips the per-sequence ratio exp(mean token log-ratio), which stays much closer to 1
    than a token ratio does, so its range is orders of magnitude narrower than PPO's 0.2; the
    defaults are the GSPO paper's (Qwen, 2025: 3e-4 below, 4e-4 above).
    """

    clip_eps: float = Field(
        3e-4, gt=0, lt=1, description="Lower clip range of the sequence ratio (gspo only)."
    )
    clip_eps_high: float = Field(
        4e-4, gt=0, lt=1, description="Upper clip range of the sequence ratio (gspo only)."
    )


class TISSpec(ApiModel):
    """Truncated importance sampling between the rollout engine and the trainer.

    Samples come from the engine's policy, but the loss treats the trainer's recomputed
    log-probs as the behaviour policy; the two differ (kernels, precision, batch shapes).
    With `enabled`, each token's policy loss is weighted by
    min(exp(trainer log-prob − engine log-prob), `cap`), detached, which corrects that
    mismatch while the cap bounds the variance a rare large ratio would add.
    """

    enabled: bool = Field(
        False, description="Weight the policy loss by the truncated trainer/engine ratio."
    )
    cap: float = Field(
        2.0, ge=1, le=1000, description="Largest importance weight; larger ones are truncated."
    )


class DynamicSamplingSpec(ApiModel):
    """DAPO-style dynamic sampling: groups that teach nothing are replaced.

    After generation and reward, a group (one prompt's nSamplesPerPrompt responses) whose
    rewards are all equal has zero advantage under a group baseline and gives no gradient;
    it is dropped and prompts are generated again for the missing groups, up to `maxRounds`
    generation rounds per rollout step. If the batch is still short then, dropped groups
    fill it (in the order they were generated), so every step trains on rolloutBatchSize
    groups.
    """

    enabled: bool = Field(False, description="Drop zero-variance groups and generate more.")
    max_rounds: int = Field(
        4,
        ge=2,
        le=64,
        description=(
            "Generation rounds per rollout step, the first included; at most "
            "maxRounds × rolloutBatchSize prompts are generated per step."
        ),
    )


class AlgorithmSpec(ApiModel):
    """The RL objective and the batch arithmetic."""

    estimator: Estimator = Field(
        Estimator.grpo,
        description=(
            "Advantage estimator and policy loss: `grpo` (group-normalised reward, PPO clip), "
            "`gspo` (grpo's advantage, sequence-level ratio and clip, see `gspo`), `cispo` "
            "(grpo's advantage, clipped and detached token weight on the log-prob; no token "
            "leaves the gradient), `ppo` (GAE on a critic), `reinforce++` (discounted return "
            "whitened over the batch) or `reinforce++_baseline` (the same after subtracting the "
            "group's mean reward)."
        ),
    )
    rollout_batch_size: int = Field(32, ge=1, le=1048576, description="Prompts per rollout step.")
    n_samples_per_prompt: int = Field(8, ge=1, le=1024, description="Responses per prompt.")
    global_batch_size: int = Field(256, ge=1, le=1048576, description="Samples per optimizer step.")
    steps_per_rollout: int = Field(
        1, ge=1, le=1024, description="Optimizer steps per rollout step."
    )
    micro_batch_size: int = Field(
        8, ge=1, le=65536, description="Samples per forward/backward pass."
    )
    total_steps: int = Field(100, ge=1, le=10_000_000, description="Rollout steps to run.")
    lr: float = Field(1e-6, gt=0, le=1, description="Actor learning rate (> 0).")
    critic_lr: float = Field(1e-5, gt=0, le=1, description="Critic learning rate (ppo only).")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    clip_eps: float = Field(
        0.2, gt=0, lt=1,
        description="PPO clip range of the token ratio, in (0, 1); cispo's lower weight bound.",
    )
    clip_eps_high: float | None = Field(
        None, gt=0, lt=1,
        description="Upper clip range (clip-higher); defaults to clipEps. Also cispo's upper "
        "weight bound.",
    )
    gspo: GSPOSpec = Field(
        default_factory=GSPOSpec, description="Sequence-level clip range of `gspo`."
    )
    tis: TISSpec = Field(
        default_factory=TISSpec,
        description="Truncated importance sampling on the trainer/engine log-prob ratio.",
    )
    old_logprobs: OldLogprobs | None = Field(
        None,
        description=(
            "The old policy of the loss's ratio and clip: `trainer` (the trainer's log-probs "
            "of each sample, recomputed at its weights before the step) or `rollout` (the "
            "engine's, of the weights that sampled it; slime's --use-rollout-logprobs). "
            "Unset: `rollout` with rollout.mode async, where a sample comes from an earlier "
            "version than the trainer's and the clip then bounds the step from the policy "
            "that sampled it; `trainer` in sync mode and with tis, which weighs by the "
            "ratio of the two."
        ),
    )
    dynamic_sampling: DynamicSamplingSpec = Field(
        default_factory=DynamicSamplingSpec,
        description="Drop groups whose rewards are all equal and generate replacements.",
    )
    kl_mode: KLMode = Field(
        KLMode.loss,
        description="`loss` (KL term in the loss), `reward` (KL penalty in the reward), `none`.",
    )
    kl_coef: float = Field(0.0, ge=0, le=100, description="KL coefficient against the reference.")
    entropy_coef: float = Field(0.0, ge=0, le=100, description="Entropy bonus coefficient.")
    gamma: float = Field(
        1.0, ge=0, le=1, description="Discount (ppo, reinforce++, reinforce++_baseline)."
    )
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (ppo).")
    logprob_chunk_tokens: int = Field(
        1024,
        ge=1,
        le=1048576,
        description="Tokens per chunk when computing log-probs (bounds logits memory).",
    )
    max_consecutive_nonfinite: int = Field(
        3,
        ge=1,
        le=1000,
        description="Skipped steps (non-finite loss or gradients) in a row before the run stops.",
    )
    seed: int = Field(1234, ge=0, le=2**31 - 1, description="Seed of data order and sampling.")


class DataSpec(ApiModel):
    """Training prompts."""

    dataset: Path = Field(
        "builtin:arithmetic",
        description="JSONL prompts file, or `builtin:arithmetic` / `builtin:reverse`.",
    )
    pvc: ShortText | None = Field(
        None, description="PersistentVolumeClaim holding the data, mounted at /data."
    )
    prompt_key: ShortText = Field("prompt", description="JSONL key of the prompt text.")
    label_key: ShortText = Field("label", description="JSONL key of the reference answer.")
    shuffle: bool = Field(True, description="Shuffle prompts every epoch.")


class EvalSpec(ApiModel):
    """Evaluation on held-out prompts during training.

    Every `interval` rollout steps, and once more at the last step (`totalSteps`), the
    rollout engines answer every prompt of `dataset` with the weights they serve (the ones
    just trained in sync mode; in async mode up to maxStaleness versions older, except at
    the last step); the reward function scores the answers. Sampling seeds are fixed per
    prompt and sample and differ from the training ones, so two evaluations differ only by
    the weights. The mean reward goes to metrics.jsonl (`eval_reward`), curves.png and
    `status.progress.evalReward`.
    """

    dataset: Path | None = Field(
        None,
        description=(
            "Held-out prompts: a JSONL file in the format of spec.data.dataset (same "
            "promptKey, labelKey and PVC), or `builtin:arithmetic` / `builtin:reverse`."
        ),
    )
    interval: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Rollout steps between evaluations; the last step (totalSteps) is evaluated too. "
            "0 disables evaluation."
        ),
    )
    samples_per_prompt: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "Responses per eval prompt. Above 1, metrics.jsonl also records "
            "`eval_reward_max`, the mean over prompts of the best response's reward."
        ),
    )
    greedy: bool = Field(
        False,
        description=(
            "Decode greedily (temperature 0: the most likely token every time) instead of "
            "with spec.rollout.sampling's temperature, topP and topK; needs samplesPerPrompt 1."
        ),
    )
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        le=1048576,
        description="Longest eval response, in tokens. Unset: spec.rollout.sampling.maxNewTokens.",
    )


class FunctionSpec(ApiModel):
    """A user hook given by import path; it runs in the job's pods, never in the operator."""

    function: ImportPath = Field(
        "builtin:default",
        description="`module.path:function`, or `builtin:<name>` for a built-in.",
    )


StorageSize = Annotated[
    str,
    StringConstraints(
        max_length=64, pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
    ),
]
DNSName = Annotated[
    str,
    StringConstraints(
        min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
    ),
]


class CheckpointSpec(ApiModel):
    """Where and how often the job saves resumable state.

    On a cluster every pod of the job (driver, Ray head, trainers, engines and their
    sidecars) mounts one shared volume at `path`: the driver writes the built-in model and
    the checkpoints there and the workers read them, so it must be ReadWriteMany storage.
    """

    pvc: ShortText | None = Field(
        None,
        description=(
            "An existing ReadWriteMany PersistentVolumeClaim for checkpoints, mounted at `path` "
            "in every pod. Unset: the operator creates `<job>-checkpoints` (see `size`, "
            "`storageClassName`)."
        ),
    )
    size: StorageSize = Field(
        "10Gi",
        description="Size of the claim the operator creates when `pvc` is unset.",
    )
    storage_class_name: DNSName | None = Field(
        None,
        description=(
            "StorageClass of the claim the operator creates when `pvc` is unset; it must "
            "provide ReadWriteMany volumes (NFS, Filestore, EFS, CephFS, ...). Unset: the "
            "cluster's default class."
        ),
    )
    path: Path = Field("/checkpoints", description="Checkpoint directory.")
    interval: int = Field(10, ge=1, le=1_000_000, description="Rollout steps between saves.")
    keep_last: int = Field(3, ge=1, le=1000, description="Verified checkpoints to keep.")
    format: Literal["native", "hf"] = Field(
        "native",
        description="`native` (resume-exact) or `hf` (native plus an HF safetensors export).",
    )


class WeightSyncSpec(ApiModel):
    """How new weights reach the rollout engines."""

    mode: WeightSyncMode = Field(
        WeightSyncMode.nccl_broadcast,
        description="`nccl-broadcast` (gloo on CPU) or `disk` (safetensors directories).",
    )
    bucket_size_mb: int = Field(
        512, ge=1, le=65536, description="Bytes per broadcast bucket, in MiB."
    )
    verify_digest: bool = Field(True, description="Check a per-version digest on every engine.")
    scan_nonfinite: bool = Field(
        True, description="Refuse weights with NaN/Inf before sending and after receiving."
    )
    ack_timeout_seconds: int = Field(
        300, ge=1, le=86400, description="Deadline for every engine to acknowledge a version."
    )


class RecoverySpec(ApiModel):
    """What the operator does when pods, nodes or the driver fail."""

    max_restarts: int = Field(3, ge=0, le=1000, description="Restarts before the job fails.")
    backoff_seconds: int = Field(
        10, ge=0, le=86400, description="First restart delay; doubles every restart."
    )
    max_backoff_seconds: int = Field(600, ge=0, le=86400, description="Longest restart delay.")
    max_engine_restarts: int = Field(
        10,
        ge=0,
        le=10000,
        description=(
            "Lost rollout engines replaced within engineRestartWindowSeconds without a "
            "restart of the job: the driver keeps training on the engines left and starts "
            "the lost one again. One more loss in the window fails the job "
            "(EngineRestartsExhausted). 0: a lost engine restarts the job, as any lost pod. "
            "Disaggregated placement only: a colocated engine shares its pod with a trainer."
        ),
    )
    engine_restart_window_seconds: int = Field(
        3600, ge=60, le=604800, description="The window maxEngineRestarts counts in."
    )
    retry_on: list[FailureKind] = Field(
        default_factory=lambda: list(FailureKind),
        max_length=8,
        description=(
            "Failures that trigger a restart; any other failure fails the job. NodeLost "
            "covers WorkerLost (Ray lost a pod's node before Kubernetes saw it)."
        ),
    )
    startup_timeout_seconds: int = Field(
        600,
        ge=0,
        le=604800,
        description=(
            "Deadline for an attempt to start, from when the operator starts the job, resumes "
            "it, sees a spec edit, or ends a restart's backoff, until its driver runs (the "
            "driver starts once every compute pod runs). "
            "What blocks start-up (image pull errors, crash loops, unschedulable pods, a driver "
            "that does not start) is shown in the `Started` condition at once; past the deadline "
            "the job fails with that reason, or, recovering from a failure, restarts again "
            "(counted against maxRestarts). Once the driver runs, a pod that turns NotReady or "
            "is slow to come back is reported, never failed by this deadline. 0: no deadline."
        ),
    )
    stop_grace_period_seconds: int = Field(
        300,
        ge=30,
        le=86400,
        description=(
            "How long a stopping driver (suspend, spec edit, preemption, pod deletion) has to "
            "finish its step and save it before it is killed: the driver pod's "
            "terminationGracePeriodSeconds, and the grace the operator gives when it deletes "
            "the driver. One step plus one checkpoint save must fit."
        ),
    )


class Toleration(ApiModel):
    """A Kubernetes toleration."""

    key: ShortText | None = Field(None, description="Taint key.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal.")
    value: ShortText | None = Field(None, description="Taint value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect."
    )
    toleration_seconds: int | None = Field(None, description="How long a NoExecute is tolerated.")


class SchedulingSpec(ApiModel):
    """Placement of the job's pods on nodes."""

    node_selector: dict[str, ShortText] = Field(
        default_factory=dict, max_length=32, description="Node labels every pod requires."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Tolerations of every pod."
    )
    priority_class_name: ShortText | None = Field(None, description="PriorityClass of the pods.")
    queue: ShortText | None = Field(
        None,
        description=(
            "Kueue LocalQueue the job waits in (the same as its label "
            "kueue.x-k8s.io/queue-name; if both are set they must name the same queue). "
            "Nothing of the job runs until Kueue admits its Workload; an eviction stops it "
            "like suspend. Without the operator's Kueue integration (chart value "
            "kueue.enabled) the job runs unqueued."
        ),
    )
    suspend: bool = Field(False, description="Tear compute down, keep checkpoints; false resumes.")


class TensorBoardTracking(ApiModel):
    """TensorBoard event files, written by the driver (`rljob[tracking-tensorboard]`)."""

    enabled: bool = Field(False, description="Write every metrics.jsonl row as scalars.")
    log_dir: Path | None = Field(
        None,
        description=(
            "Event file directory. Unset: `tensorboard/` in the job's workdir (on a cluster, "
            "on the checkpoint volume, so it outlives the pods)."
        ),
    )


class WandbTracking(ApiModel):
    """Weights & Biases runs, written by the driver (`rljob[tracking-wandb]`).

    No API key here: an online run reads `WANDB_API_KEY` (and `WANDB_BASE_URL` for a
    self-hosted server) from the environment, as W&B itself does."""

    enabled: bool = Field(False, description="Log every metrics.jsonl row to a W&B run.")
    project: ShortText = Field("rljob", description="W&B project.")
    entity: ShortText | None = Field(
        None, description="W&B team or user; unset: the API key's default entity."
    )
    mode: Literal["offline", "online"] = Field(
        "offline",
        description=(
            "`offline` writes the run under `dir` with no network (`wandb sync` uploads it "
            "later); `online` sends it as it runs and needs `WANDB_API_KEY` in the "
            "environment."
        ),
    )
    dir: Path | None = Field(
        None, description="Where W&B keeps the run's files. Unset: the job's workdir."
    )


class MlflowTracking(ApiModel):
    """MLflow runs, written by the driver (`rljob[tracking-mlflow]`)."""

    enabled: bool = Field(False, description="Log every metrics.jsonl row to an MLflow run.")
    tracking_uri: Annotated[str, StringConstraints(min_length=1, max_length=1024)] | None = (
        Field(
            None,
            description=(
                "MLflow tracking URI: `http(s)://` for a tracking server, `file:` for a local "
                "file store. Unset: the file store `mlruns/` in the job's workdir. Database "
                "URIs (`sqlite:`, `postgresql:`) need MLflow's database packages in the image."
            ),
        )
    )
    experiment_name: ShortText | None = Field(
        None, description="MLflow experiment, created when missing. Unset: the job's name."
    )


class TrackingSpec(ApiModel):
    """Experiment trackers that receive the rows of metrics.jsonl as they are written.

    Each is optional and runs in the driver; one that cannot start or log warns once and is
    left out for the rest of the attempt; training goes on and metrics.jsonl keeps every row.
    """

    tensorboard: TensorBoardTracking = Field(
        default_factory=TensorBoardTracking, description="TensorBoard event files."
    )
    wandb: WandbTracking = Field(default_factory=WandbTracking, description="Weights & Biases.")
    mlflow: MlflowTracking = Field(default_factory=MlflowTracking, description="MLflow.")
    env_secret: DNSName | None = Field(
        None,
        description=(
            "A Secret in the job's namespace whose keys become environment variables of the "
            "driver pod, where the trackers run: `WANDB_API_KEY`, `MLFLOW_TRACKING_TOKEN`, ... "
            "Optional: without it the trackers lack credentials (and warn), the job still runs."
        ),
    )


class RLJobSpec(ApiModel):
    """An RL post-training job."""

    model: ModelSpec = Field(default_factory=ModelSpec, description="The policy (immutable).")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Training workers.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Generation engines.")
    placement: Placement = Field(
        Placement.disaggregated,
        description="`colocated` (trainer and rollout share GPUs) or `disaggregated` (immutable).",
    )
    algorithm: AlgorithmSpec = Field(
        default_factory=AlgorithmSpec, description="Objective and batch sizes."
    )
    data: DataSpec = Field(default_factory=DataSpec, description="Training prompts.")
    eval: EvalSpec = Field(
        default_factory=EvalSpec, description="Evaluation on held-out prompts during training."
    )
    reward: FunctionSpec = Field(
        default_factory=FunctionSpec,
        description="Reward function: `async def reward(args, sample) -> float`.",
    )
    generate: FunctionSpec = Field(
        default_factory=FunctionSpec,
        description="Generate function: `async def generate(args, sample, sampling) -> Sample`.",
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="Resumable state."
    )
    weight_sync: WeightSyncSpec = Field(
        default_factory=WeightSyncSpec, description="Trainer to engine weight transfer."
    )
    recovery: RecoverySpec = Field(default_factory=RecoverySpec, description="Failure handling.")
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec,
        description="Experiment trackers (TensorBoard, W&B, MLflow) fed with metrics.jsonl rows.",
    )
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec, description="Node placement and suspension."
    )
    plan_only: bool = Field(
        False,
        description="Place every worker as the job would, report the devices each process "
        "would use (the driver's `device-plan:` lines) and stop without training: a check of "
        "a GPU cluster's layout. Fixed at creation.",
    )

    def replaces_engines(self) -> bool:
        """Whether a lost rollout engine is started again while training goes on
        (`recovery.maxEngineRestarts`); a colocated engine shares its pod and GPUs with a
        trainer, whose loss restarts the job anyway."""
        return (self.placement == Placement.disaggregated
                and self.recovery.max_engine_restarts > 0)

    def old_logprobs(self) -> OldLogprobs:
        """The old policy the loss uses, `algorithm.oldLogprobs` or its default for the mode.

        Async samples come from the version before the trainer's. On the tiny CPU job
        (docs/benchmarks/async-rollout.md, 16 seeds) async with the trainer's recompute as
        the old policy learned more slowly than sync; with the engine's it did not."""
        chosen = self.algorithm.old_logprobs
        if chosen is not None:
            return OldLogprobs(chosen)
        if self.rollout.mode == RolloutMode.async_ and not self.algorithm.tis.enabled:
            return OldLogprobs.rollout
        return OldLogprobs.trainer
