"""The RLJob status: what the operator and the runtime report.

Ownership is split by field manager: the operator writes `OPERATOR_FIELDS`, the runtime
`RUNTIME_FIELDS`, each with server-side apply (`apply_status`) under its own manager, so
neither overwrites the other's fields. One exception: after a restart, until the new
attempt's runtime reports, the operator sets `progress.rolloutStep` to the step the job
has, by a merge patch that the runtime's next apply overrides. Facts about training (what
was saved, what was loaded) come only from the runtime; the operator derives its recovery
figures from them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from rljob_api import API_VERSION, GROUP, KIND, PLURAL, VERSION
from rljob_api.spec import ApiModel, ShortText

MESSAGE_MAX = 32768
Message = Annotated[str, StringConstraints(max_length=MESSAGE_MAX)]
Timestamp = Annotated[str, StringConstraints(max_length=64)]

OPERATOR_MANAGER = "rljob-operator"
RUNTIME_MANAGER = "rljob-runtime"
OPERATOR_FIELDS = ("phase", "conditions", "observedGeneration", "recovery", "startingSince",
                   "startedAt", "finishedAt")
RUNTIME_FIELDS = ("progress", "checkpoint", "resumed", "runtimeFailure", "stopped", "engines")
# The runtime's fields a restarted runtime carries over from its predecessor (the same field
# manager: an apply without them would remove them). The others say how an attempt ended,
# and a new attempt starts without them.
RUNTIME_CARRIED_FIELDS = ("progress", "checkpoint", "resumed")


def timestamp(t: datetime | None = None) -> str:
    """RFC 3339 UTC to the second, as Kubernetes writes times: every status time, whoever
    writes it, reads and compares the same way. `t` None: now."""
    return (t or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(text: str | None) -> datetime | None:
    """An RFC 3339 time from the API server or a runtime report; None when absent or not a
    time (a malformed report must not break every reconcile of the job)."""
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def apply_status(api: Any, namespace: str, name: str, status: dict[str, Any], manager: str,
                 timeout: float | tuple[float, float], **options: Any) -> Any:
    """Server-side apply of `status` to the RLJob's status subresource through a kubernetes
    `CustomObjectsApi`, as `manager`, taking ownership of exactly these fields: an apply
    drops the fields its manager applied before and leaves out now, and never touches
    another manager's. `options` go to the client call (e.g. `_preload_content`)."""
    body = {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": namespace}, "status": status}
    return api.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, body, field_manager=manager, force=True,
        _content_type="application/apply-patch+yaml", _request_timeout=timeout, **options)


class Phase(str, Enum):
    pending = "Pending"
    queued = "Queued"  # waiting for Kueue to admit it (spec.scheduling.queue)
    preempted = "Preempted"  # evicted by Kueue: stopping, then queued again
    initializing = "Initializing"
    running = "Running"
    recovering = "Recovering"
    suspended = "Suspended"
    succeeded = "Succeeded"
    failed = "Failed"


TERMINAL_PHASES = frozenset({Phase.succeeded.value, Phase.failed.value})


class Condition(ApiModel):
    """metav1.Condition."""

    type: ShortText = Field(description="Condition type, e.g. Ready, Scheduled, Progressing.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: ShortText = Field(description="CamelCase machine-readable reason.")
    message: Message = Field("", description="Human-readable detail.")
    last_transition_time: Timestamp = Field(description="RFC 3339 time of the last change.")
    observed_generation: int | None = Field(None, description="Spec generation it describes.")


class Progress(ApiModel):
    """Training progress, written by the runtime; after a restart, until the new attempt's
    runtime reports, the operator sets rolloutStep to the step the job has."""

    attempt: int | None = Field(
        None, description="The attempt that reported (the operator's restart count at its start)."
    )
    rollout_step: int = Field(0, description="Rollout steps completed.")
    train_step: int = Field(0, description="Optimizer steps completed.")
    total_steps: int = Field(0, description="Rollout steps the job will run.")
    samples: int = Field(0, description="Samples trained on.")
    mean_reward: float | None = Field(None, description="Mean reward of the last rollout step.")
    tokens_per_second: float | None = Field(None, description="Generated tokens per second.")
    weight_version: int = Field(0, description="Weight version the rollout engines serve.")
    skipped_steps: int = Field(0, description="Steps skipped for non-finite loss or gradients.")
    policy_version: int = Field(
        0, description="Weight version of the trainer; ahead of weightVersion in async mode."
    )
    staleness_mean: float | None = Field(
        None, description="Mean policy versions the last step's samples lagged the trainer."
    )
    staleness_max: int | None = Field(
        None, description="Most policy versions a sample of the last step lagged the trainer."
    )
    filtered_groups: int | None = Field(
        None, description="Zero-variance groups dynamic sampling set aside in the last step."
    )
    logprob_gap: float | None = Field(
        None,
        description="Mean |trainer − engine| log-prob per response token in the last step.",
    )
    non_finite: ShortText | None = Field(
        None, description="Set when a reported figure was NaN/Inf: which one."
    )
    updated_at: Timestamp | None = Field(None, description="When the runtime last reported.")
    eval_reward: float | None = Field(
        None,
        description=(
            "Mean reward on spec.eval.dataset at the latest evaluation (kept until the next "
            "one); unset until the first."
        ),
    )
    eval_step: int | None = Field(None, description="Rollout step evalReward was measured at.")


class CheckpointRecord(ApiModel):
    """One verified checkpoint."""

    step: int = Field(description="Rollout step the checkpoint holds.")
    path: ShortText = Field(description="Directory of the checkpoint.")
    saved_at: Timestamp = Field(description="When it was published.")


class CheckpointStatus(ApiModel):
    """The latest verified checkpoint, written by the runtime."""

    step: int | None = Field(None, description="Rollout step of the latest verified checkpoint.")
    path: ShortText | None = Field(None, description="Its directory.")
    saved_at: Timestamp | None = Field(None, description="When it was published.")
    size_bytes: int | None = Field(None, description="Bytes on disk.")
    checksum: ShortText | None = Field(None, description="SHA-256 of its manifest.")
    verified: bool = Field(False, description="Every file matched the manifest after writing.")
    history: list[CheckpointRecord] = Field(
        default_factory=list, max_length=16, description="Recent verified checkpoints."
    )


class Failure(ApiModel):
    """The last failure the operator saw."""

    reason: ShortText = Field(description="PodFailed, PodDeleted, PodEvicted, NodeLost, ...")
    message: Message = Field("", description="Detail, e.g. the container's exit reason.")
    pod: ShortText | None = Field(None, description="Pod that failed.")
    time: Timestamp = Field(description="When it was seen.")
    step: int | None = Field(
        None,
        description="status.progress.rolloutStep (the runtime's last report) when it was seen.",
    )


class RecoveryStatus(ApiModel):
    """Restarts and what the recovery is doing, written by the operator."""

    restarts: int = Field(0, description="Restarts so far.")
    max_restarts: int = Field(0, description="spec.recovery.maxRestarts at the time.")
    last_failure: Failure | None = Field(None, description="The last failure seen.")
    resumed_from_step: int | None = Field(
        None,
        description=(
            "Step the current attempt's runtime resumed from (status.resumed.step; 0: it found "
            "no checkpoint); unset until that runtime reports."
        ),
    )
    lost_steps: int | None = Field(
        None,
        description=(
            "Steps the current attempt redoes: lastFailure.step minus resumedFromStep; unset "
            "until the runtime reports what it resumed from."
        ),
    )
    action: ShortText | None = Field(None, description="What the recovery is doing now.")
    next_attempt_at: Timestamp | None = Field(None, description="When the next restart starts.")


class ResumeReport(ApiModel):
    """What the runtime of one attempt loaded when it started; written by the runtime."""

    attempt: int = Field(
        description="The attempt that reported (the operator's restart count at its start)."
    )
    found: bool = Field(description="A verified checkpoint was loaded; false: started at step 0.")
    step: int = Field(0, description="Rollout step the attempt starts from.")
    path: ShortText | None = Field(None, description="Directory of the checkpoint loaded.")
    checksum: ShortText | None = Field(
        None, description="SHA-256 of the loaded checkpoint's manifest, as verified on load."
    )
    at: Timestamp = Field(description="When it was loaded.")
    driver_pod_uid: ShortText | None = Field(
        None,
        description=(
            "UID of the driver pod whose runtime reported; resume figures are shown only for "
            "the driver pod that runs (a suspension or a spec edit keeps the attempt number)."
        ),
    )


class RuntimeFailure(ApiModel):
    """A failure the runtime itself diagnosed (e.g. non-finite weights); written by the runtime."""

    reason: ShortText = Field(description="NonFiniteWeights, NonFiniteLoss, InvalidSpec, ...")
    message: Message = Field("", description="Detail, including where the evidence was saved.")
    retryable: bool = Field(False, description="Whether a restart can help.")
    step: int | None = Field(None, description="Rollout step it happened at.")
    time: Timestamp = Field(description="When it happened.")
    lost_pods: list[ShortText] = Field(
        default_factory=list,
        max_length=64,
        description=(
            "Pods whose Ray node died under the failed attempt, from Ray's node table; the "
            "operator names the failure after their Kubernetes state (NodeLost, PodDeleted, "
            "...), or WorkerLost while Kubernetes has not noticed yet."
        ),
    )


class RuntimeStop(ApiModel):
    """The runtime stopped on a signal (suspend, preemption, pod deletion, Ctrl-C): not a
    failure. Written by the runtime as it exits; the next attempt's runtime removes it."""

    signal: ShortText = Field(description="The signal that stopped it: SIGTERM or SIGINT.")
    attempt: int = Field(
        description="The attempt that stopped (the operator's restart count at its start)."
    )
    step: int = Field(description="Rollout steps completed when it stopped.")
    checkpoint_step: int | None = Field(
        None,
        description=(
            "Step of the latest verified checkpoint when it stopped, which the next attempt "
            "resumes from; unset when there is none."
        ),
    )
    aborted: bool = Field(
        False,
        description=(
            "True when it stopped at once (a second signal, or a signal during start-up) "
            "without finishing its step and saving; false when it finished the step in "
            "progress and saved it."
        ),
    )
    exit_code: int = Field(description="Its exit code: 128 + the signal number (143, 130).")
    time: Timestamp = Field(description="When it stopped.")


class EngineState(str, Enum):
    serving = "Serving"
    lost = "Lost"  # being started again
    rejoining = "Rejoining"  # started again, installing the version the others serve


class EngineReport(ApiModel):
    """One rollout engine as the driver sees it."""

    name: ShortText = Field(description="engine-<index>, as in weight sync and metrics.")
    state: EngineState = Field(description="Serving, Lost (being replaced) or Rejoining.")
    weight_version: int | None = Field(
        None, description="Weight version it serves; unset while it serves none."
    )
    restarts: int = Field(0, description="Times this attempt replaced it.")
    reason: Message | None = Field(None, description="Why it was last lost.")
    since: Timestamp = Field(description="When it entered its state.")


class EnginesStatus(ApiModel):
    """The rollout engines of the running attempt, written by the runtime whenever one is
    lost or rejoins: a lost engine is replaced while training goes on."""

    attempt: int = Field(
        description="The attempt that reported (the operator's restart count at its start)."
    )
    ready: int = Field(description="Engines serving requests.")
    total: int = Field(description="Engines the job runs.")
    summary: ShortText = Field(description="ready/total, as the ENGINES column shows it.")
    restarts: int = Field(
        0,
        description=(
            "Engine losses within spec.recovery.engineRestartWindowSeconds (each replaced, "
            "but one beyond maxEngineRestarts, which fails the job)."
        ),
    )
    paused: Message | None = Field(
        None, description="Set while no engine serves: generation waits, and why."
    )
    engines: list[EngineReport] = Field(
        default_factory=list, max_length=1024, description="Each engine, by index."
    )


class RLJobStatus(ApiModel):
    """Observed state of an RLJob."""

    phase: Phase | None = Field(None, description="Lifecycle phase.")
    conditions: list[Condition] = Field(
        default_factory=list, max_length=32, description="Detailed conditions."
    )
    observed_generation: int | None = Field(None, description="Spec generation last acted on.")
    progress: Progress | None = Field(None, description="Training progress (runtime).")
    checkpoint: CheckpointStatus | None = Field(None, description="Latest checkpoint (runtime).")
    stopped: RuntimeStop | None = Field(
        None, description="The running attempt stopped on a signal, not a failure (runtime)."
    )
    recovery: RecoveryStatus | None = Field(None, description="Restarts (operator).")
    resumed: ResumeReport | None = Field(
        None, description="What the running attempt resumed from (runtime)."
    )
    engines: EnginesStatus | None = Field(
        None, description="The running attempt's rollout engines (runtime)."
    )
    runtime_failure: RuntimeFailure | None = Field(
        None, description="A failure diagnosed by the runtime (runtime)."
    )
    starting_since: Timestamp | None = Field(
        None,
        description=(
            "When the current start-up began (operator): creation, resumption, a spec edit or "
            "the end of a restart's backoff; the start-up deadline is this plus "
            "spec.recovery.startupTimeoutSeconds. Unset while the job runs."
        ),
    )
    started_at: Timestamp | None = Field(None, description="When the job first ran.")
    finished_at: Timestamp | None = Field(None, description="When it succeeded or failed.")
