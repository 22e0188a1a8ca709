"""Chaos against the operator on the real control plane: children edited by hand (labels
removed, owner references removed or pointed elsewhere, RayCluster replicas edited), the
RLJob status overwritten with garbage the schema lets through, and look-alike objects of the
watched kinds that are not the job's (labelled as its children, owned by nobody or by
another job, or in another namespace).

What is asserted is what the real operator process did: it stays up (no exit, no traceback,
no failed reconcile), repairs what is provably its own (labels put back, worker groups
restored, a sane status written again over the garbage, the running driver and RayCluster
kept), reports what it may not touch (ObjectInTheWay on the condition and an Event), leaves
every foreign object as it was, and another job's reconcile latency (edit of its spec →
the operator's status answering it) stays near the baseline measured in the same run while
a storm of garbage writes hits the victim.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from rljob_api.status import parse_timestamp
from tests.controlplane import ControlPlane, temporary_namespace
from tests.operator.harness import job_manifest
from tests.operator.jobs import pods, status, wait_phase
from tests.operator_process import Operator
from tests.polling import wait_for

pytestmark = pytest.mark.controlplane
Pool = Callable[[int, int], list[str]]
Obj = dict[str, Any]
JOB_LABEL = "rljob.io/job"
SAMPLES = 5
RESYNC = 2.0
# by: the bystander whose latency is measured; vi: labels removed, status garbage; ow: owner
# references removed or pointed elsewhere; rs: a worker group resized by hand.
JOBS = ("by", "vi", "ow", "rs")

# Garbage the status schema lets through (right types, nonsense values): a terminal phase
# the operator never decided, conditions with times that are no times, a negative restart
# count, numbers at the edge of int64/float64, runtime reports of attempts that never ran.
GARBAGE: Obj = {
    "phase": "Succeeded",
    "observedGeneration": 2**53,
    "conditions": [
        {"type": "Ready", "status": "True", "reason": "Running", "message": "x" * 30000,
         "lastTransitionTime": "not a time"},
        {"type": "Hacked", "status": "True", "reason": "Garbage", "message": "",
         "lastTransitionTime": "yesterday"},
    ],
    "recovery": {"restarts": -7, "maxRestarts": 2**40, "action": "Nonsense",
                 "nextAttemptAt": "never",
                 "lastFailure": {"reason": "Bogus", "time": "not a time", "step": -3}},
    "startingSince": "garbage", "startedAt": "garbage",
    "progress": {"rolloutStep": 2**53, "meanReward": -1e308},
    "resumed": {"attempt": -1, "found": True, "at": "x", "step": -5},
}


class Api:
    """Direct API calls (no kubectl process per poll: latencies are read to ~20 ms)."""

    def __init__(self, api_client: Any, ns: str) -> None:
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.ns = ns

    def rljob(self, name: str) -> Obj:
        body: Any = self.custom.get_namespaced_custom_object(
            "rljob.io", "v1alpha1", self.ns, "rljobs", name)
        return dict(body)

    def patch_spec(self, name: str, spec: Obj) -> int:
        body: Any = self.custom.patch_namespaced_custom_object(
            "rljob.io", "v1alpha1", self.ns, "rljobs", name, {"spec": spec})
        return int(body["metadata"]["generation"])

    def patch_status(self, name: str, st: Obj) -> None:
        self.custom.patch_namespaced_custom_object_status(
            "rljob.io", "v1alpha1", self.ns, "rljobs", name, {"status": st})


def reaction_seconds(api: Api, job: str, max_restarts: int) -> float:
    """One edit of the job's spec (recovery.maxRestarts: the operator's own policy, no child
    changes) and the time until the operator's status answers it."""
    start = time.monotonic()
    generation = api.patch_spec(job, {"recovery": {"maxRestarts": max_restarts}})

    def answered() -> bool:
        st = api.rljob(job).get("status") or {}
        return (st.get("observedGeneration") == generation
                and (st.get("recovery") or {}).get("maxRestarts") == max_restarts)

    wait_for(answered, timeout=30, interval=0.02, what=f"{job}: generation {generation}")
    return time.monotonic() - start


def latencies(api: Api, job: str, rounds: list[int] | None = None) -> list[float]:
    """SAMPLES reactions of `job`; with `rounds` (a storm's count), each sample starts only
    after another round of chaos has landed, so that every one is measured amid it."""
    out = []
    for i in range(SAMPLES):
        if rounds is not None:
            def advanced(seen: int = rounds[0], count: list[int] = rounds) -> bool:
                return count[0] > seen

            wait_for(advanced, timeout=30, interval=0.02, what="a chaos round")
        out.append(reaction_seconds(api, job, 4 + i % 2))
    return out


@contextmanager
def storm(work: Callable[[], None]) -> Iterator[list[int]]:
    """`work` over and over on a thread while the block runs; yields a one-item count."""
    stop, done, errors = threading.Event(), [0], []

    def loop() -> None:
        while not stop.is_set():
            try:
                work()
            except Exception as err:  # reported after the block
                errors.append(err)
                return
            done[0] += 1

    thread = threading.Thread(target=loop, name="chaos", daemon=True)
    thread.start()
    try:
        yield done
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not errors, f"the chaos itself failed: {errors[0]!r}"


def reconciles(op: Operator, result: str = "ok") -> float:
    """The operator's count of reconciles that ended with `result` (ok, error)."""
    url = f"http://127.0.0.1:{op.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as resp:
        lines = resp.read().decode().splitlines()
    sample = f'rljob_operator_reconciles_total{{result="{result}"}}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(sample))


def conditions(st: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in st.get("conditions") or []}


def identity(cp: ControlPlane, kind: str, name: str, ns: str) -> tuple[str, Obj, Obj, Obj]:
    """What a foreign object must keep: its UID, labels, owners and spec."""
    obj = cp.get_json(kind, name, "-n", ns)
    meta = obj["metadata"]
    assert not meta.get("deletionTimestamp"), f"{kind}/{name} is being deleted"
    return (meta["uid"], meta.get("labels") or {}, {"owners": meta.get("ownerReferences")},
            obj.get("spec") or {})


def foreign_pod(name: str, job: str, component: str, owner: Obj | None = None) -> Obj:
    """A pod labelled as `job`'s child that it does not own; it is never scheduled (its
    node selector matches no node), so it holds no GPU."""
    meta: Obj = {"name": name, "labels": {JOB_LABEL: job, "rljob.io/component": component,
                                          "ray.io/group": component}}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeSelector": {"rljob.io/test-nowhere": "true"},
                     "containers": [{"name": "c", "image": "busybox"}]}}


def foreign_raycluster(name: str, job: str) -> Obj:
    template = {"spec": {"containers": [{"name": "ray-head", "image": "rayproject/ray:2.52.0"}]}}
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": name, "labels": {JOB_LABEL: job}},
            "spec": {"suspend": True,
                     "headGroupSpec": {"rayStartParams": {}, "template": template}}}


@pytest.fixture
def operator(cluster: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[Operator]:
    """The operator with a safety resync every RESYNC seconds (600 in production): the
    fresh reads, which list children by label, run amid the chaos too."""
    op = Operator(cluster, namespace, tmp_path / "operator.log",
                  extra_args=("--resync", str(RESYNC)))
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture
def other_ns(cluster: ControlPlane, namespace: str) -> Iterator[str]:
    """A second namespace, for look-alikes of the test namespace's children."""
    with temporary_namespace(cluster, f"{namespace}-other") as name:
        yield name


def test_hand_edits_garbage_status_and_foreign_objects_are_repaired_or_reported(
        cluster: ControlPlane, namespace: str, operator: Operator, gpu_pool: Pool,
        api_client: Any, other_ns: str) -> None:
    started = time.monotonic()
    ns = namespace
    api = Api(api_client, ns)
    gpu_pool(3, 8)
    for job in JOBS:
        cluster.apply(job_manifest(job, ns), "-n", ns)
    for job in JOBS:
        wait_phase(cluster, ns, job, "Running")
    baseline = latencies(api, "by")

    uid = {job: api.rljob(job)["metadata"]["uid"] for job in JOBS}
    vi_cluster = cluster.get_json("raycluster", "vi", "-n", ns)
    vi_driver = cluster.get_json("pod", "vi-driver", "-n", ns)
    vi_compute = pods(cluster, ns, "vi", "rollout")[0]["metadata"]["name"]
    vi_cm = cluster.get_json("configmap", "vi-spec", "-n", ns)["metadata"]["uid"]

    # Look-alikes: labelled as vi's children, owned by nobody or by another job, or in
    # another namespace; a RayCluster labelled vi under another name.
    by_owner = {"apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "name": "by",
                "uid": uid["by"], "controller": True}
    cluster.apply(foreign_pod("vi-imposter", "vi", "rollout"), "-n", ns)
    cluster.apply(foreign_pod("vi-rollout-worker-fake", "vi", "rollout", by_owner), "-n", ns)
    cluster.apply(foreign_raycluster("vi-shadow", "vi"), "-n", ns)
    cluster.apply(foreign_pod("vi-driver", "vi", "driver"), "-n", other_ns)
    cluster.apply(foreign_raycluster("vi", "vi"), "-n", other_ns)
    foreign = {(kind, name, where): identity(cluster, kind, name, where) for kind, name, where in (
        ("pod", "vi-imposter", ns), ("pod", "vi-rollout-worker-fake", ns),
        ("raycluster", "vi-shadow", ns), ("pod", "vi-driver", other_ns),
        ("raycluster", "vi", other_ns))}

    # Hand edits of vi's children: every label the operator finds them by, removed.
    for kind, name in (("pod", "vi-driver"), ("raycluster", "vi"), ("pod", vi_compute),
                       ("configmap", "vi-spec")):
        cluster.kubectl("label", kind, name, "-n", ns, f"{JOB_LABEL}-")
    # ow's RayCluster: owner references removed; its driver: handed to another job (by).
    # Neither is provably ow's any more.
    cluster.kubectl("patch", "raycluster", "ow", "-n", ns, "--type=json", "-p", json.dumps(
        [{"op": "remove", "path": "/metadata/ownerReferences"}]))
    cluster.kubectl("patch", "pod", "ow-driver", "-n", ns, "--type=merge", "-p", json.dumps(
        {"metadata": {"ownerReferences": [by_owner]}}))

    # rs: its rollout group resized by hand (KubeRay acts on it at once).
    rs_groups = cluster.get_json("raycluster", "rs", "-n", ns)["spec"]["workerGroupSpecs"]
    rollout = [g["groupName"] for g in rs_groups].index("rollout")
    api.custom.patch_namespaced_custom_object(
        "ray.io", "v1", ns, "rayclusters", "rs", [
            {"op": "replace", "path": f"/spec/workerGroupSpecs/{rollout}/{key}", "value": 3}
            for key in ("maxReplicas", "replicas", "minReplicas")],
        _content_type="application/json-patch+json")

    unlabel: Obj = {"metadata": {"labels": {JOB_LABEL: None}}}

    def chaos() -> None:
        """One round of the storm on vi: its status overwritten with garbage, its driver's
        and RayCluster's job label removed again."""
        api.patch_status("vi", GARBAGE)
        api.core.patch_namespaced_pod("vi-driver", ns, unlabel)
        api.custom.patch_namespaced_custom_object("ray.io", "v1", ns, "rayclusters", "vi",
                                                  unlabel)

    with storm(chaos) as rounds:
        during = latencies(api, "by", rounds)
    assert rounds[0] >= SAMPLES, f"only {rounds[0]} chaos rounds ran during the measurement"

    # vi: repaired. A sane status over the garbage, nothing restarted, the labels back.
    def repaired() -> Obj | None:
        body = api.rljob("vi")
        st = body.get("status") or {}
        ready = conditions(st).get("Ready") or {}
        ok = (st.get("phase") == "Running" and ready.get("status") == "True"
              and parse_timestamp(ready.get("lastTransitionTime")) is not None
              and st.get("observedGeneration") == body["metadata"]["generation"]
              and (st.get("recovery") or {}).get("restarts") == 0)
        return st if ok else None

    wait_for(repaired, timeout=30, what="vi's status rewritten sane",
             describe=lambda: json.dumps(status(cluster, ns, "vi"))[-3000:])
    st = status(cluster, ns, "vi")
    assert parse_timestamp(st.get("startedAt")) is not None, st.get("startedAt")
    assert (st["recovery"].get("action"), st["recovery"].get("nextAttemptAt")) == (None, None)

    def relabelled() -> bool:
        return all(cluster.get_json(kind, name, "-n", ns)["metadata"]["labels"].get(JOB_LABEL)
                   == "vi" for kind, name in (("pod", "vi-driver"), ("raycluster", "vi"),
                                               ("pod", vi_compute)))

    wait_for(relabelled, timeout=30, what="vi's children labelled again")
    # Repaired for good: reconciles go on and write vi's status no more (an apply alone
    # cannot remove fields another manager wrote; a status that never matches the decision
    # would be written at every reconcile).
    rv = api.rljob("vi")["metadata"]["resourceVersion"]
    done = reconciles(operator)
    wait_for(lambda: reconciles(operator) >= done + 12, timeout=30, what="12 more reconciles")
    assert api.rljob("vi")["metadata"]["resourceVersion"] == rv, status(cluster, ns, "vi")
    assert "Hacked" not in conditions(status(cluster, ns, "vi"))

    def restored() -> bool:
        groups = cluster.get_json("raycluster", "rs", "-n", ns)["spec"]["workerGroupSpecs"]
        return all((g["replicas"], g["minReplicas"], g["maxReplicas"]) == (want,) * 3
                   for g, want in zip(groups, (1, 2), strict=True))

    wait_for(restored, timeout=30, what="rs's worker groups restored")
    wait_for(lambda: len(pods(cluster, ns, "rs", "rollout")) == 2, timeout=30,
             what="rs back to two rollout pods")
    wait_phase(cluster, ns, "rs", "Running")
    events = cluster.get_json("events", "-n", ns, "--field-selector",
                              "involvedObject.name=rs")["items"]
    assert "ChildRepaired" in {e["reason"] for e in events}
    assert cluster.get_json("raycluster", "vi", "-n", ns)["metadata"]["uid"] == \
        vi_cluster["metadata"]["uid"]
    assert cluster.get_json("pod", "vi-driver", "-n", ns)["metadata"]["uid"] == \
        vi_driver["metadata"]["uid"], "the running driver was replaced"
    assert cluster.get_json("configmap", "vi-spec", "-n", ns)["metadata"]["uid"] == vi_cm
    events = cluster.get_json("events", "-n", ns, "--field-selector",
                              "involvedObject.name=vi")["items"]
    assert {"ChildRepaired", "StatusRepaired"} <= {e["reason"] for e in events}

    # ow: reported, not touched. Ready=False naming the object, an Event; the RayCluster
    # and the driver neither deleted, adopted nor patched.
    def blocked() -> Obj | None:
        ready = conditions(status(cluster, ns, "ow")).get("Ready") or {}
        return ready if ready.get("reason") == "ObjectInTheWay" else None

    ready = wait_for(blocked, timeout=30, what="ow: Ready=False/ObjectInTheWay")
    assert "is not this RLJob's" in ready["message"]
    events = cluster.get_json("events", "-n", ns, "--field-selector",
                              "involvedObject.name=ow")["items"]
    assert "ObjectInTheWay" in {e["reason"] for e in events}
    ow_cluster = cluster.get_json("raycluster", "ow", "-n", ns)["metadata"]
    assert not ow_cluster.get("ownerReferences") and not ow_cluster.get("deletionTimestamp")
    ow_driver = cluster.get_json("pod", "ow-driver", "-n", ns)["metadata"]
    assert [o["uid"] for o in ow_driver["ownerReferences"]] == [uid["by"]]
    assert not ow_driver.get("deletionTimestamp")

    # Foreign objects: as they were (same UID, labels, owners and spec).
    for (kind, name, where), before in foreign.items():
        assert identity(cluster, kind, name, where) == before, f"{kind} {where}/{name}"
    assert conditions(status(cluster, ns, "vi"))["Scheduled"]["status"] == "True"

    # The operator: up all along, no failed reconcile, no traceback; the bystander still
    # answers as fast (generous bound: 3x the baseline median, at least 1 s over it).
    assert operator.proc is not None and operator.proc.poll() is None
    log = operator.log.read_text(errors="replace")
    assert "Traceback" not in log, operator.tail(80)
    assert reconciles(operator, "error") == 0, operator.tail(80)
    assert status(cluster, ns, "by")["phase"] == "Running"
    base, chaos_median = statistics.median(baseline), statistics.median(during)
    print(f"bystander reaction s: baseline {[round(x, 3) for x in baseline]} "
          f"(median {base:.3f}); during chaos {[round(x, 3) for x in during]} "
          f"(median {chaos_median:.3f}); {rounds[0]} chaos rounds; "
          f"test {time.monotonic() - started:.1f}s")
    assert chaos_median <= max(3 * base, base + 1.0), (baseline, during)
