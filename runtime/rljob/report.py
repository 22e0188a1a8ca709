"""Report training progress and checkpoints to the job's RLJob status, or print them locally.

Inside a cluster the runtime owns `status.progress`, `status.checkpoint`, `status.resumed`
and `status.runtimeFailure` and writes them with server-side apply under its own field
manager, so the operator (another manager) never overwrites them and vice versa. What an
attempt resumed from (`resumed`) is reported by the runtime that loaded it, because only
it knows: the operator derives its recovery figures from that report. Non-finite figures
cannot travel in JSON: they are left out and named in `progress.nonFinite`, never replaced
by a number.
"""

from __future__ import annotations

import math
import os
from datetime import UTC, datetime
from typing import Any, Protocol, cast

from rljob_api import API_VERSION, GROUP, KIND, PLURAL, VERSION, env
from rljob_api.status import CheckpointStatus, Progress, ResumeReport, RuntimeFailure

FIELD_MANAGER = "rljob-runtime"
ENV_NAME = env.JOB_NAME
ENV_NAMESPACE = env.JOB_NAMESPACE
# Fields a restarted runtime carries over from its predecessor (same field manager): an
# apply without them would remove them. `runtimeFailure` is not: a new attempt starts clean.
CARRIED_OVER = ("progress", "checkpoint", "resumed")


def now() -> str:
    """RFC 3339 UTC time, the format Kubernetes uses."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def finite_progress(progress: Progress) -> dict[str, Any]:
    """`progress` as JSON, with NaN/Inf figures left out and named in `nonFinite`."""
    body = progress.model_dump(by_alias=True, exclude_none=True, mode="python")
    bad = sorted(k for k, v in body.items() if isinstance(v, float) and not math.isfinite(v))
    for key in bad:
        del body[key]
    if bad:
        body["nonFinite"] = ",".join(bad)
    return body


class Reporter(Protocol):
    def progress(self, progress: Progress) -> None: ...
    def checkpoint(self, checkpoint: CheckpointStatus) -> None: ...
    def resumed(self, resumed: ResumeReport) -> None: ...
    def failure(self, failure: RuntimeFailure) -> None: ...


class PrintReporter:
    """Local runs: the progress bar shows progress; checkpoints and failures are printed."""

    def progress(self, progress: Progress) -> None:
        return None

    def checkpoint(self, checkpoint: CheckpointStatus) -> None:
        print(f"checkpoint: step {checkpoint.step} verified at {checkpoint.path}", flush=True)

    def resumed(self, resumed: ResumeReport) -> None:
        return None  # the loop prints what it resumed from itself

    def failure(self, failure: RuntimeFailure) -> None:
        print(f"failure: {failure.reason}: {failure.message}", flush=True)


class StatusReporter:
    """Server-side applies the runtime's status fields of one RLJob.

    An apply removes the fields its manager applied before and left out now, so every
    apply carries everything the runtime owns (the last progress, checkpoint and failure);
    a restarted runtime first reads back what its predecessor reported.
    """

    def __init__(self, name: str, namespace: str, api_client: Any = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.name = name
        self.namespace = namespace
        self.api = client.CustomObjectsApi(api_client)
        self._owned: dict[str, Any] | None = None

    @classmethod
    def from_env(cls) -> StatusReporter | None:
        """The reporter for the job named by RLJOB_NAME/RLJOB_NAMESPACE, if set (in pods)."""
        name = os.environ.get(ENV_NAME)
        if not name:
            return None
        return cls(name, os.environ.get(ENV_NAMESPACE, "default"))

    def _apply(self, fields: dict[str, Any]) -> None:
        if self._owned is None:
            obj = self.api.get_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name
            )
            current: dict[str, Any] = cast(dict[str, Any], obj).get("status") or {}
            self._owned = {k: current[k] for k in CARRIED_OVER if k in current}
        self._owned.update(fields)
        status = dict(self._owned)
        body = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": self.name, "namespace": self.namespace},
            "status": status,
        }
        self.api.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            self.name,
            body,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    def progress(self, progress: Progress) -> None:
        self._apply({"progress": finite_progress(progress)})

    def checkpoint(self, checkpoint: CheckpointStatus) -> None:
        self._apply({"checkpoint": checkpoint.model_dump(by_alias=True, exclude_none=True)})

    def resumed(self, resumed: ResumeReport) -> None:
        self._apply({"resumed": resumed.model_dump(by_alias=True, exclude_none=True)})

    def failure(self, failure: RuntimeFailure) -> None:
        self._apply({"runtimeFailure": failure.model_dump(by_alias=True, exclude_none=True)})
