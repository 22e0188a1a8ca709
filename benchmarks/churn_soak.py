"""Churn soak: RLJobs made and deleted for minutes with pods killed under them; at the end
nothing they made is left, no job is stuck, and the operator holds no more memory than it
did once warmed up.

Starts the harness's control plane (etcd, kube-apiserver, scheduler, controller-manager
with its garbage collector, volume provisioner, kwok GPU nodes, KubeRay) and the real
`rljob-operator` on one namespace. For `--seconds` it creates `--jobs` RLJobs at an even
pace (the operator tests' small job: a head, 1 trainer × 2 GPUs, 2 engines × 1 GPU, a
driver), deletes each after a random lifetime in [`--min-life`, `--max-life`] seconds, and
every `--kill-every` seconds deletes (grace 0) a random pod of a random live job. The first
`--survivors` jobs are kept through the churn and past it: they live through all of its
kills (each kill a restart: Recovering, a new driver, Running; maxRestarts 1,000, more
than a run can use). Then:

- stuck phases: every survivor must be Running within `--settle` seconds of the last kill,
  else it is stuck (the survivors' restarts and the kills that hit them are printed);
- the survivors are deleted; leaked children: every object labelled `rljob.io/job` (pods,
  RayClusters, ConfigMaps, Secrets, ServiceAccounts, Roles, RoleBindings, claims) must be
  gone within `--settle` seconds, the operator's per-phase job gauge back to 0, and
  `rljob_operator_remembered` (cached objects, failure hints, per-job state, tracked jobs)
  at 0;
- memory: the operator's RSS at the end of the churn against its RSS after
  `--warmup` seconds of it (the same load: jobs are alive in both), within ±10 %.

Prints the figures and exits non-zero on any breach.

    .venv/bin/python -m benchmarks.churn_soak                          # 1,000 jobs, 10 min
    .venv/bin/python -m benchmarks.churn_soak --jobs 100 --seconds 60 --warmup 20
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.sim_scale import proc_stats, start_sim_plane
from rljob_operator import names
from tests.controlplane import ControlPlane, k8s_bin_dir
from tests.operator.harness import job_manifest
from tests.operator_process import POOL_LABEL, Operator
from tests.polling import Timeout, wait_for

NAMESPACE = "churn"
POOL = "churn"
GPUS_PER_JOB = 4
# maxRestarts 1,000, beyond any run's kills: a survivor lives through the whole churn and
# may lose many pods; the harness's short backoff keeps recoveries within the churn.
RECOVERY = {"maxRestarts": 1000, "backoffSeconds": 1, "maxBackoffSeconds": 2}
CHILD_KINDS = ("pods", "rayclusters.ray.io", "configmaps", "secrets", "serviceaccounts",
               "roles.rbac.authorization.k8s.io", "rolebindings.rbac.authorization.k8s.io",
               "persistentvolumeclaims")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=600.0, help="length of the churn")
    p.add_argument("--min-life", type=float, default=20.0)
    p.add_argument("--max-life", type=float, default=60.0)
    p.add_argument("--kill-every", type=float, default=2.0)
    p.add_argument("--survivors", type=int, default=20)
    p.add_argument("--warmup", type=float, default=120.0)
    p.add_argument("--settle", type=float, default=180.0)
    p.add_argument("--interval", type=float, default=10.0, help="operator resync, s")
    p.add_argument("--seed", type=int, default=16)
    args = p.parse_args()
    rng = random.Random(args.seed)
    # Jobs alive at once: the creation rate times the longest life, and the survivors.
    alive = int(args.jobs / args.seconds * args.max_life) + args.survivors + 10
    nodes = -(-alive * GPUS_PER_JOB // 8)

    from kubernetes import client, config

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cp = ControlPlane(k8s_bin_dir())
    operator: Operator | None = None
    breaches: list[str] = []
    try:
        start_sim_plane(cp, nodes, 8, "churn")
        cp.kubectl("label", "nodes", "--all", f"{POOL_LABEL}={POOL}")
        cp.kubectl("create", "namespace", NAMESPACE)
        log = Path(tempfile.mkdtemp(prefix="churn-")) / "operator.log"
        operator = Operator(cp, NAMESPACE, log, interval=args.interval)
        operator.start()
        assert operator.proc is not None
        pid = operator.proc.pid
        api_client = config.new_client_from_config(config_file=str(cp.kubeconfig))
        custom = client.CustomObjectsApi(api_client)
        core = client.CoreV1Api(api_client)
        print(f"{nodes} kwok nodes; churn of {args.jobs} RLJobs over {args.seconds:.0f} s, "
              f"a pod killed every {args.kill_every:g} s; {os.cpu_count()} CPU cores",
              flush=True)

        def delete_job(name: str) -> None:
            try:
                custom.delete_namespaced_custom_object("rljob.io", "v1alpha1", NAMESPACE,
                                                       "rljobs", name)
            except client.ApiException as err:
                if err.status != 404:
                    raise

        t0 = time.monotonic()
        pace = args.seconds / args.jobs
        deaths: dict[str, float] = {}  # job → when it is deleted
        live: list[str] = []
        made = deleted = kills = 0
        next_kill = t0 + args.kill_every
        warm_rss: float | None = None
        survivors = {f"churn-{i:04d}" for i in range(min(args.survivors, args.jobs))}
        survivor_kills = 0
        last_report = t0
        while True:
            now = time.monotonic()
            if made < args.jobs and now >= t0 + made * pace:
                name = f"churn-{made:04d}"
                custom.create_namespaced_custom_object(
                    "rljob.io", "v1alpha1", NAMESPACE, "rljobs",
                    job_manifest(name, POOL, recovery=RECOVERY))
                live.append(name)
                if name not in survivors:
                    deaths[name] = now + rng.uniform(args.min_life, args.max_life)
                made += 1
            for name in [n for n, at in deaths.items() if at <= now]:
                delete_job(name)
                del deaths[name]
                live.remove(name)
                deleted += 1
            if now >= next_kill and live and now < t0 + args.seconds:
                victim = rng.choice(live)
                pods: Any = core.list_namespaced_pod(
                    NAMESPACE, label_selector=f"{names.LABEL_JOB}={victim}")
                if pods.items:
                    pod = rng.choice(pods.items).metadata.name
                    try:
                        core.delete_namespaced_pod(pod, NAMESPACE, grace_period_seconds=0)
                        kills += 1
                        survivor_kills += victim in survivors
                    except client.ApiException as err:
                        if err.status != 404:
                            raise
                next_kill += args.kill_every
            if warm_rss is None and now - t0 >= args.warmup:
                warm_rss = proc_stats(pid).rss_mib
                print(f"  warm-up RSS after {args.warmup:.0f} s: {warm_rss:.0f} MiB", flush=True)
            if now - last_report >= 60:
                last_report = now
                st = proc_stats(pid)
                print(f"  t={now - t0:4.0f} s: {made} made, {deleted} deleted, {len(live)} "
                      f"live, {kills} pods killed; operator RSS {st.rss_mib:.0f} MiB, "
                      f"CPU {st.cpu_seconds:.0f} s", flush=True)
            if made >= args.jobs and not deaths and now >= t0 + args.seconds:
                break
            time.sleep(0.05)  # pacing of this load generator, not a synchronisation
        churn_s = time.monotonic() - t0
        end_rss = proc_stats(pid).rss_mib

        # Stuck phases: every survivor Running again after the kills.
        def phases() -> dict[str, str]:
            body: Any = custom.list_namespaced_custom_object("rljob.io", "v1alpha1", NAMESPACE,
                                                             "rljobs")
            return {j["metadata"]["name"]: (j.get("status") or {}).get("phase", "")
                    for j in body["items"]}

        with contextlib.suppress(Timeout):  # what is not Running by then is stuck
            wait_for(lambda: all(ph == "Running" for ph in phases().values()),
                     timeout=args.settle, interval=1.0, what="every survivor Running")
        final = phases()
        stuck = {n: ph for n, ph in final.items() if ph != "Running"}
        listed: Any = custom.list_namespaced_custom_object("rljob.io", "v1alpha1", NAMESPACE,
                                                           "rljobs")
        restarts = sum(int(((j.get("status") or {}).get("recovery") or {}).get("restarts") or 0)
                       for j in listed["items"])

        for name in list(final):
            delete_job(name)

        def leaked() -> dict[str, int]:
            out = {}
            for kind in CHILD_KINDS:
                items = cp.get_json(kind, "-n", NAMESPACE, "-l", names.LABEL_JOB)["items"]
                if items:
                    out[kind] = len(items)
            return out

        with contextlib.suppress(Timeout):  # what is left by then has leaked
            wait_for(lambda: not leaked() and not phases(), timeout=args.settle, interval=1.0,
                     what="every child collected")
        left = leaked()
        jobs_left = len(phases())
        gauge = operator.metric("rljob_jobs")
        # Cached objects, failure hints, per-job state and tracked jobs: all gone with the
        # jobs (polled: the last deletions' watch events may still be on their way).
        with contextlib.suppress(Timeout):
            wait_for(lambda: operator.metric("rljob_operator_remembered") == 0, timeout=30,
                     interval=1.0, what="the operator to hold nothing of the deleted jobs")
        remembered = operator.metric("rljob_operator_remembered")
        after = proc_stats(pid)

        drift = (end_rss - (warm_rss or end_rss)) / (warm_rss or end_rss) * 100
        print(f"\nchurn of {made} RLJobs ({deleted} deleted during it, {len(final)} kept) in "
              f"{churn_s:.0f} s with {kills} pods killed, {survivor_kills} of them the "
              f"survivors'; {restarts} restarts among survivors")
        print(f"  stuck phases (survivors not Running after {args.settle:.0f} s)   "
              f"{len(stuck)}  {stuck or ''}")
        print(f"  leaked children after all deletes      {sum(left.values())}  {left or ''}")
        print(f"  RLJobs left / operator's job gauge     {jobs_left} / {gauge:.0f}")
        print(f"  held by the operator after all deletes {remembered:.0f} (cached objects, "
              "failure hints, per-job state, tracked jobs)")
        print(f"  operator RSS warm-up / end of churn     {warm_rss or 0:.0f} / {end_rss:.0f} MiB"
              f" ({drift:+.1f} %); after all deletes {after.rss_mib:.0f} MiB, peak "
              f"{after.peak_rss_mib:.0f} MiB")
        print(f"  operator CPU s total                    {after.cpu_seconds:.0f}")
        if stuck:
            breaches.append(f"{len(stuck)} stuck phases")
        if left or jobs_left or gauge or remembered:
            breaches.append(f"leaked: {left}, {jobs_left} RLJobs, gauge {gauge:.0f}, "
                            f"{remembered:.0f} held by the operator")
        if abs(drift) > 10:
            breaches.append(f"RSS drift {drift:+.1f} %")
        api_client.close()
    finally:
        if operator is not None:
            operator.stop()
        cp.stop()
    for breach in breaches:
        print(f"BREACH: {breach}")
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
