"""RLJobs beside KubeRay's own RayJobs of the same shape, in one run on one control plane:
whether the operator adds anything to what KubeRay, the scheduler and the machine cost.

Starts the harness's control plane (etcd, kube-apiserver with an audit log of every
request, scheduler, controller-manager, volume provisioner, kwok, the KubeRay operator
binary), adds enough kwok 8-GPU nodes for both halves, runs the real `rljob-operator` on
namespace `bench-rljob`, then creates, alternating one of each, `--jobs` RLJobs (the
production example, 16 GPUs: a head, 1 trainer pod × 8 GPUs, 4 engine pods × 2 GPUs) and
`--jobs` RayJobs in `bench-rayjob` whose `rayClusterSpec` is the RayCluster the operator
builds from the same spec (same groups, pods, resources and claim), with
`submissionMode: InteractiveMode`: KubeRay creates the RayCluster, waits for it to be ready
and then waits for a job id nobody gives it, so no submitter and no dashboard are needed
(KubeRay v1.5.0, `rayjob_controller.go`: InteractiveMode goes from Initializing to Waiting
once the RayCluster is Ready; K8sJobMode and HTTPMode call the dashboard). Each RayJob's
checkpoint claim is created with it, as the operator creates an RLJob's.

Times come from this script's own watches on RayClusters and pods (when an event was
received), from just before each create call:
- create → RayCluster created;
- create → all the RayCluster's pods Running (head and workers: the same pods on both
  sides; an RLJob's driver pod, which a RayJob in this mode does not have, is reported on
  its own line);
then, once every RLJob's status says Running, `--idle-seconds` with nothing changing, then
the control-plane part of a failure: a trainer pod of each of `--failures` RLJobs is
deleted (grace 0) and the time from this script's watch seeing it gone to it seeing the new
driver pod is printed (the jobs have `backoffSeconds: 0`, so no restart backoff is in it).

API requests per job come from the audit log, by namespace and client (operator: kopf's and
the kubernetes client's user agents; KubeRay: `kuberay-operator/`), during the ramp and per
minute while idle; the operator's cluster-wide node lists are counted on its side.

    .venv/bin/python -m benchmarks.scale_vs_kuberay --jobs 50
    .venv/bin/python -m benchmarks.scale_vs_kuberay --jobs 500 --idle-seconds 120

Exits non-zero when the p95 ratio RLJob/RayJob of create → pods Running exceeds `--max-ratio`
or the failure → new driver p95 is 5 s or more.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.sim_scale import (
    OPERATOR_AGENTS,
    ProcStats,
    job_manifest,
    percentile,
    proc_stats,
    start_sim_plane,
)
from rljob_api.layout import DRIVER, TRAINER
from rljob_operator import builders, names
from rljob_operator.builders import JobRef
from rljob_operator.situation import parse_job
from tests.controlplane import ControlPlane, k8s_bin_dir
from tests.controlplane_audit import audit_requests, describe_request
from tests.operator_process import Operator
from tests.polling import Timeout, wait_for

RLJOB_NS = "bench-rljob"
RAYJOB_NS = "bench-rayjob"
OWN_AGENT = "rljob-bench"
KUBERAY_AGENT = "kuberay-operator/"
GPUS_PER_JOB = 16


class BenchControlPlane(ControlPlane):
    """Every request of every client in the audit log, but for node heartbeats and leases,
    which neither operator sends."""

    def audit_policy(self) -> str:
        return (
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\n"
            "rules:\n- level: None\n  resources:\n"
            "  - {group: \"coordination.k8s.io\", resources: [leases]}\n"
            "  - {group: \"\", resources: [nodes/status]}\n- level: Metadata\n"
        )


def bench_manifest(name: str) -> dict[str, Any]:
    doc = job_manifest(name)
    # No restart backoff in the failure figures, and a start-up deadline of 2 hours instead
    # of the default 600 s: at hundreds of jobs on a small machine a start can take longer,
    # and a job failed for it would never have its pods Running.
    doc["spec"]["recovery"] = {"maxRestarts": 100, "backoffSeconds": 0,
                               "maxBackoffSeconds": 0, "startupTimeoutSeconds": 7200}
    return doc


def rayjob_manifests(name: str, rljob: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A RayJob whose RayCluster is the one the operator builds for `rljob`, and its claim."""
    meta = {"name": name, "namespace": RAYJOB_NS, "uid": "00000000-0000-0000-0000-000000000000"}
    job = parse_job({"metadata": meta, "spec": rljob["spec"]})
    assert job.spec is not None
    ref = JobRef(name, RAYJOB_NS, meta["uid"])
    cluster = builders.build_raycluster(ref, job.spec)
    claim = builders.build_checkpoint_claim(ref, job.spec)
    assert claim is not None
    claim["metadata"].pop("ownerReferences", None)
    rayjob = {"apiVersion": "ray.io/v1", "kind": "RayJob",
              "metadata": {"name": name, "namespace": RAYJOB_NS},
              "spec": {"submissionMode": "InteractiveMode",
                       "rayClusterSpec": cluster["spec"]}}
    return rayjob, claim


def expected_pods(rayjob: dict[str, Any]) -> int:
    groups = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return 1 + sum(int(g.get("replicas", 1)) * int(g.get("numOfHosts", 1)) for g in groups)


@dataclass
class Seen:
    """What this script's watches saw, with monotonic receive times; thread-safe."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    cluster: dict[tuple[str, str], float] = field(default_factory=dict)  # (ns, job)
    cluster_job: dict[tuple[str, str], str] = field(default_factory=dict)  # (ns, rc) → job
    job_clusters: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # the reverse
    running: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    driver_running: dict[str, float] = field(default_factory=dict)
    gone: dict[tuple[str, str], float] = field(default_factory=dict)  # (ns, pod) deleted
    drivers: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # uid, added
    # Ray pods' first sighting and first sighting bound to a node: (ns, pod) → (cluster, at)
    added: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)
    bound: dict[tuple[str, str], float] = field(default_factory=dict)
    # Seconds from a pod's Ready time as kwok stamped it (whole seconds, truncated: 0.5 s on
    # average is rounding) to this script seeing it Running: how far behind its own watch
    # (and kwok's write of the status) ran, and so how far to trust the figures.
    lag: list[float] = field(default_factory=list)

    def on_cluster(self, obj: dict[str, Any], at: float) -> None:
        meta = obj["metadata"]
        ns = meta["namespace"]
        job = (meta.get("labels") or {}).get(names.LABEL_JOB)
        if job is None:
            owner = next((r for r in meta.get("ownerReferences") or []
                          if r.get("kind") == "RayJob"), None)
            job = owner["name"] if owner else None
        if job is None:
            return
        with self.lock:
            self.cluster.setdefault((ns, job), at)
            self.cluster_job[(ns, meta["name"])] = job
            self.job_clusters.setdefault((ns, job), set()).add(meta["name"])

    def on_pod(self, kind: str, obj: dict[str, Any], at: float) -> None:
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        labels = meta.get("labels") or {}
        with self.lock:
            if kind == "DELETED":
                # The latest deletion (a watch opened again lists, it never repeats one): the
                # driver's name is reused by every new driver.
                self.gone[(ns, name)] = at
                return
            if labels.get(names.LABEL_COMPONENT) == DRIVER:
                job = labels[names.LABEL_JOB]
                uids = self.drivers.setdefault(job, [])
                if meta["uid"] not in {u for u, _ in uids}:
                    uids.append((meta["uid"], at))
                if (obj.get("status") or {}).get("phase") == "Running":
                    self.driver_running.setdefault(job, at)
                return
            cluster = labels.get("ray.io/cluster")
            if cluster is None:
                return
            self.added.setdefault((ns, name), (cluster, at))
            if (obj.get("spec") or {}).get("nodeName"):
                self.bound.setdefault((ns, name), at)
            if (obj.get("status") or {}).get("phase") == "Running":
                pods = self.running.setdefault((ns, cluster), {})
                if name not in pods:
                    pods[name] = at
                    ready = ready_time(obj)
                    if ready is not None:
                        self.lag.append(time.time() - ready)

    def replacement(self, ns: str, job: str, after: float) -> tuple[float, float, float] | None:
        """When the first Ray pod of `job` made after `after` was seen, seen bound and seen
        Running (None: not all three seen)."""
        with self.lock:
            made = sorted((at, pod) for (n, pod), (c, at) in self.added.items()
                          if n == ns and at > after and self.cluster_job.get((n, c)) == job)
            if not made:
                return None
            at, pod = made[0]
            cluster = self.added[(ns, pod)][0]
            bound = self.bound.get((ns, pod))
            running = self.running.get((ns, cluster), {}).get(pod)
        return None if bound is None or running is None else (at, bound, running)

    def all_running(self, ns: str, job: str, want: int) -> float | None:
        """When the job's RayCluster had `want` pods Running (None: not yet)."""
        with self.lock:
            clusters = self.job_clusters.get((ns, job), set())
            times = sorted(t for c in clusters for t in self.running.get((ns, c), {}).values())
        return times[want - 1] if len(times) >= want else None


def ready_time(pod: dict[str, Any]) -> float | None:
    """When the pod's Ready condition last turned (epoch seconds), if it says."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") == "True" \
                and cond.get("lastTransitionTime"):
            return datetime.fromisoformat(cond["lastTransitionTime"]).timestamp()
    return None


def watch_forever(list_fn: Callable[..., Any], handle: Callable[[str, dict[str, Any], float],
                                                                  None],
                  stop: threading.Event, **kw: Any) -> None:
    """Watch for as long as the run lasts, each re-opened watch resuming where the last one
    ended. Events are parsed as JSON only: turning each into the client's model objects, and
    listing everything again at every re-opening, would make this script the slowest reader
    at 500 jobs, its watch minutes behind and the namespace listed last (the RLJobs') seen
    late (docs/benchmarks/operator-scale.md). Only a watch too old to resume (410 Gone)
    lists again."""
    from kubernetes.watch.watch import iter_resp_lines

    version: str | None = None
    while not stop.is_set():
        opts: dict[str, Any] = {"watch": True, "allow_watch_bookmarks": True,
                                "timeout_seconds": 120, "_request_timeout": 150,
                                "_preload_content": False, **kw}
        if version is not None:
            opts["resource_version"] = version
        try:
            resp = list_fn(**opts)
            try:
                for line in iter_resp_lines(resp):
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        if obj.get("code") == 410:  # too old to resume: list again
                            version = None
                        else:
                            print(f"  (watch reopened: {obj.get('message')})", flush=True)
                            stop.wait(1.0)
                        break
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    if event["type"] != "BOOKMARK":
                        handle(event["type"], obj, time.monotonic())
                    if stop.is_set():
                        break
            finally:
                resp.close()
                resp.release_conn()
        except Exception as err:  # a dropped connection: open it again where it was
            if getattr(err, "status", None) == 410:
                version = None
            elif not stop.is_set():
                print(f"  (watch reopened: {type(err).__name__})", flush=True)
                stop.wait(1.0)


def scheduling_failures(core: Any, ns: str) -> str:
    """The scheduler's FailedScheduling events in `ns`: how many pods, and the commonest
    reason (the node counts taken out, so that one reason reads as one)."""
    events: Any = core.list_namespaced_event(ns, field_selector="reason=FailedScheduling")
    pods = {e.involved_object.name for e in events.items}
    reasons = Counter(re.sub(r"\d+", "N", (e.message or "").split(". preemption")[0])
                      for e in events.items)
    top = f"; commonest: {reasons.most_common(1)[0][0]}" if reasons else ""
    return f"{len(pods)} pods{top}"


def stats_line(label: str, values: list[float]) -> str:
    if not values:
        return f"  {label:<40} (none)"
    return (f"  {label:<40} p50 {percentile(values, 50):6.1f}  p95 {percentile(values, 95):6.1f}"
            f"  max {max(values):6.1f} s   (n={len(values)})")


def requests_by(events: list[dict[str, Any]], ns: str | None, agents: tuple[str, ...]) -> int:
    return sum(1 for e in events
               if (e.get("userAgent") or "").startswith(agents)
               and (ns is None or (e.get("objectRef") or {}).get("namespace") == ns))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=50, help="RLJobs, and as many RayJobs")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=None,
                   help="kwok nodes (default: a quarter more GPUs than both halves ask for); "
                   "more to see what the node count alone costs")
    p.add_argument("--interval", type=float, default=10.0, help="operator resync, s")
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--failures", type=int, default=20, help="RLJobs whose trainer is killed")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--failure-timeout", type=float, default=600.0,
                   help="seconds for every failed job to get a new driver")
    p.add_argument("--max-ratio", type=float, default=1.1)
    p.add_argument("--kuberay-concurrency", type=int, default=1,
                   help="KubeRay's --reconcile-concurrency (its default 1: one worker for "
                   "every RayCluster of both halves)")
    args = p.parse_args()
    n: int = args.jobs
    # A quarter more GPUs than both halves ask for: an 8-GPU trainer needs a whole node, and
    # once 2-GPU engines are spread over every node the last trainers would find none.
    nodes = max(args.nodes or 0, -(-2 * n * GPUS_PER_JOB * 5 // (4 * args.gpus_per_node)))

    from kubernetes import client, config

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cp = BenchControlPlane(k8s_bin_dir())
    operator: Operator | None = None
    stop = threading.Event()
    breaches: list[str] = []
    try:
        took = start_sim_plane(cp, nodes, args.gpus_per_node, "sim",
                               kuberay_concurrency=args.kuberay_concurrency)
        print(f"control plane with {nodes} kwok nodes × {args.gpus_per_node} GPUs up in "
              f"{took:.0f} s", flush=True)
        for ns in (RLJOB_NS, RAYJOB_NS):
            cp.kubectl("create", "namespace", ns)
        log = Path(tempfile.mkdtemp(prefix="bench-")) / "operator.log"
        operator = Operator(cp, RLJOB_NS, log, interval=args.interval)
        operator.start()
        assert operator.proc is not None
        op_pid = operator.proc.pid
        ray_pid = cp.processes["kuberay-operator"].popen.pid
        api_client = config.new_client_from_config(config_file=str(cp.kubeconfig))
        api_client.user_agent = OWN_AGENT
        custom = client.CustomObjectsApi(api_client)
        core = client.CoreV1Api(api_client)

        seen = Seen()
        watch_client = config.new_client_from_config(config_file=str(cp.kubeconfig))
        watch_client.user_agent = OWN_AGENT
        wcustom = client.CustomObjectsApi(watch_client)
        wcore = client.CoreV1Api(watch_client)
        threads = [
            threading.Thread(target=watch_forever, daemon=True, args=(
                wcustom.list_cluster_custom_object,
                lambda _k, o, at: seen.on_cluster(o, at), stop),
                kwargs={"group": "ray.io", "version": "v1", "plural": "rayclusters"}),
            threading.Thread(target=watch_forever, daemon=True, args=(
                wcore.list_pod_for_all_namespaces, seen.on_pod, stop)),
        ]
        for th in threads:
            th.start()

        before_op, before_ray = proc_stats(op_pid), proc_stats(ray_pid)
        created: dict[tuple[str, str], float] = {}
        want: dict[tuple[str, str], int] = {}
        ramp_start = datetime.now(UTC)
        t0 = time.monotonic()
        for i in range(n):
            name = f"job-{i:03d}"
            rl = bench_manifest(name)
            rayjob, claim = rayjob_manifests(name, rl)
            created[(RLJOB_NS, name)] = time.monotonic()
            custom.create_namespaced_custom_object("rljob.io", "v1alpha1", RLJOB_NS, "rljobs", rl)
            created[(RAYJOB_NS, name)] = time.monotonic()
            body: Any = claim  # the client takes plain dicts as well as its models
            core.create_namespaced_persistent_volume_claim(RAYJOB_NS, body)
            custom.create_namespaced_custom_object("ray.io", "v1", RAYJOB_NS, "rayjobs", rayjob)
            want[(RLJOB_NS, name)] = want[(RAYJOB_NS, name)] = expected_pods(rayjob)
        create_s = time.monotonic() - t0

        done: dict[tuple[str, str], float] = {}

        def all_up() -> bool:
            for key in created:
                if key not in done:
                    at = seen.all_running(*key, want[key])
                    if at is not None:
                        done[key] = at
            drivers = sum(1 for ns, job in created if ns == RLJOB_NS
                          and job in seen.driver_running)
            return len(done) == len(created) and drivers == n

        wait_for(all_up, timeout=args.timeout, interval=0.5,
                 what="every job's pods Running",
                 describe=lambda: f"{len(done)} of {len(created)} jobs' pods running; "
                                  f"operator log:\n{operator.tail(20) if operator else ''}")

        def not_running() -> list[str]:
            listed: Any = custom.list_namespaced_custom_object("rljob.io", "v1alpha1",
                                                               RLJOB_NS, "rljobs")
            return [j["metadata"]["name"] for j in listed["items"]
                    if (j.get("status") or {}).get("phase") != "Running"]

        # The ramp ends when the operator has said so too: its last jobs' Running status and
        # event, written just after their driver runs, belong to the ramp, not the idle window.
        wait_for(lambda: not not_running(), timeout=args.timeout, interval=0.5,
                 what="every RLJob's phase Running",
                 describe=lambda: f"not Running: {not_running()}")
        ramp_end = datetime.now(UTC)
        turned_away = {ns: scheduling_failures(core, ns) for ns in (RLJOB_NS, RAYJOB_NS)}
        wall = max(done.values()) - t0
        ramp_op, ramp_ray = proc_stats(op_pid), proc_stats(ray_pid)

        def lat(ns: str, table: dict[tuple[str, str], float]) -> list[float]:
            return [table[k] - created[k] for k in created if k[0] == ns and k in table]

        cluster_lat = {ns: lat(ns, seen.cluster) for ns in (RLJOB_NS, RAYJOB_NS)}
        pods_lat = {ns: lat(ns, done) for ns in (RLJOB_NS, RAYJOB_NS)}
        driver_lat = [seen.driver_running[j] - created[(RLJOB_NS, j)]
                      for ns, j in created if ns == RLJOB_NS]

        # Idle: nothing changes.
        idle_start = datetime.now(UTC)
        time.sleep(args.idle_seconds)  # the measurement window itself, not a synchronisation
        idle_end = datetime.now(UTC)
        idle_op, idle_ray = proc_stats(op_pid), proc_stats(ray_pid)

        ramp_events = audit_requests(cp.audit_log, ramp_start, ramp_end)
        idle_events = audit_requests(cp.audit_log, idle_start, idle_end)
        ramp_min = (ramp_end - ramp_start).total_seconds() / 60
        idle_min = (idle_end - idle_start).total_seconds() / 60

        def per_job(events: list[dict[str, Any]], ns: str, operator_side: bool) -> float:
            count = requests_by(events, ns, (KUBERAY_AGENT,))
            if operator_side:
                count += requests_by(events, ns, OPERATOR_AGENTS)
                count += sum(1 for e in events
                             if (e.get("userAgent") or "").startswith(OPERATOR_AGENTS)
                             and not (e.get("objectRef") or {}).get("namespace"))
            return count / n

        print(f"\n{n} RLJobs and {n} RayJobs (InteractiveMode), {GPUS_PER_JOB} GPUs and "
              f"{want[(RLJOB_NS, 'job-000')]} Ray pods each, on {nodes} kwok nodes × "
              f"{args.gpus_per_node} GPUs; operator --interval {args.interval:g} s; KubeRay "
              f"--reconcile-concurrency {args.kuberay_concurrency}; "
              f"{os.cpu_count()} CPU cores")
        print(f"  create calls (both kinds)                {create_s:6.1f} s; wall until all "
              f"pods Running {wall:.1f} s")
        for label, ns in (("RLJob ", RLJOB_NS), ("RayJob", RAYJOB_NS)):
            print(stats_line(f"{label} create → RayCluster created", cluster_lat[ns]))
            print(stats_line(f"{label} create → all Ray pods Running", pods_lat[ns]))
        print(stats_line("RLJob  create → driver pod Running", driver_lat))
        with seen.lock:
            print(stats_line("pod Ready stamp → this script sees it", seen.lag))
        ratio = percentile(pods_lat[RLJOB_NS], 95) / percentile(pods_lat[RAYJOB_NS], 95)
        print(f"  p95 ratio RLJob/RayJob, create → pods Running   {ratio:6.2f}"
              f"   (target ≤ {args.max_ratio})")
        for label, ns in (("RLJob ", RLJOB_NS), ("RayJob", RAYJOB_NS)):
            print(f"  {label} pods the scheduler turned away  {turned_away[ns]}")
        if ratio > args.max_ratio:
            breaches.append(f"p95 ratio {ratio:.2f} > {args.max_ratio}")
        print(f"  API requests / job during the ramp ({ramp_min * 60:.0f} s): RLJob "
              f"{per_job(ramp_events, RLJOB_NS, True):.1f} (operator "
              f"{requests_by(ramp_events, RLJOB_NS, OPERATOR_AGENTS) / n:.1f} + KubeRay "
              f"{requests_by(ramp_events, RLJOB_NS, (KUBERAY_AGENT,)) / n:.1f}), RayJob "
              f"{per_job(ramp_events, RAYJOB_NS, False):.1f}")
        ramp_mine = Counter(describe_request(e) for e in ramp_events
                            if (e.get("userAgent") or "").startswith(OPERATOR_AGENTS))
        print("      operator's ramp requests / job: " + ", ".join(
            f"{k} {v / n:.1f}" for k, v in ramp_mine.most_common(8)))
        op_idle = requests_by(idle_events, RLJOB_NS, OPERATOR_AGENTS) / n / idle_min
        ray_idle = requests_by(idle_events, RLJOB_NS, (KUBERAY_AGENT,)) / n / idle_min
        print(f"  API requests / job / min while idle ({idle_min * 60:.0f} s): RLJob "
              f"{per_job(idle_events, RLJOB_NS, True) / idle_min:.2f} (operator "
              f"{op_idle:.2f} + KubeRay {ray_idle:.2f}), RayJob "
              f"{per_job(idle_events, RAYJOB_NS, False) / idle_min:.2f}")
        mine = Counter(describe_request(e) for e in idle_events
                       if (e.get("userAgent") or "").startswith(OPERATOR_AGENTS))
        print("      operator's idle requests: " + (", ".join(
            f"{k} {v}" for k, v in mine.most_common()) or "none"))
        theirs = Counter(describe_request(e) for e in idle_events
                         if (e.get("userAgent") or "").startswith(KUBERAY_AGENT))
        print("      KubeRay's idle requests:  " + (", ".join(
            f"{k} {v}" for k, v in theirs.most_common(6)) or "none"))

        def cpu(a: ProcStats, b: ProcStats) -> float:
            return b.cpu_seconds - a.cpu_seconds

        idle_s = idle_min * 60
        print(f"  rljob-operator CPU s ramp / idle          {cpu(before_op, ramp_op):6.1f} / "
              f"{cpu(ramp_op, idle_op):.1f} ({cpu(ramp_op, idle_op) / idle_s * 100:.1f} % of a "
              f"core); RSS {idle_op.rss_mib:.0f} MiB, peak {idle_op.peak_rss_mib:.0f} MiB")
        print(f"  kuberay-operator CPU s ramp / idle        {cpu(before_ray, ramp_ray):6.1f} / "
              f"{cpu(ramp_ray, idle_ray):.1f} ({cpu(ramp_ray, idle_ray) / idle_s * 100:.1f} % "
              f"of a core); RSS {idle_ray.rss_mib:.0f} MiB, peak "
              f"{idle_ray.peak_rss_mib:.0f} MiB (it serves both halves)")

        # Failure → new driver: a trainer pod of each of the first `failures` jobs goes.
        victims = [f"job-{i:03d}" for i in range(min(args.failures, n))]
        old_driver = {j: seen.drivers[j][-1][0] for j in victims}
        killed: dict[str, str] = {}
        kill_at = time.monotonic()
        for job in victims:
            found: Any = core.list_namespaced_pod(
                RLJOB_NS, label_selector=f"{names.LABEL_JOB}={job},"
                f"{names.LABEL_COMPONENT}={TRAINER}")
            trainer = str(found.items[0].metadata.name)
            killed[job] = trainer
            core.delete_namespaced_pod(trainer, RLJOB_NS, grace_period_seconds=0)

        def new_driver(job: str) -> float | None:
            with seen.lock:
                later = [at for uid, at in seen.drivers.get(job, []) if uid != old_driver[job]]
            return later[0] if later else None

        def recovered() -> list[str]:
            return [j for j in victims
                    if new_driver(j) is not None and (RLJOB_NS, killed[j]) in seen.gone]

        try:
            wait_for(lambda: len(recovered()) == len(victims), timeout=args.failure_timeout,
                     interval=0.5, what="a new driver for every failed job",
                     describe=lambda: operator.tail(20) if operator else "")
        except Timeout:
            # The figures above stand; the failure line says how many came back, and when.
            breaches.append(f"{len(victims) - len(recovered())} of {len(victims)} failed jobs "
                            f"had no new driver after {args.failure_timeout:.0f} s")
        victims = recovered()
        failure_lat = [float(new_driver(j) or 0) - seen.gone[(RLJOB_NS, killed[j])]
                       for j in victims]

        def ready_again(job: str) -> float:
            """When the job could have a new driver: its old driver pod gone (same name) and
            KubeRay's replacement of the killed pod Running."""
            with seen.lock:
                replaced = min((at for (ns, _c), pods in seen.running.items()
                                if ns == RLJOB_NS and seen.cluster_job.get((ns, _c)) == job
                                for pod, at in pods.items() if at > kill_at), default=kill_at)
                return max(replaced, seen.gone.get((RLJOB_NS, names.driver_name(job)), kill_at))

        operator_lat = [float(new_driver(j) or 0) - ready_again(j) for j in victims]
        # Where the time before "ready again" goes: KubeRay's new pod, its binding by the
        # scheduler, kwok's Running; and the old driver pod's deletion.
        parts: dict[str, list[float]] = {"created": [], "bound": [], "running": [],
                                         "driver": []}
        for j in victims:
            gone = seen.gone[(RLJOB_NS, killed[j])]
            made = seen.replacement(RLJOB_NS, j, kill_at)
            if made is not None:
                parts["created"].append(made[0] - gone)
                parts["bound"].append(made[1] - made[0])
                parts["running"].append(made[2] - made[1])
            driver_gone = seen.gone.get((RLJOB_NS, names.driver_name(j)))
            if driver_gone is not None:  # a watch listing again after 410 misses deletions
                parts["driver"].append(driver_gone - gone)
        stop.set()

        print(stats_line("failure: pod seen gone → new driver", failure_lat))
        print(stats_line("  of it the operator's: ready again → new driver", operator_lat))
        print(stats_line("  pod seen gone → KubeRay's new pod seen", parts["created"]))
        print(stats_line("  new pod seen → seen bound (scheduler)", parts["bound"]))
        print(stats_line("  seen bound → seen Running (kwok)", parts["running"]))
        print(stats_line("  pod seen gone → old driver seen gone", parts["driver"]))
        if failure_lat and percentile(failure_lat, 95) >= 5.0:
            breaches.append(f"failure → new driver p95 {percentile(failure_lat, 95):.1f} s")
        api_client.close()
    finally:
        stop.set()
        if operator is not None:
            operator.stop()
        cp.stop()
    for breach in breaches:
        print(f"BREACH: {breach}")
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
