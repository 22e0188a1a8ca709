"""kopf wiring of the Kueue integration (`--kueue`): a change of an RLJob's Workload kicks
the job's reconcile, and a Workload left behind by a deleted RLJob gets Kueue's finalizer
removed, so that garbage collection can take it. Imported only with the integration on: a
cluster without Kueue has no Workload kind to watch, and the operator no RBAC for one."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from rljob_api import GROUP, KIND
from rljob_operator import kueue
from rljob_operator.kueue import parse_workload


def owner_job(obj: dict[str, Any]) -> tuple[str, str, str] | None:
    """(namespace, name, uid) of the RLJob that controls a Workload."""
    meta = obj.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/") \
                and ref.get("controller"):
            return str(meta.get("namespace") or ""), str(ref["name"]), str(ref.get("uid"))
    return None


@kopf.on.event(kueue.GROUP, kueue.VERSION, kueue.WORKLOADS)
async def workload_event(memo: kopf.Memo, event: kopf.RawEvent, **_: Any) -> None:
    obj = dict(event["object"])
    owner = owner_job(obj)
    if owner is None:
        return
    namespace, name, uid = owner
    workloads = memo.reconciler.workloads
    workloads.watched((namespace, name), obj, deleted=event["type"] == "DELETED")
    view = parse_workload(obj)
    if view.deleting and view.held:
        job = await asyncio.to_thread(memo.reconciler.kube.get_rljob, namespace, name)
        if job is None or job["metadata"].get("uid") != uid \
                or job["metadata"].get("deletionTimestamp"):
            # Its job is gone or going (the workload goes by garbage collection, which in
            # a foreground deletion waits for it): the finalizer comes off, and no copy of
            # it is kept.
            if await asyncio.to_thread(workloads.unhold, namespace, view) is not None:
                workloads.watched((namespace, name), obj, deleted=True)
            return
    memo.controller.kick((namespace, name))
