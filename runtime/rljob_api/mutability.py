"""What editing each spec field of an existing RLJob does: one table for all of them.

Every field is either immutable, refused by the API server (a CEL transition rule generated
from this table into `rules.TRANSITION_RULES`, with the Python twin `rljob validate` runs),
or takes effect on the running job in one of three ways. The operator builds from the same
table (the driver's revision covers exactly the fields that are not `operator`), the field
reference and docs/operator.md print it, and tests hold the builders and a real control
plane to it, field by field.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Effect(str, Enum):
    """How an edit of a running job's field takes effect."""

    immutable = "immutable"  # refused at `kubectl apply` (CEL), and by `rljob validate`
    operator = "operator"  # read by the operator at every reconcile; nothing restarts
    restart = "restart"  # the driver restarts from the latest checkpoint with the new spec
    compute = "compute"  # the RayCluster is patched, changed pods replaced, then as `restart`


EFFECT_WORDS: dict[Effect, str] = {
    Effect.immutable: "`kubectl apply` and `rljob validate --old RUNNING.yaml EDITED.yaml` "
    "refuse the edit with the transition rule's message; create a new RLJob instead",
    Effect.operator: "the operator reads it at every reconcile; nothing restarts",
    Effect.restart: "the driver restarts from the latest checkpoint with the new spec",
    Effect.compute: "the RayCluster is patched and the pods whose template changed are "
    "replaced; then the driver restarts from the latest checkpoint",
}


@dataclass(frozen=True)
class FieldEffect:
    """The effect of editing `path` (below `spec`, camelCase, dotted) and everything in it.

    For an immutable field `why` completes the API server's message; otherwise it says what
    happens on the running job."""

    path: str
    effect: Effect
    why: str
    message: str | None = None  # an immutable field's exact message, when it predates the table

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.path.split("."))

    def immutable_message(self) -> str:
        return self.message or (f"spec.{self.path} is immutable on an existing job ({self.why}); "
                                "create a new RLJob")


_RESTART_CONFIG = "read by the runtime when the driver starts"

FIELD_EFFECTS: tuple[FieldEffect, ...] = (
    FieldEffect("model", Effect.immutable, "the policy being trained",
                "spec.model is immutable on an existing job; create a new RLJob to train "
                "another model"),
    FieldEffect("trainer.backend", Effect.immutable, "checkpoints are backend-specific",
                "spec.trainer.backend is immutable on an existing job; create a new RLJob "
                "(checkpoints are backend-specific)"),
    FieldEffect("trainer.replicas", Effect.compute,
                "trainer pods added or removed (data-parallel size; checkpoints reshard)"),
    FieldEffect("trainer.gpusPerReplica", Effect.compute,
                "trainer pods replaced with the new GPU request"),
    FieldEffect("trainer.image", Effect.compute,
                "head and every worker pod replaced (the head and trainers run it), and the "
                "driver"),
    FieldEffect("trainer.resources", Effect.compute, "trainer pods replaced"),
    FieldEffect("trainer.megatronArgs", Effect.restart, _RESTART_CONFIG),
    FieldEffect("trainer.parallelism", Effect.immutable,
                "Megatron checkpoints reshard over data-parallel ranks only, not tensor, "
                "pipeline or context parallel ones"),
    FieldEffect("rollout.backend", Effect.immutable, "the engines' server",
                "spec.rollout.backend is immutable on an existing job; create a new RLJob"),
    FieldEffect("rollout.engines", Effect.compute, "rollout pods (engines) added or removed"),
    FieldEffect("rollout.gpus", Effect.compute,
                "deprecated spelling of rollout.engines × gpusPerEngine: rollout pods "
                "(engines) added or removed; replacing it by the same engines changes nothing"),
    FieldEffect("rollout.gpusPerEngine", Effect.compute,
                "rollout pods replaced with the new GPU request"),
    FieldEffect("rollout.image", Effect.compute, "rollout pods replaced"),
    FieldEffect("rollout.resources", Effect.compute, "rollout pods replaced"),
    FieldEffect("rollout.sglangArgs", Effect.restart, "engines restart with the driver"),
    FieldEffect("rollout.sampling", Effect.restart, _RESTART_CONFIG),
    FieldEffect("rollout.mode", Effect.restart,
                "the driver restarts from its checkpoint in the new mode (a batch an async run "
                "generated ahead is trained on first); an unset algorithm.oldLogprobs follows "
                "the mode"),
    FieldEffect("rollout.maxStaleness", Effect.restart, _RESTART_CONFIG),
    FieldEffect("rollout.partialRollout", Effect.restart,
                "read by the runtime when the driver starts; generations a checkpoint carries "
                "are continued, or, with partialRollout disabled, their prompts generated "
                "again"),
    FieldEffect("planOnly", Effect.immutable,
                "a job that only plans never trains, and a training job never turns into one"),
    FieldEffect("placement", Effect.immutable, "the shape of the RayCluster",
                "spec.placement is immutable on an existing job; create a new RLJob"),
    FieldEffect("algorithm.estimator", Effect.immutable,
                "checkpoints hold the estimator's state, such as PPO's critic"),
    FieldEffect("algorithm.seed", Effect.immutable,
                "the data order and the checkpointed random states derive from it"),
    FieldEffect("algorithm", Effect.restart, _RESTART_CONFIG),
    FieldEffect("data.dataset", Effect.immutable,
                "the checkpointed data cursor points into this dataset"),
    FieldEffect("data.pvc", Effect.immutable,
                "the checkpointed data cursor points into the dataset on it"),
    FieldEffect("data.shuffle", Effect.immutable, "the checkpointed data cursor follows its order"),
    FieldEffect("data", Effect.restart, _RESTART_CONFIG),
    FieldEffect("eval", Effect.restart, _RESTART_CONFIG),
    FieldEffect("reward", Effect.restart, _RESTART_CONFIG),
    FieldEffect("generate", Effect.restart, _RESTART_CONFIG),
    FieldEffect("checkpoint.pvc", Effect.immutable, "the checkpoints are on it"),
    FieldEffect("checkpoint.size", Effect.immutable,
                "the claim exists with the size it was created with"),
    FieldEffect("checkpoint.storageClassName", Effect.immutable,
                "the claim exists in the class it was created in"),
    FieldEffect("checkpoint.path", Effect.immutable, "the checkpoints are there"),
    FieldEffect("checkpoint", Effect.restart, _RESTART_CONFIG),
    FieldEffect("weightSync.bucketSizeMb", Effect.compute,
                "the pods holding engines are replaced: their memory includes one bucket for "
                "each engine's weight-sync sidecar"),
    FieldEffect("weightSync", Effect.restart, _RESTART_CONFIG),
    FieldEffect("recovery", Effect.operator, "the operator's own policy, applied to the next "
                "failure or start-up"),
    FieldEffect("tracking", Effect.restart, _RESTART_CONFIG),
    FieldEffect("scheduling.nodeSelector", Effect.compute, "every pod replaced"),
    FieldEffect("scheduling.tolerations", Effect.compute, "every pod replaced"),
    FieldEffect("scheduling.priorityClassName", Effect.compute, "every pod replaced"),
    FieldEffect("scheduling.queue", Effect.immutable,
                "a job's queue is chosen at creation (Kueue holds its Workload there)"),
    FieldEffect("scheduling.suspend", Effect.operator,
                "set to true, deletes the driver (it saves), then the RayCluster; false "
                "builds them again"),
)


def effect_of(path: str) -> FieldEffect:
    """The entry governing `path` (dotted, below `spec`): the longest matching prefix."""
    parts = tuple(path.split("."))
    best: FieldEffect | None = None
    for entry in FIELD_EFFECTS:
        if parts[: len(entry.parts)] == entry.parts and (
                best is None or len(entry.parts) > len(best.parts)):
            best = entry
    if best is None:
        raise KeyError(f"spec.{path} has no entry in rljob_api.mutability.FIELD_EFFECTS")
    return best


def paths_with(effect: Effect) -> tuple[str, ...]:
    return tuple(e.path for e in FIELD_EFFECTS if e.effect == effect)
