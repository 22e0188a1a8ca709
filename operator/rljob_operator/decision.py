"""What one decision hands the reconciler: the status to write, idempotent steps, an event."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rljob_operator.failures import Failure

Obj = dict[str, Any]


@dataclass(frozen=True)
class Actions:
    """Idempotent steps for the reconciler; each is safe to repeat or to find already done."""

    create_cluster: bool = False
    delete_cluster: bool = False
    patch_cluster: bool = False  # the RayCluster was built from another spec: patch it
    replace_pods: tuple[str, ...] = ()  # deleted gracefully: an outdated template, a lost worker
    create_driver: tuple[str, ...] | None = None  # compute pods the new driver starts with
    delete_driver: bool = False
    delete_pods: tuple[str, ...] = ()  # force-deleted: failed, or stranded on a lost node
    workload: str | None = None  # the change to the job's Kueue Workload (admission.WorkloadStep)


@dataclass(frozen=True)
class Event:
    """A Kubernetes event about the RLJob."""

    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    status: Obj  # the operator's status fields, camelCase, as they are written
    actions: Actions = field(default_factory=Actions)
    event: Event | None = None
    requeue_after: float | None = None
    restart: Failure | None = None  # set when this decision starts a restart
    # The step a restarted job has, for status.progress.rolloutStep, while the runtime's
    # progress is still the lost attempt's (`status.held_step`).
    hold_step: int | None = None

    @property
    def phase(self) -> str | None:
        phase: str | None = self.status.get("phase")
        return phase

    @property
    def restarts(self) -> int:
        return int(self.status.get("recovery", {}).get("restarts") or 0)
