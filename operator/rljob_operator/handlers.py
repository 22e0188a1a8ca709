"""kopf wiring: watch events fill the cache and kick the controller; the controller does
the work, reading the cache.

No on.create/update/delete, daemon or timer handlers: those need kopf's finalizers and
per-object progress annotations, and a level-based reconcile needs neither. Deleting an
RLJob therefore never waits for the operator; owner references remove its children.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import kopf
from kubernetes import client

from rljob_api import GROUP, PLURAL, VERSION
from rljob_api.status import timestamp
from rljob_operator import names
from rljob_operator.cache import POD, RAYCLUSTER, RLJOB, NodeCache, Store
from rljob_operator.config import OperatorConfig
from rljob_operator.controller import Controller
from rljob_operator.kube import Kube, load_configuration
from rljob_operator.memory import Memory
from rljob_operator.metrics import Metrics
from rljob_operator.observe import pod_failure
from rljob_operator.reconciler import Reconciler
from rljob_operator.workloads import Workloads

STALL_SECONDS = 60.0  # the liveness probe fails when the scheduler loop stalls this long


def configure(settings: kopf.OperatorSettings, cfg: OperatorConfig) -> None:
    """kopf's settings. No persistence settings: with event handlers only, kopf adds no
    finalizer and stores no progress or diff-base on the objects, so there is none to
    configure (a control-plane test checks that RLJobs carry none)."""
    # Watches that end and re-open: a watch whose connection silently stalls would otherwise
    # leave the operator deaf to every change of its kind.
    settings.watching.server_timeout = cfg.server_timeout
    settings.watching.client_timeout = cfg.server_timeout + 30
    settings.watching.connect_timeout = 5
    settings.networking.request_timeout = 30
    settings.posting.level = 30  # kopf's own events: warnings and errors only
    settings.scanning.disabled = bool(cfg.namespaces)


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    cfg: OperatorConfig = memo.config
    c = load_configuration(cfg.kubeconfig)
    header = c.get_api_key_with_prefix("BearerToken") or c.get_api_key_with_prefix(
        "authorization")
    scheme, _sep, token = str(header or "").partition(" ")
    return kopf.ConnectionInfo(
        server=c.host,
        ca_path=c.ssl_ca_cert,
        insecure=not c.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=c.cert_file,
        private_key_path=c.key_file,
    )


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    cfg: OperatorConfig = memo.config
    configure(settings, cfg)
    metrics = Metrics()
    memory = Memory()
    # Filled by kopf's watches and by the operator's own writes. kopf's initial listing has
    # no end marker, so a job's first reconcile reads the API server (it must not take a pod
    # it has not been told of yet for a lost one); later ones read the store.
    store = Store()
    api_client = client.ApiClient(load_configuration(cfg.kubeconfig))
    kube = Kube(api_client, store)
    # Nodes: listed for all jobs at once, every 3 resync intervals (30 s in production).
    nodes = NodeCache(kube.list_nodes, ttl=min(30.0, max(1.5, 3 * cfg.interval)),
                      min_age=min(2.0, cfg.interval))
    reconciler = Reconciler(kube, metrics, memory, store=store, nodes=nodes, resync=cfg.resync,
                            node_lost_after=cfg.node_lost_after,
                            workloads=Workloads(api_client) if cfg.kueue else None)
    controller = Controller(reconciler.reconcile, cfg.interval, cfg.workers)

    def remembered() -> dict[str, int]:
        jobs, clusters, pods = store.sizes()
        return {"rljobs": jobs, "rayclusters": clusters, "pods": pods,
                "failure_hints": memory.jobs_with_hints(), "job_state": memory.jobs_with_state(),
                "tracked_jobs": len(controller.known)}

    metrics.remembered(remembered)
    memo.store = store
    memo.reconciler = reconciler
    memo.metrics_server = metrics.serve(cfg.metrics_port, cfg.metrics_addr) \
        if cfg.metrics_port else None
    memo.memory = memory
    memo.controller = controller
    memo.task = asyncio.create_task(controller.run())


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    memo.task.cancel()
    if memo.metrics_server is not None:
        memo.metrics_server.shutdown()


@kopf.on.probe(id="reconcilerHeartbeatAge")
def heartbeat(memo: kopf.Memo, **_: Any) -> float:
    age: float = time.monotonic() - memo.controller.heartbeat
    if memo.task.done() or age > STALL_SECONDS:
        raise kopf.PermanentError(f"reconcile scheduler stalled for {age:.0f}s")
    return round(age, 1)


def _cache(memo: kopf.Memo, kind: str, event: kopf.RawEvent) -> None:
    memo.store.watched(kind, event["type"], event["object"])


@kopf.on.event(GROUP, VERSION, PLURAL)
async def rljob_event(type: str, name: str, namespace: str | None, memo: kopf.Memo,
                      event: kopf.RawEvent, **_: Any) -> None:
    key = (namespace or "", name)
    _cache(memo, RLJOB, event)
    if type == "DELETED":
        memo.controller.forget(key)
        memo.reconciler.forget(*key)
        # Its children go by garbage collection; what is cached of them goes now (a pod
        # whose deletion event fell in a watch gap would otherwise stay for good).
        memo.store.drop_job(key)
    else:
        memo.controller.track(key)


# No label filter on the children's watches: kopf filters labels on its side of one watch
# of the kind either way, and a child whose label was removed by hand must still reach the
# cache (filed under its job by its owner, `Store.job_of`) and be labelled again.
@kopf.on.event("", "v1", "pods")
async def pod_event(body: kopf.Body, name: str, namespace: str | None, memo: kopf.Memo,
                    event: kopf.RawEvent, **_: Any) -> None:
    key = Store.job_of(dict(event["object"]))
    if key is None:
        return  # not a job's (nor wearing a job's label)
    _cache(memo, POD, event)
    namespace, job = key
    hint = pod_failure(dict(body)) if memo.store.rljob(namespace, job) is not None else None
    if hint is not None:
        # Only for a job held: pods of a deleted job fail as they are collected, and what
        # is recorded of them would never be forgotten.
        # When it was seen: a failure during a start-up (a crash loop) is told from an
        # older one by this time.
        seen = timestamp()
        memo.memory.record_failure((namespace, job), name, replace(hint, seen_at=seen))
    memo.controller.kick((namespace, job))


@kopf.on.event(names.RAY_GROUP, names.RAY_VERSION, names.RAY_PLURAL)
async def raycluster_event(memo: kopf.Memo, event: kopf.RawEvent, **_: Any) -> None:
    key = Store.job_of(dict(event["object"]))
    if key is None:
        return
    _cache(memo, RAYCLUSTER, event)
    memo.controller.kick(key)
