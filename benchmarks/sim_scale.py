"""The operator at scale on simulated GPU nodes: how fast jobs come up, and what they cost
the API server and the operator once they run.

Starts the harness's control plane (etcd, kube-apiserver, scheduler, controller-manager,
kwok, KubeRay), adds `--nodes` kwok nodes × `--gpus-per-node` GPUs, runs the real
`rljob-operator` (one namespace, resync `--interval`), creates `--jobs` RLJobs shaped like
examples/qwen-7b-megatron-sglang.yaml (8 trainer GPUs + 4 engines × 2 GPUs: 7 pods, 16 GPUs
per job) as fast as the API server takes them, then leaves everything idle for
`--idle-seconds`. Printed:

- creation → Running latency per job (p50/p95/max): from just before the create call to the
  first poll (every 0.25 s) that shows phase Running; and wall time until all run;
- API requests per job per minute while idle, counted exactly from the API server's audit
  log (every request the operator's two clients, kopf's and the kubernetes client's, made
  in the window), with a breakdown by verb and resource; the operator's own reconcile and
  status-write counters over the same window, from its Prometheus metrics;
- operator CPU seconds (during the ramp, and while idle) and RSS (now, and peak), from
  /proc of the operator process.

    .venv/bin/python -m benchmarks.sim_scale                  # 200 nodes, 50 jobs
    .venv/bin/python -m benchmarks.sim_scale --nodes 20 --jobs 5 --idle-seconds 30

(run from the repository root: it imports the test harness from `tests/`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from tests.controlplane import REPO, ControlPlane, k8s_bin_dir
from tests.controlplane_audit import audit_requests, describe_request
from tests.operator_process import Operator
from tests.polling import wait_for

EXAMPLE = REPO / "examples" / "qwen-7b-megatron-sglang.yaml"
CRD = REPO / "crds" / "rljob.io_rljobs.yaml"
NAMESPACE = "sim-scale"
OWN_AGENT = "rljob-sim-scale"  # this script's client: never counted as the operator's
# The operator's clients: kopf's watches (aiohttp) and the kubernetes client's calls.
OPERATOR_AGENTS = ("kopf/", "OpenAPI-Generator/")
POLL = 0.25

# Node heartbeats and leases (kwok's and the components') are left out: the operator touches
# neither. A watch is counted when its response starts, any other request when it completes
# (a watch opened in the window completes only after it).
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: None
  resources:
  - {group: "coordination.k8s.io", resources: [leases]}
  - {group: "", resources: [nodes/status]}
- level: Metadata
"""


class AuditedControlPlane(ControlPlane):
    """The harness's control plane, with the API server writing every request of every
    client to its audit log (the only place that sees them all, tagged with user agents)."""

    def audit_policy(self) -> str:
        return AUDIT_POLICY


def job_manifest(name: str) -> dict[str, Any]:
    """The production example under another name, minus what the harness cannot provide: the
    model and data PVCs and the checkpoint PVC it names (the operator makes the job's own
    checkpoint claim instead, which the harness's provisioner binds), the PriorityClass, and
    the H200 node selector. The trainer asks for
    half of a fake node's 512 GiB instead of all of it: with all of it, a trainer fits only
    on a node nothing else runs on, and once rollout pods are spread over every node the
    last trainers stay Pending (the operator then reports them Unschedulable, correctly)."""
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name}
    spec = doc["spec"]
    for section in ("model", "data", "checkpoint"):
        spec[section].pop("pvc", None)
    spec["trainer"]["resources"]["requests"]["memory"] = "256Gi"
    spec["scheduling"] = {"tolerations": spec["scheduling"]["tolerations"]}
    return doc


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil without floats
    return ordered[int(rank) - 1]


@dataclass(frozen=True)
class ProcStats:
    cpu_seconds: float
    rss_mib: float
    peak_rss_mib: float


def proc_stats(pid: int) -> ProcStats:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15 of stat)
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)

    def kib(key: str) -> float:
        return int(status[key].split()[0]) / 1024

    return ProcStats(ticks / os.sysconf("SC_CLK_TCK"), kib("VmRSS"), kib("VmHWM"))


def phases(api: Any) -> dict[str, str]:
    body = api.list_namespaced_custom_object("rljob.io", "v1alpha1", NAMESPACE, "rljobs")
    return {j["metadata"]["name"]: (j.get("status") or {}).get("phase", "")
            for j in body["items"]}


def start_sim_plane(cp: ControlPlane, nodes: int, gpus_per_node: int, prefix: str,
                    kuberay_concurrency: int = 1) -> float:
    """The benchmarks' control plane: API server and etcd with the CRD, controller-manager,
    volume provisioner, scheduler, `nodes` kwok GPU nodes and KubeRay; returns seconds taken."""
    t = time.monotonic()
    # One Lease renewal per node every lease/4 s: at 40 s, 2,500 nodes would ask for 250
    # writes a second, more than kwok gets done on 2 cores, and nodes would go NotReady
    # (then jobs restart as NodeLost). Hold renewals near 10 a second whatever the count.
    lease = max(40, nodes * 4 // 10)
    cp.start_core()
    cp.install_crds(CRD)
    cp.start_controller_manager(f"--node-monitor-grace-period={lease}s")
    cp.start_volume_provisioner()
    cp.start_scheduler()
    cp.start_kwok(nodes=nodes, gpus_per_node=gpus_per_node, prefix=prefix, lease_seconds=lease)
    cp.start_kuberay(reconcile_concurrency=kuberay_concurrency)
    return time.monotonic() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=200, help="kwok GPU nodes")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--jobs", type=int, default=50, help="RLJobs (16 GPUs each)")
    p.add_argument("--interval", type=float, default=10.0,
                   help="operator resync interval, s (its production default)")
    p.add_argument("--idle-seconds", type=float, default=60.0,
                   help="length of the idle measurement window")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="give up when jobs are not all Running after this many seconds")
    args = p.parse_args()
    jobs: int = args.jobs
    if args.jobs * 16 > args.nodes * args.gpus_per_node:
        p.error(f"{args.jobs} jobs need {args.jobs * 16} GPUs; the nodes have "
                f"{args.nodes * args.gpus_per_node}: add --nodes or lower --jobs")

    from kubernetes import client, config

    # A plain SIGTERM would skip `finally` and leave the control plane running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    cp = AuditedControlPlane(k8s_bin_dir())
    operator: Operator | None = None
    try:
        took = start_sim_plane(cp, args.nodes, args.gpus_per_node, "sim")
        print(f"control plane with {args.nodes} kwok nodes × {args.gpus_per_node} GPUs up in "
              f"{took:.0f} s", flush=True)
        cp.kubectl("create", "namespace", NAMESPACE)
        log = Path(tempfile.mkdtemp(prefix="sim-scale-")) / "operator.log"
        operator = Operator(cp, NAMESPACE, log, interval=args.interval)
        operator.start()
        assert operator.proc is not None
        pid = operator.proc.pid
        api_client = config.new_client_from_config(config_file=str(cp.kubeconfig))
        api_client.user_agent = OWN_AGENT
        api = client.CustomObjectsApi(api_client)

        # Ramp: create every job, then poll until all run.
        cpu_before = proc_stats(pid).cpu_seconds
        created: dict[str, float] = {}
        running: dict[str, float] = {}
        t0 = time.monotonic()
        for i in range(args.jobs):
            name = f"job-{i:03d}"
            created[name] = time.monotonic()
            api.create_namespaced_custom_object("rljob.io", "v1alpha1", NAMESPACE, "rljobs",
                                                job_manifest(name))
        create_s = time.monotonic() - t0

        def all_running() -> bool:
            seen = time.monotonic()
            for name, phase in phases(api).items():
                if phase == "Running" and name not in running:
                    running[name] = seen
            return len(running) == jobs

        wait_for(all_running, timeout=args.timeout, interval=POLL,
                 what=f"all {args.jobs} jobs Running",
                 describe=lambda: f"{len(running)} running; operator log:\n"
                                  f"{operator.tail(20) if operator else ''}")
        wall = max(running.values()) - t0
        latencies = [running[n] - created[n] for n in created]
        ramp = proc_stats(pid)

        # Idle: nothing changes; count what the operator still asks the API server.
        reconciles0 = operator.metric("rljob_operator_reconciles_total")
        writes0 = operator.metric("rljob_operator_status_writes_total")
        start = datetime.now(UTC)
        time.sleep(args.idle_seconds)  # the measurement window itself, not a synchronisation
        end = datetime.now(UTC)
        idle = proc_stats(pid)
        reconciles = operator.metric("rljob_operator_reconciles_total") - reconciles0
        writes = operator.metric("rljob_operator_status_writes_total") - writes0
        assert all(ph == "Running" for ph in phases(api).values()), "a job left Running"
        api_client.close()

        window = (end - start).total_seconds()
        events = audit_requests(cp.audit_log, start, end)
        ours = [e.get("userAgent", "").startswith(OPERATOR_AGENTS) for e in events]
        mine = [e for e, is_ours in zip(events, ours, strict=True) if is_ours]
        per_min = 60 / window / args.jobs
        kinds = Counter(describe_request(e) for e in mine)
        pods = len(cp.get_json("pods", "-n", NAMESPACE)["items"])

        print(f"\n{args.jobs} RLJobs ({pods} pods, {args.jobs * 16} of "
              f"{args.nodes * args.gpus_per_node} GPUs) on {args.nodes} kwok nodes; "
              f"operator --interval {args.interval:g} s, {os.cpu_count()} CPU cores")
        print(f"  create calls for all jobs        {create_s:8.1f} s")
        print(f"  creation → Running  p50          {percentile(latencies, 50):8.1f} s")
        print(f"                      p95          {percentile(latencies, 95):8.1f} s")
        print(f"                      max          {max(latencies):8.1f} s")
        print(f"  wall time until all Running      {wall:8.1f} s")
        print(f"  idle window                      {window:8.1f} s")
        print(f"  API requests / job / min (audit) {len(mine) * per_min:8.1f}")
        for kind, count in kinds.most_common():
            print(f"      {kind:<28} {count * per_min:8.2f}")
        print(f"  reconciles / job / min (metrics) {reconciles * per_min:8.1f}")
        print(f"  status writes while idle         {writes:8.0f}")
        print(f"  operator CPU s, ramp             {ramp.cpu_seconds - cpu_before:8.1f}")
        print(f"  operator CPU s, idle window      {idle.cpu_seconds - ramp.cpu_seconds:8.1f}"
              f"   ({(idle.cpu_seconds - ramp.cpu_seconds) / window * 100:.1f} % of a core)")
        print(f"  operator CPU s, total            {idle.cpu_seconds:8.1f}")
        print(f"  operator RSS now / peak          {idle.rss_mib:8.0f} / "
              f"{idle.peak_rss_mib:.0f} MiB")
        others = Counter(e.get("userAgent", "").split(" ")[0]
                         for e, is_ours in zip(events, ours, strict=True) if not is_ours)
        print("  other clients' requests in the window: " +
              ", ".join(f"{ua or '?'} {n}" for ua, n in others.most_common(6)))
    finally:
        if operator is not None:
            operator.stop()
        cp.stop()


if __name__ == "__main__":
    main()
