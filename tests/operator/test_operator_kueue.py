"""RLJobs queued in Kueue, on the real control plane with a real Kueue controller (built
from its pinned Go module by hack/k8s-bins) and kwok GPU nodes, the operator running with
the chart's RBAC (kueue.enabled): a ClusterQueue of 16 GPUs, three 8-GPU jobs (two
admitted, one queued), a higher-priority job that preempts one, which a real `rljob run`
playing its driver saves on SIGTERM and resumes from once Kueue admits it again; the GPUs
the queued jobs' pods request never exceed the quota (sampled all along) and every pod's
real requests (KubeRay's additions included) are within what Kueue admitted; a job without
a queue runs at once; edits, suspension, the end of a job and deletion keep the Workload in
step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_api import env
from rljob_operator import kueue
from tests.chart.helm import CHART, helm
from tests.controlplane import GPU, REPO, ControlPlane
from tests.kueue_checks import admitted_within, requests
from tests.operator.harness import job_manifest
from tests.operator.jobs import patch_pod_phase, pods, status, wait_phase
from tests.operator_process import POOL_LABEL, Operator
from tests.polling import wait_for
from tests.processes import reap
from tests.runtime.jobs import job_file

pytestmark = pytest.mark.controlplane
Obj = dict[str, Any]
QUOTA_GPUS = 16
TAINT = "rljob.io/kueue-test"
EXIT_TERMINATED = 143


@pytest.fixture
def kueue_operator(cluster: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[Operator]:
    """The operator with --kueue, as the chart (kueue.enabled, namespace scope) lets it:
    with its ServiceAccount's token, not the admin's."""
    if "kueue" not in cluster.processes:
        cluster.start_kueue()
    suffix = uuid.uuid4().hex[:6]
    release, home = f"kq-{suffix}", f"kq-sys-{suffix}"
    helm(cluster.bins, "install", release, str(CHART), "--namespace", home, "--create-namespace",
         "--set", "crds.install=false", "--set", "rbac.scope=namespace",
         "--set", f"watchNamespace={namespace}", "--set", "kueue.enabled=true",
         kubeconfig=cluster.kubeconfig)
    token = cluster.kubectl("create", "token", f"{release}-rljob-operator", "-n", home,
                            "--duration=1h").stdout.strip()
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["users"] = [{"name": "admin", "user": {"token": token}}]
    kubeconfig = tmp_path / "chart.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    op = Operator(cluster, namespace, tmp_path / "operator.log", kubeconfig=kubeconfig,
                  extra_args=("--kueue",))
    op.start()
    try:
        yield op
        said = (tmp_path / "operator.log").read_text(errors="replace").lower()
        assert "forbidden" not in said, op.tail()  # the chart granted all it needed
    finally:
        op.stop()
        helm(cluster.bins, "uninstall", release, "--namespace", home,
             kubeconfig=cluster.kubeconfig, check=False)
        cluster.kubectl("delete", "namespace", home, "--wait=false", check=False)


def _queues(cp: ControlPlane, ns: str) -> None:
    """A flavor that puts pods on this test's tainted pool, a ClusterQueue of 16 GPUs for this
    namespace that preempts lower priorities, a LocalQueue, and priorities: Kueue's
    WorkloadPriorityClasses and one scheduling.k8s.io PriorityClass."""
    cp.apply([
        {"apiVersion": kueue.API, "kind": "ResourceFlavor", "metadata": {"name": f"gpu-{ns}"},
         "spec": {"nodeLabels": {POOL_LABEL: ns},
                  "tolerations": [{"key": TAINT, "operator": "Equal", "value": ns,
                                   "effect": "NoSchedule"}]}},
        {"apiVersion": kueue.API, "kind": "ClusterQueue", "metadata": {"name": f"cq-{ns}"},
         "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                  "preemption": {"withinClusterQueue": "LowerPriority"},
                  "resourceGroups": [{
                      "coveredResources": ["cpu", "memory", GPU],
                      "flavors": [{"name": f"gpu-{ns}", "resources": [
                          {"name": "cpu", "nominalQuota": "200"},
                          {"name": "memory", "nominalQuota": "2000Gi"},
                          {"name": GPU, "nominalQuota": str(QUOTA_GPUS)}]}]}]}},
        {"apiVersion": kueue.API, "kind": "LocalQueue",
         "metadata": {"name": "team", "namespace": ns},
         "spec": {"clusterQueue": f"cq-{ns}"}},
        *({"apiVersion": kueue.API, "kind": "WorkloadPriorityClass",
           "metadata": {"name": f"{level}-{ns}"}, "value": value}
          for level, value in (("lowest", 50), ("low", 100), ("high", 1000))),
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
         "metadata": {"name": f"mid-{ns}"}, "value": 500},
    ])


def _tolerating(ns: str) -> list[Obj]:
    return [{"key": TAINT, "operator": "Equal", "value": ns, "effect": "NoSchedule"}]


def _queued_job(name: str, ns: str, priority: str, engines: int = 4) -> Obj:
    """8 GPUs: one trainer pod with 4, four engines with 1 each; placed by the flavor alone.
    `mid` takes its priority from the pods' PriorityClass, the others from Kueue's label."""
    scheduling = {"priorityClassName": f"mid-{ns}"} if priority == "mid" else {}
    body = job_manifest(name, ns, trainer={"backend": "megatron", "replicas": 1,
                                           "gpusPerReplica": 4},
                        rollout={"backend": "sglang", "engines": engines, "gpusPerEngine": 1},
                        scheduling=scheduling)
    body["metadata"]["labels"] = {kueue.LABEL_QUEUE: "team"}
    if priority != "mid":
        body["metadata"]["labels"][kueue.LABEL_PRIORITY_CLASS] = f"{priority}-{ns}"
    return body


class QuotaSampler:
    """Sums the GPUs the queued jobs' live pods request, every half second, from a thread."""

    def __init__(self, cp: ControlPlane, ns: str, jobs: set[str]) -> None:
        self.cp, self.ns, self.jobs = cp, ns, jobs
        self.samples: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            items = self.cp.get_json("pods", "-n", self.ns)["items"]
            self.samples.append(sum(
                requests(p["spec"]).get(GPU, 0.0) for p in items
                if (p["metadata"].get("labels") or {}).get("rljob.io/job") in self.jobs
                and p["status"].get("phase") not in ("Succeeded", "Failed")))
            self.stop.wait(0.5)

    def __enter__(self) -> QuotaSampler:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def _workload(cp: ControlPlane, ns: str, name: str) -> Obj | None:
    """The Workload that Kueue's own job-uid label ties to the RLJob."""
    uid = cp.get_json("rljob", name, "-n", ns)["metadata"]["uid"]
    found = cp.get_json("workloads.kueue.x-k8s.io", "-n", ns, "-l",
                        f"kueue.x-k8s.io/job-uid={uid}")["items"]
    assert len(found) <= 1, found
    return found[0] if found else None


def _runtime(cp: ControlPlane, ns: str, name: str, job: Path, workdir: Path, log: Path,
             *args: str) -> subprocess.Popen[bytes]:
    """A real `rljob run` playing the job's driver pod: its identity and attempt from the
    driver pod the operator made; it reports through the API server."""
    (driver,) = pods(cp, ns, name, "driver")
    pod_env = {e["name"]: e["value"] for e in driver["spec"]["containers"][0]["env"]
               if "value" in e}
    identity = {k: pod_env[k] for k in (env.JOB_NAME, env.JOB_NAMESPACE, env.RESTARTS)}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rljob.cli", "run", str(job), "--workdir", str(workdir),
             *args],
            env={**os.environ, **identity, "KUBECONFIG": str(cp.kubeconfig),
                 "PYTHONPATH": f"{REPO}:{REPO / 'runtime'}"},
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _events(cp: ControlPlane, ns: str, name: str, reason: str) -> list[str]:
    items = cp.get_json("events", "-n", ns, "--field-selector",
                        f"involvedObject.name={name}")["items"]
    return [e["message"] for e in items if e["reason"] == reason]


def _conditions(obj: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def test_queued_jobs_are_admitted_whole_preempted_and_resumed(
        cluster: ControlPlane, namespace: str, kueue_operator: Operator,
        gpu_pool: Callable[..., list[str]], tmp_path: Path) -> None:
    ns = namespace
    nodes = gpu_pool(5, 8)
    for node in nodes:
        cluster.kubectl("taint", "node", node, f"{TAINT}={ns}:NoSchedule")
    _queues(cluster, ns)
    jobs = {"low", "mid", "lowest", "high"}
    describe = lambda: kueue_operator.tail(40)  # noqa: E731

    def phase_is(name: str, phase: str, timeout: float = 120) -> Obj:
        try:
            return wait_phase(cluster, ns, name, phase, timeout=timeout)
        except AssertionError:
            print(describe())
            raise

    def queued(name: str, reason: str) -> Obj:
        """The job's Queued condition once it reads Queued for `reason`."""
        def probe() -> Obj | None:
            st = status(cluster, ns, name)
            found = {c["type"]: c for c in st.get("conditions") or []}.get("Queued") or {}
            return found if st.get("phase") == "Queued" and found.get("reason") == reason \
                else None

        return wait_for(probe, timeout=120, what=f"{name} Queued ({reason})",
                        describe=lambda: json.dumps(status(cluster, ns, name))[-2000:]
                        + "\n" + describe())

    with QuotaSampler(cluster, ns, jobs) as quota:
        cluster.apply(_queued_job("low", ns, "low"), "-n", ns)
        phase_is("low", "Running")
        # Kueue saw the whole job: head, trainer and rollout groups and the driver, with
        # their real requests.
        wl = _workload(cluster, ns, "low")
        assert wl is not None
        sets = {s["name"]: s for s in wl["spec"]["podSets"]}
        assert {k: s["count"] for k, s in sets.items()} == {
            "head": 1, "trainer": 1, "rollout": 4, "driver": 1}
        assert sum(s["count"] * requests(s["template"]["spec"]).get(GPU, 0)
                   for s in sets.values()) == 8
        assert wl["spec"]["priority"] == 100
        admitted_within(_workload(cluster, ns, "low") or {}, pods(cluster, ns, "low"))
        # Placed by the flavor alone: its node label and toleration are on every pod.
        placed = pods(cluster, ns, "low")
        assert len(placed) == 7
        for pod in placed:
            assert pod["spec"]["nodeSelector"][POOL_LABEL] == ns
            assert any(t.get("key") == TAINT for t in pod["spec"].get("tolerations") or [])
            assert pod["metadata"]["labels"][kueue.LABEL_PODSET] in sets
            assert pod["spec"]["nodeName"] in nodes
        # Kueue is told the job's pods are ready (its waitForPodsReady reads this).
        wait_for(lambda: _conditions(_workload(cluster, ns, "low") or {}).get(
            "PodsReady", {}).get("status") == "True", timeout=60, what="PodsReady on low's "
            "Workload", describe=describe)

        # A real runtime plays low's driver: it trains until it is stopped.
        job = job_file(tmp_path, {"algorithm": {"totalSteps": 1000},
                                  "checkpoint": {"interval": 1000}}, name="runtime")
        workdir, log = tmp_path / "w", tmp_path / "runtime.log"
        first = _runtime(cluster, ns, "low", job, workdir, log)
        try:
            wait_for(lambda: (status(cluster, ns, "low").get("progress") or {}).get(
                "rolloutStep", 0) >= 2, timeout=300, what="low's runtime to report 2 steps",
                describe=lambda: log.read_text(errors="replace")[-3000:])

            cluster.apply(_queued_job("mid", ns, "mid"), "-n", ns)
            phase_is("mid", "Running")
            mid = _workload(cluster, ns, "mid") or {}
            assert (mid["spec"]["priority"], mid["spec"]["priorityClassRef"]["kind"]) == (
                500, "PriorityClass")
            cluster.apply(_queued_job("lowest", ns, "lowest"), "-n", ns)
            cond = queued("lowest", "Pending")
            print(f"\nQueued: {cond['reason']}: {cond['message']}")
            assert "insufficient unused quota for nvidia.com/gpu" in cond["message"], cond
            assert pods(cluster, ns, "lowest") == []  # nothing that takes quota before admission
            # A job without a queue is not Kueue's: it runs at once, whatever the queue holds.
            plain = job_manifest("plain", ns, scheduling={
                "nodeSelector": {POOL_LABEL: ns}, "tolerations": _tolerating(ns)})
            cluster.apply(plain, "-n", ns)
            phase_is("plain", "Running")
            assert cluster.get_json("workloads.kueue.x-k8s.io", "-n", ns, "-l",
                                    "kueue.x-k8s.io/job-uid=" + cluster.get_json(
                                        "rljob", "plain", "-n", ns)["metadata"]["uid"]
                                    )["items"] == []
            # Edited while it waits: its Workload asks for what the job now is.
            before = _workload(cluster, ns, "lowest") or {}
            cluster.kubectl("patch", "rljob", "lowest", "-n", ns, "--type=merge", "-p",
                            json.dumps({"spec": {"rollout": {"engines": 2}}}))
            wait_for(lambda: {s["name"]: s["count"] for s in (_workload(
                cluster, ns, "lowest") or {})["spec"]["podSets"]}.get("rollout") == 2,
                timeout=60, what="lowest's Workload to ask for 2 engines", describe=describe)
            after = _workload(cluster, ns, "lowest") or {}
            assert after["metadata"]["uid"] == before["metadata"]["uid"]
            out = cluster.kubectl("get", "rljobs", "-n", ns).stdout
            print(out)
            assert "Queued" in out

            # A higher priority comes: Kueue preempts the lowest admitted job, low.
            cluster.apply(_queued_job("high", ns, "high"), "-n", ns)
            wait_for(lambda: not pods(cluster, ns, "low", "driver")
                     or pods(cluster, ns, "low", "driver")[0]["metadata"].get(
                         "deletionTimestamp"), timeout=120,
                     what="low's driver pod to be deleted", describe=describe)
            first.send_signal(signal.SIGTERM)  # what the kubelet does to a deleted pod
            assert first.wait(timeout=300) == EXIT_TERMINATED, \
                log.read_text(errors="replace")[-3000:]
        finally:
            reap(first)
        stopped = status(cluster, ns, "low")["stopped"]
        saved = stopped["checkpointStep"]
        assert stopped["signal"] == "SIGTERM" and saved >= 2, stopped
        assert _events(cluster, ns, "low", "Preempted"), "no Preempted event for low"
        cond = queued("low", "Preempted")
        assert "Kueue evicted" in cond["message"], cond
        phase_is("high", "Running")
        admitted_within(_workload(cluster, ns, "high") or {}, pods(cluster, ns, "high"))
        assert status(cluster, ns, "lowest")["phase"] == "Queued"

        # The preemptor ends (its driver exits 0, as a kubelet reports): its Workload is
        # Finished once its pods are gone, which gives the quota back; Kueue admits low
        # again (above lowest), and it resumes from the very checkpoint its runtime saved
        # when it stopped.
        patch_pod_phase(cluster, ns, "high-driver", "Succeeded", 0)
        phase_is("high", "Succeeded")
        wait_for(lambda: (lambda wl: _conditions(wl).get("Finished", {}).get("status") ==
                          "True" and kueue.FINALIZER not in wl["metadata"].get(
                              "finalizers", []))(_workload(cluster, ns, "high") or {}),
                 timeout=60, what="high's Workload Finished and let go", describe=describe)
        phase_is("low", "Running", timeout=180)
        assert status(cluster, ns, "lowest")["phase"] == "Queued"
        second = _runtime(cluster, ns, "low", job, workdir, log, "--max-steps", "1")
        try:
            def resumed() -> Obj | None:
                found = status(cluster, ns, "low").get("resumed") or {}
                return found if found.get("found") else None

            report = wait_for(resumed, timeout=300, what="low's resumed runtime to report",
                              describe=lambda: log.read_text(errors="replace")[-3000:])
        finally:
            reap(second)
        assert report["step"] == saved, report
        assert report["path"].endswith(f"step_{saved:08d}"), report
        assert status(cluster, ns, "low")["recovery"]["restarts"] == 0

        # A queued job deleted leaves no Workload behind, and a foreground deletion (which
        # waits for the Workload it owns) ends: Kueue's finalizer comes off.
        gone = _workload(cluster, ns, "lowest")
        assert gone is not None
        cluster.kubectl("delete", "rljob", "lowest", "-n", ns, "--cascade=foreground",
                        "--wait=false")
        wait_for(lambda: cluster.kubectl("get", "rljob", "lowest", "-n", ns,
                                         check=False).returncode != 0, timeout=60,
                 what="lowest, deleted in the foreground, to be gone", describe=describe)
        wait_for(lambda: cluster.kubectl(
            "get", "workloads.kueue.x-k8s.io", gone["metadata"]["name"], "-n", ns,
            check=False).returncode != 0, timeout=60, what="lowest's Workload to be gone",
            describe=describe)

        # Suspending a queued job deactivates its Workload: Kueue evicts it, the job stops
        # and gives the quota back; resumed, Kueue admits it again.
        def suspend(flag: bool) -> None:
            cluster.kubectl("patch", "rljob", "mid", "-n", ns, "--type=merge", "-p",
                            json.dumps({"spec": {"scheduling": {"suspend": flag}}}))

        suspend(True)
        phase_is("mid", "Suspended")

        def released() -> Obj | None:
            wl = _workload(cluster, ns, "mid") or {}
            done = wl.get("spec", {}).get("active") is False and not pods(cluster, ns, "mid") \
                and _conditions(wl).get("QuotaReserved", {}).get("status") == "False"
            return wl if done else None

        wait_for(released, timeout=120, what="mid's Workload inactive and its quota back",
                 describe=describe)
        suspend(False)
        phase_is("mid", "Running")
        assert status(cluster, ns, "mid")["recovery"]["restarts"] == 0

        # An edit that changes what an admitted job asks for: it stops, its Workload is
        # replaced by one for the job as it is now, and it runs again once that is admitted.
        first = (_workload(cluster, ns, "mid") or {})["metadata"]
        cluster.kubectl("patch", "rljob", "mid", "-n", ns, "--type=merge", "-p",
                        json.dumps({"spec": {"rollout": {"engines": 2}}}))
        wait_for(lambda: (lambda wl: wl is not None and wl["metadata"]["uid"] != first["uid"]
                          and _conditions(wl).get("Admitted", {}).get("status") == "True")(
                              _workload(cluster, ns, "mid")), timeout=120,
                 what="mid queued again with a new Workload, and admitted", describe=describe)
        assert _events(cluster, ns, "mid", "Queued"), "mid never read Queued"
        phase_is("mid", "Running")
        assert len(pods(cluster, ns, "mid", "rollout")) == 2
        admitted_within(_workload(cluster, ns, "mid") or {}, pods(cluster, ns, "mid"))

        # Its Workload deleted by hand: the job stops, and only once its pods are gone does
        # the Workload go (Kueue's finalizer held it meanwhile); a new one queues the job.
        doomed = (_workload(cluster, ns, "mid") or {})["metadata"]
        cluster.kubectl("delete", "workloads.kueue.x-k8s.io", doomed["name"], "-n", ns,
                        "--wait=false")
        wait_for(lambda: (lambda wl: wl is not None and wl["metadata"]["uid"] != doomed["uid"]
                          and _conditions(wl).get("Admitted", {}).get("status") == "True")(
                              _workload(cluster, ns, "mid")), timeout=120,
                 what="mid queued again after its Workload was deleted", describe=describe)
        assert _events(cluster, ns, "mid", "Queued")
        phase_is("mid", "Running")
    print(f"GPU samples: {len(quota.samples)}, max {max(quota.samples)} of {QUOTA_GPUS}")
    assert len(quota.samples) > 50
    assert max(quota.samples) <= QUOTA_GPUS, quota.samples
    assert max(quota.samples) == QUOTA_GPUS  # two 8-GPU jobs did run at once


def test_the_install_guides_queues_are_accepted_by_kueues_api(
        cluster: ControlPlane, namespace: str) -> None:
    """docs/install.md's ResourceFlavor, ClusterQueue, LocalQueue and WorkloadPriorityClass,
    for this test's namespace, pass the API server with Kueue's CRDs (a server-side dry
    run)."""
    if "kueue" not in cluster.processes:
        cluster.start_kueue()
    text = (REPO / "docs" / "install.md").read_text()
    section = text.split("## Queueing in Kueue", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split("```yaml")[1:]]
    (queues,) = [b for b in blocks if "kind: ClusterQueue" in b]
    docs = [d for d in yaml.safe_load_all(textwrap.dedent(queues)) if d]
    assert [d["kind"] for d in docs] == ["ResourceFlavor", "ClusterQueue", "LocalQueue",
                                         "WorkloadPriorityClass"]
    out = cluster.apply(yaml.safe_dump_all(docs).replace("team-a", namespace),
                        "--dry-run=server")
    assert out.count("(server dry run)") == 4, out


def test_without_the_integration_a_queued_job_runs_and_says_so(
        cluster: ControlPlane, namespace: str, operator: Operator,
        gpu_pool: Callable[..., list[str]]) -> None:
    """An operator without --kueue (the chart's default) runs a job that names a queue as it
    always did, and its status says no queue holds it."""
    gpu_pool(1, 8)
    body = job_manifest("named", namespace)
    body["metadata"]["labels"] = {kueue.LABEL_QUEUE: "team"}
    cluster.apply(body, "-n", namespace)
    st = wait_phase(cluster, namespace, "named", "Running")
    cond = {c["type"]: c for c in st["conditions"]}["Queued"]
    assert (cond["status"], cond["reason"]) == ("False", "KueueIntegrationOff"), cond
