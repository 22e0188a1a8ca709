"""The tiny CPU job in real pods on kind, driven as a user would (kubectl, helm).

One job goes through the user's whole story: it starts, every Ray actor runs on the pod
meant for it, only its status writer holds its API token (not the driver container, where
hooks run), a pod of another namespace cannot use its engines or weight-sync store, it
checkpoints, loses one of its two rollout pods and then the node of the other without a
restart (each time the engine started again in KubeRay's new pod with the current weights,
each step once in the runtime's step log), loses a trainer pod and its driver pod, is
preempted by a higher-priority job in its Kueue queue and resumed once Kueue admits it again
(it waited in that queue before it first started too), and loses a whole worker node
(each time resuming from its last verified checkpoint, as reported by the runtime that
resumed), finishes with step, reward
and checkpoint in `kubectl get rljobs`, and deleting it removes every child. Every fact
asserted about progress, placement and recovery comes from the real runtime's processes
(their status reports and logs), never from the test.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from e2e.kind.foreign_peer import assert_foreign_pod_refused
from e2e.kind.kindcluster import EXAMPLE, KindCluster
from rljob.reporting import startup
from rljob.reporting.metrics_log import METRICS_FILE
from rljob_operator import kueue
from tests.kueue_checks import admitted_within
from tests.polling import wait_for

pytestmark = pytest.mark.e2e

NAMESPACE = "tiny"
JOB = "tiny-cpu"
TOTAL_STEPS = 140  # every fault lands well before the end (the lost node at step 95 of 120 once)
START_S = 900      # images are local; Ray and the model start in a few minutes on 2 cores
STEP_S = 900       # generous: 2 cores run the control plane, Ray and training together


class Job:
    """The RLJob as kubectl shows it."""

    def __init__(self, cluster: KindCluster) -> None:
        self.cluster = cluster

    def status(self) -> dict[str, Any]:
        doc = self.cluster.get("rljob", JOB, "-n", NAMESPACE)
        status: dict[str, Any] = doc.get("status") or {}
        return status

    def describe(self) -> str:
        return json.dumps(self.status(), indent=1)[-4000:]

    def wait(self, probe: Any, what: str, timeout: float = STEP_S) -> Any:
        return wait_for(probe, timeout=timeout, what=what, interval=2, describe=self.describe)

    def checkpoint_after(self, step: int) -> dict[str, Any]:
        """The first verified checkpoint the runtime reports beyond `step`."""
        def probe() -> dict[str, Any] | None:
            cp = self.status().get("checkpoint") or {}
            return cp if cp.get("verified") and (cp.get("step") or 0) > step else None
        return self.wait(probe, f"a verified checkpoint after step {step}")  # type: ignore[no-any-return]

    def resumed_after(self, restarts: int) -> dict[str, Any]:
        """`status.recovery` with the runtime's `status.resumed` under `resumed`, once the
        runtime of restart `restarts + 1` (or later) reported what it loaded and the operator
        derived resumedFromStep from it."""
        def probe() -> dict[str, Any] | None:
            status = self.status()
            rec = status.get("recovery") or {}
            resumed = status.get("resumed") or {}
            # The operator derives resumedFromStep from that report on its next reconcile.
            if (rec.get("restarts", 0) > restarts and resumed.get("attempt") == rec["restarts"]
                    and "resumedFromStep" in rec):
                return {**rec, "resumed": resumed}
            return None
        return self.wait(probe, f"restart {restarts + 1} to report what it resumed from")  # type: ignore[no-any-return]

    def pods(self, component: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.get(
            "pods", "-n", NAMESPACE, "-l", f"rljob.io/job={JOB},rljob.io/component={component}",
        )["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def driver_log(self) -> str:
        return self.cluster.kubectl("logs", "-n", NAMESPACE, f"{JOB}-driver", check=False).stdout


def _placement(log: str) -> list[dict[str, Any]]:
    """Where Ray put each actor, as the driver printed it from Ray's own facts (the node each
    actor runs on, and that node's host name: the pod)."""
    lines = [line for line in log.splitlines() if line.startswith("placement: ")]
    if not lines:
        return []
    table: dict[str, Any] = json.loads(lines[-1].removeprefix("placement: "))
    actors: list[dict[str, Any]] = table["actors"]
    return actors


def _startup(log: str) -> list[startup.Mark]:
    """The marks of the driver's `startup:` line (its first attempt's)."""
    lines = [line for line in log.splitlines() if startup.PREFIX in line]
    return startup.parse(lines[0]) if lines else []


def _shown(cluster: KindCluster, job: Job, secret: str) -> list[str]:
    """Where `secret` shows: a log of one of the job's pods, its status or its events."""
    seen = {f"logs of {p['metadata']['name']}": cluster.kubectl(
                "logs", "-n", NAMESPACE, p["metadata"]["name"], "--all-containers",
                check=False).stdout
            for c in ("trainer", "rollout", "head", "driver") for p in job.pods(c)}
    seen["status"] = json.dumps(job.status())
    seen["events"] = cluster.kubectl("get", "events", "-n", NAMESPACE, "-o", "json").stdout
    return [where for where, text in seen.items() if secret in text]


# What code in the driver pod can do with the Kubernetes API: read the ServiceAccount token at
# the in-cluster path, and read the job's status from the API server with it (or with no
# credential where there is none). `probe()` runs either in the container `kubectl exec`
# enters or, with `--ray`, as a Ray task that the driver pod's own Ray node runs (where the
# rollout worker runs the user's hooks, and any actor Ray places on that node would run).
API_PROBE = """
import glob, json, os, ssl, sys, urllib.error, urllib.request

def probe():
    path = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    found = {}
    try:
        token = open(path).read().strip()
        found["token_file"] = "read"
    except OSError as err:
        token, found["token_file"] = None, type(err).__name__
    url = ("https://" + os.environ["KUBERNETES_SERVICE_HOST"] + ":"
           + os.environ["KUBERNETES_SERVICE_PORT"] + "/apis/rljob.io/v1alpha1/namespaces/"
           + os.environ["RLJOB_NAMESPACE"] + "/rljobs/" + os.environ["RLJOB_NAME"] + "/status")
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", "Bearer " + token)
    try:
        with urllib.request.urlopen(request, context=ssl._create_unverified_context(),
                                    timeout=10):
            found["api"] = 200
    except urllib.error.HTTPError as err:
        found["api"] = err.code
    return found

if sys.argv[1:] == ["--ray"]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    (temp_dir,) = glob.glob("/tmp/rljob-ray-*")  # the driver pod's Ray node
    ray.init(address="auto", _temp_dir=temp_dir, _node_ip_address=os.environ["POD_IP"],
             log_to_driver=False)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)

    def on_ray():
        return {**probe(), "ran_on": ray.get_runtime_context().get_node_id()}

    found = ray.get(ray.remote(num_cpus=0, scheduling_strategy=here)(on_ray).remote(),
                    timeout=120)
    found["ran_on"] = "driver node" if found["ran_on"] == here.node_id else found["ran_on"]
    print(json.dumps(found))
else:
    print(json.dumps(probe()))
"""


def _api_access(cluster: KindCluster, container: str, *how: str) -> dict[str, Any]:
    out = cluster.kubectl("exec", "-n", NAMESPACE, f"{JOB}-driver", "-c", container, "--",
                          "python", "-c", API_PROBE, *how).stdout
    found: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return found


QUEUE = "tiny"  # the LocalQueue of the story's namespace
LOW, HIGH = "rljob-e2e-low", "rljob-e2e-high"  # WorkloadPriorityClasses
PREEMPTOR_CPU_M = 200


def _kueue_queues(cluster: KindCluster, cpu: str) -> None:
    """A ClusterQueue for the story's namespace with `cpu` of CPU quota, its LocalQueue and
    two priorities."""
    kq = f"{kueue.GROUP}/{kueue.VERSION}"
    docs = [
        {"apiVersion": kq, "kind": "WorkloadPriorityClass", "metadata": {"name": LOW},
         "value": 100},
        {"apiVersion": kq, "kind": "WorkloadPriorityClass", "metadata": {"name": HIGH},
         "value": 1000},
        {"apiVersion": kq, "kind": "ResourceFlavor", "metadata": {"name": "rljob-e2e"}},
        {"apiVersion": kq, "kind": "ClusterQueue", "metadata": {"name": "rljob-e2e"},
         "spec": {"namespaceSelector": {"matchLabels": {
             "kubernetes.io/metadata.name": NAMESPACE}},
                  "preemption": {"withinClusterQueue": "LowerPriority"},
                  "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [{
                      "name": "rljob-e2e", "resources": [
                          {"name": "cpu", "nominalQuota": cpu},
                          {"name": "memory", "nominalQuota": "1000Gi"}]}]}]}},
        {"apiVersion": kq, "kind": "LocalQueue",
         "metadata": {"name": QUEUE, "namespace": NAMESPACE},
         "spec": {"clusterQueue": "rljob-e2e"}},
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def _preemptor(image: str) -> dict[str, Any]:
    """A batch Job of higher priority in the job's queue (Kueue's own batch/job integration
    admits it and unsuspends it): 5 s of sleep."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "preemptor", "namespace": NAMESPACE,
                         "labels": {kueue.LABEL_QUEUE: QUEUE, kueue.LABEL_PRIORITY_CLASS: HIGH}},
            "spec": {"suspend": True, "backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "containers": [{
                    "name": "sleep", "image": image, "command": ["sleep", "5"],
                    "resources": {"requests": {"cpu": f"{PREEMPTOR_CPU_M}m",
                                               "memory": "16Mi"}}}]}}}}


def _workload(cluster: KindCluster) -> dict[str, Any]:
    uid = cluster.get("rljob", JOB, "-n", NAMESPACE)["metadata"]["uid"]
    (found,) = cluster.get("workloads.kueue.x-k8s.io", "-n", NAMESPACE, "-l",
                           f"kueue.x-k8s.io/job-uid={uid}")["items"]
    return found  # type: ignore[no-any-return]


def _steps_once(cluster: KindCluster) -> list[int]:
    """The steps in the runtime's own step log (metrics.jsonl in the job's workdir on its
    checkpoint volume), asserted to be each step once, in order, from the first. A line the
    runtime is still writing is left out."""
    log = cluster.host_path(NAMESPACE, f"{JOB}-checkpoints") / JOB / METRICS_FILE
    text = log.read_text()
    whole = text[:text.rfind("\n") + 1]
    steps = [int(json.loads(line)["step"]) for line in whole.splitlines() if line.strip()]
    assert steps == list(range(1, len(steps) + 1)), steps
    return steps


def _engine_story(cluster: KindCluster, job: Job, name: str) -> Counter[str]:
    """How often the driver log says `name` was lost and rejoined, and how many
    EngineLost/EngineRejoined Events name it: each loss must add one of each."""
    log = job.driver_log()
    told = Counter({said: log.count(f"engines: {name} {said}") for said in ("lost", "rejoined")})
    events = cluster.get("events", "-n", NAMESPACE, "--field-selector",
                         f"involvedObject.name={JOB}")["items"]
    told.update(e["reason"] for e in events if f"{name} " in e.get("message", "")
                and e["reason"] in {"EngineLost", "EngineRejoined"})
    return told


def _engine_lost_and_rejoined(cluster: KindCluster, job: Job, what: str,
                              lose: Callable[[], None]) -> str:
    """`lose` takes one of the two engines away mid-run. What the runtime reports shows the
    rest: the engine lost, then serving again with the version every engine and the trainer
    serve, the job Running throughout with the same attempt (no restart, nothing resumed),
    progress moving on with each step once in the runtime's step log, and the operator's
    EngineLost and EngineRejoined Events. Returns the name of the engine lost."""
    def both_serving() -> dict[str, Any] | None:
        status = job.status()
        engines = status.get("engines") or {}
        return status if engines.get("ready") == engines.get("total") == 2 else None

    before = job.wait(both_serving, "both engines serving")
    restarts = (before.get("recovery") or {}).get("restarts", 0)
    rows = {e["name"]: e.get("restarts", 0) for e in before["engines"]["engines"]}
    before_told = {name: _engine_story(cluster, job, name) for name in rows}
    lose()

    def restarted(status: dict[str, Any]) -> None:
        """A restart ends the wait at once, with what the failed runtime reported (its
        `runtimeFailure` is replaced when the next attempt starts)."""
        if (status.get("recovery") or {}).get("restarts", 0) != restarts:
            raise AssertionError(f"the job restarted after {what}: runtimeFailure "
                                 f"{status.get('runtimeFailure')}; recovery {status['recovery']}")

    def reported_lost() -> dict[str, Any] | None:
        status = job.status()
        engines = status.get("engines") or {}
        lost = engines.get("ready") == 1
        return status if lost or (status.get("recovery") or {}).get("restarts", 0) != restarts \
            else None

    lost = job.wait(reported_lost, f"the runtime to report an engine lost ({what})", 300)
    restarted(lost)
    (gone,) = [e for e in lost["engines"]["engines"] if e["state"] != "Serving"]

    def rejoined() -> dict[str, Any] | None:
        status = job.status()
        if (status.get("recovery") or {}).get("restarts", 0) != restarts:
            return status  # the wait ends: `restarted` below says why
        engines = status.get("engines") or {}
        now = {e["name"]: e for e in engines.get("engines") or []}
        back = now.get(gone["name"]) or {}
        versions = {e.get("weightVersion") for e in now.values()}
        progress = status.get("progress") or {}
        if engines.get("ready") == 2 and back.get("restarts", 0) > rows[gone["name"]] \
                and versions == {progress.get("weightVersion")} \
                and progress.get("policyVersion") == progress.get("weightVersion"):
            return status
        return None

    after = job.wait(rejoined, f"{gone['name']} to rejoin with the trainer's weights ({what})")
    restarted(after)
    # Neither a restart nor a resume: the same runtime trained on, past the step it was at.
    assert after["phase"] == "Running", after
    assert (after.get("recovery") or {}).get("restarts", 0) == restarts, after["recovery"]
    assert after["resumed"] == before["resumed"], (before["resumed"], after["resumed"])
    assert after["progress"]["rolloutStep"] > before["progress"]["rolloutStep"]
    assert _steps_once(cluster)[-1] >= after["progress"]["rolloutStep"] - 1
    # Counted once: a replacement put on a node Ray had not yet found dead goes with the
    # same loss (docs/operator.md), and the operators run on the control-plane node, so
    # their Events are posted whichever worker stops.
    (back,) = [e for e in after["engines"]["engines"] if e["name"] == gone["name"]]
    assert back["restarts"] == rows[gone["name"]] + 1, after["engines"]

    # This loss in the driver log and the operator's Events, told after the fault: once
    # lost, once rejoined.
    def told() -> Counter[str] | None:
        now = _engine_story(cluster, job, gone["name"])
        now.subtract(before_told[gone["name"]])
        done = now["EngineRejoined"] >= 1 and now["EngineLost"] >= 1
        return now if done else None

    story = job.wait(told, f"the log and Events to tell of {what}", 60)
    print(f"{what}: {dict(story)}")
    assert story == Counter(lost=1, rejoined=1, EngineLost=1, EngineRejoined=1), story
    return str(gone["name"])


def _rollout_pod_and_node_lost(cluster: KindCluster, job: Job) -> None:
    """Two rollout pods on two workers: one on `home` with every other pod of the job, the
    other alone on `away`. The first is deleted (`away` cordoned, so KubeRay's new pod runs
    on `home`); then `away`, the node of the other, is stopped: that pod is lost with the
    node and comes back on `home`. Each time a different engine is lost."""
    (home,) = {p["spec"]["nodeName"] for c in ("trainer", "head", "driver") for p in job.pods(c)}
    (away,) = [w for w in cluster.workers() if w != home]
    (victim,) = [p["metadata"]["name"] for p in job.pods("rollout")
                 if p["spec"].get("nodeName") == home]
    alone = [p["metadata"]["name"] for c in ("trainer", "rollout", "head", "driver")
             for p in job.pods(c) if p["spec"].get("nodeName") == away]
    assert len(alone) == 1, alone

    def delete() -> None:
        cluster.cordon(away)
        cluster.kubectl("delete", "pod", "-n", NAMESPACE, victim, "--wait=false")

    def back_home() -> list[dict[str, Any]]:
        return [p for p in job.pods("rollout")
                if p["metadata"]["name"] != victim and p["spec"].get("nodeName") == home]

    try:
        first = _engine_lost_and_rejoined(cluster, job, "its pod deleted", delete)
        assert victim not in {p["metadata"]["name"] for p in job.pods("rollout")}
        job.wait(lambda: back_home() or None, f"the new rollout pod to run on {home}")
    finally:
        cluster.cordon(away, False)
    assert [p["metadata"]["name"] for p in job.pods("rollout")
            if p["spec"].get("nodeName") == away] == alone

    try:
        second = _engine_lost_and_rejoined(cluster, job, f"the other's node {away} stopped",
                                           lambda: cluster.stop_node(away))
        for p in job.pods("rollout"):
            assert p["spec"].get("nodeName") == home, p["spec"]
    finally:
        cluster.start_node(away)
    assert first != second, (first, second)  # the other engine
    wait_for(lambda: cluster.ready(away), timeout=300, interval=2,
             what=f"{away} Ready again")


def _assert_resumed_from(rec: dict[str, Any], checkpoint: dict[str, Any], reason: set[str]) -> None:
    """The restarted runtime loaded a checkpoint at least as new as the one seen before the
    fault, and the digest it verified is the one its saver published."""
    resumed = rec["resumed"]
    assert resumed["found"] is True, rec
    assert resumed["step"] >= checkpoint["step"], (rec, checkpoint)
    assert rec["resumedFromStep"] == resumed["step"], rec
    assert rec["lastFailure"]["reason"] in reason, rec
    # Steps redone: where the runtime was when the failure was seen, less where it resumed.
    assert rec["lostSteps"] == max(0, rec["lastFailure"]["step"] - resumed["step"]), rec
    if resumed["step"] == checkpoint["step"]:
        assert resumed["checksum"] == checkpoint["checksum"], (rec, checkpoint)
        assert resumed["path"] == checkpoint["path"], (rec, checkpoint)


@pytest.mark.timeout(3600)  # includes a cold hack/kind-up (session fixture) and three recoveries
def test_tiny_cpu_job_in_real_pods_survives_lost_pods_and_a_lost_node(
        collect_on_failure: KindCluster) -> None:
    cluster = collect_on_failure
    job = Job(cluster)
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["algorithm"]["totalSteps"] = TOTAL_STEPS
    doc["spec"]["checkpoint"]["interval"] = 5  # each fault waits for a checkpoint after it
    doc["spec"]["rollout"]["engines"] = 2  # one is lost on its own below
    # Every pod fits the one worker left after the lost node: KubeRay's wait-gcs-ready init
    # container makes each rollout pod ask 200m, so the second engine's pod takes that
    # from the trainer's 500m (Ray still counts one CPU: KubeRay rounds the request up).
    doc["spec"]["trainer"]["resources"]["requests"]["cpu"] = "250m"
    # A job left by an earlier, interrupted run goes first (with its children).
    cluster.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true",
                    timeout=600)
    cluster.kubectl("create", "namespace", NAMESPACE)
    # Queued in Kueue: nothing of it runs before its Workload is admitted. Room for it
    # alone is set once Kueue says what it admitted (below).
    _kueue_queues(cluster, "100")
    doc["metadata"]["labels"] = {kueue.LABEL_QUEUE: QUEUE, kueue.LABEL_PRIORITY_CLASS: LOW}
    # The two rollout pods run on two workers, one of them alone: every compute pod starts
    # on the first worker, then one rollout pod moves to the second before the job starts
    # its engines, and the driver joins the first (_rollout_pod_and_node_lost).
    home, away = cluster.workers()

    def on(node: str, *components: str) -> list[str]:
        return [p["metadata"]["name"] for c in components for p in job.pods(c)
                if p["spec"].get("nodeName") == node]

    for worker in (home, away):  # as a run interrupted mid-story may have left them
        cluster.cordon(worker, False)
    try:
        cluster.cordon(away)
        cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(doc))
        job.wait(lambda: len(on(home, "trainer", "rollout", "head")) == 4,
                 f"the job's 4 compute pods on {home}", START_S)
        moved = job.pods("rollout")[1]["metadata"]["name"]
        cluster.cordon(home)
        cluster.cordon(away, False)
        cluster.kubectl("delete", "pod", "-n", NAMESPACE, moved, "--wait=false")
        job.wait(lambda: [n for n in on(away, "rollout") if n != moved],
                 f"a rollout pod on {away}", START_S)
        cluster.cordon(away)
        cluster.cordon(home, False)
        job.wait(lambda: on(home, "driver"), f"the driver on {home}", START_S)
    finally:
        for worker in (home, away):
            cluster.cordon(worker, False)
    interval = doc["spec"]["checkpoint"]["interval"]

    # Started: the driver joined the job's Ray cluster, and every actor runs where it should.
    job.wait(lambda: job.status().get("phase") == "Running", "phase Running", START_S)
    # It waited in its queue first, and runs because Kueue admitted its Workload: no pod
    # of it is older than the admission, and none asks more than Kueue admitted for it.
    said = {e["reason"] for e in cluster.get("events", "-n", NAMESPACE, "--field-selector",
                                             f"involvedObject.name={JOB}")["items"]}
    assert "Queued" in said, said
    admitted = {c["type"]: c for c in job.status()["conditions"]}["Admitted"]
    assert admitted["status"] == "True" and "ClusterQueue rljob-e2e" in admitted["message"]
    workload = _workload(cluster)
    since = {c["type"]: c for c in workload["status"]["conditions"]}["QuotaReserved"]
    everyone = [p for c in ("trainer", "rollout", "head", "driver") for p in job.pods(c)]
    assert all(p["metadata"]["creationTimestamp"] >= since["lastTransitionTime"]
               for p in everyone), (since, [p["metadata"]["creationTimestamp"]
                                            for p in everyone])
    usage = admitted_within(workload, everyone)
    # Now the queue has room for the job and 100m more: a 200m Job of higher priority in
    # it only fits by preempting the job.
    _kueue_queues(cluster, f"{round(usage['cpu'] * 1000) + 100}m")
    first = job.checkpoint_after(0)
    assert first["step"] % interval == 0, first
    placement = _placement(job.driver_log())
    pods = {p["metadata"]["name"]: p["metadata"]["labels"]["rljob.io/component"]
            for c in ("trainer", "rollout", "head", "driver") for p in job.pods(c)}
    assert placement, job.driver_log()[-3000:]
    meant = {"trainer": "trainer", "engine": "rollout", "weight-sync-sidecar": "rollout",
             "rollout-worker": "driver", "weight-sync-store": "head"}
    for actor in placement:
        # The pod's own label says what it is; Ray's node of the actor says where it runs.
        assert pods.get(actor["host"]) == meant[actor["role"]], (actor, pods)
    # Every actor the job has, none missing: one trainer, store and rollout worker, and an
    # engine and its weight-sync sidecar in each rollout pod, the sidecar beside its engine.
    roles = Counter(a["role"] for a in placement)
    rollout_pods = len(job.pods("rollout"))
    assert roles == {"trainer": 1, "weight-sync-store": 1, "rollout-worker": 1,
                     "engine": rollout_pods, "weight-sync-sidecar": rollout_pods}, placement
    hosts = {(a["role"], a["index"]): a["host"] for a in placement}
    # The driver pod timed its start-up as `rljob run` does on a laptop: every phase and
    # every actor marked, up to the first rollout request (the seconds are shown, not
    # judged: benchmarks/startup.py measures them).
    marks = _startup(job.driver_log())
    print(f"driver pod start-up: {' · '.join(f'{m.name} {m.at_s:.1f}s' for m in marks)}")
    single = ("rollout-worker", "weight-sync-store")  # one a job, marked without an index
    ready = {f"{a['role']} ready" if a["role"] in single else f"{a['role']}-{a['index']} ready"
             for a in placement}
    at = {m.name: m.at_s for m in marks}
    assert set(at) == {"imports", "ray started", "model files", "placement group ready",
                       "first weights", startup.FIRST_ROLLOUT, *ready}, marks
    assert at["ray started"] < at["placement group ready"] < min(at[r] for r in ready)
    assert at["first weights"] <= at[startup.FIRST_ROLLOUT]
    assert all(hosts[("weight-sync-sidecar", i)] == hosts[("engine", i)]
               for i in range(rollout_pods)), placement
    assert all(a["ok"] for a in placement), placement

    # The job's Ray token (its Secret, as a user with access could read it) never shows in a
    # log of the job's running pods, in its status or in its events.
    (secret,) = [s for s in cluster.get("secrets", "-n", NAMESPACE)["items"]
                 if s["metadata"]["name"].startswith(f"{JOB}-ray-token")]
    token = base64.b64decode(secret["data"]["auth_token"]).decode()
    assert len(token) >= 32 and not _shown(cluster, job, token)
    # Only the driver pod's status writer holds the job's API token. A Ray task on the driver
    # pod's Ray node (where the rollout worker runs the user's hooks) finds no token to read,
    # and the API server refuses to show it the job; the writer's token reads it (so the
    # probe can tell), and the status above was written through it.
    from_ray = _api_access(cluster, "driver", "--ray")
    assert from_ray.pop("ran_on") == "driver node", from_ray
    assert from_ray in ({"token_file": "FileNotFoundError", "api": 401},
                        {"token_file": "FileNotFoundError", "api": 403}), from_ray
    assert _api_access(cluster, "status-writer") == {"token_file": "read", "api": 200}
    # Nor can a pod of another namespace use the job's engines or weight-sync store: refused
    # without the job's peer key (and by the network where NetworkPolicies are enforced).
    assert_foreign_pod_refused(cluster, NAMESPACE, JOB, timeout=STEP_S)

    # A rollout pod is deleted, then the node of its replacement is lost: each time the other
    # engine generates on, KubeRay recreates the pod, the runtime starts the engine in it and
    # installs the current weights; no restart.
    _rollout_pod_and_node_lost(cluster, job)

    # A trainer pod is deleted: KubeRay replaces it, the driver restarts from the checkpoint.
    (trainer,) = job.pods("trainer")
    cluster.kubectl("delete", "pod", "-n", NAMESPACE, trainer["metadata"]["name"], "--wait=false")
    job.wait(lambda: job.status().get("phase") == "Recovering", "phase Recovering", 300)
    rec = job.resumed_after(0)
    _assert_resumed_from(rec, first, {"PodDeleted", "PodFailed"})

    # The driver pod is deleted: a new driver resumes.
    second = job.checkpoint_after(rec["resumed"]["step"])
    cluster.kubectl("delete", "pod", "-n", NAMESPACE, f"{JOB}-driver", "--wait=false")
    rec = job.resumed_after(rec["restarts"])
    _assert_resumed_from(rec, second, {"PodDeleted", "PodFailed", "DriverFailed"})

    # Preempted: a higher-priority Job comes to the job's Kueue queue, which has no room
    # for both. Kueue evicts the RLJob's Workload; its driver stops on SIGTERM (it finishes
    # the step, saves and says so), the compute goes, the checkpoints stay, and the quota
    # goes back to Kueue. Once the preemptor is done, Kueue admits the job again and the next
    # runtime resumes from the very checkpoint its predecessor said it stopped at. Neither
    # is a restart.
    restarts = rec["restarts"]
    job.checkpoint_after(rec["resumed"]["step"])
    trainer_image = doc["spec"]["trainer"]["image"]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(_preemptor(trainer_image)))

    def stopped() -> dict[str, Any] | None:
        status = job.status()
        stop = status.get("stopped") or {}
        done = status.get("phase") in {"Preempted", "Queued"} and not job.pods("driver") \
            and all(not job.pods(c) for c in ("trainer", "rollout", "head"))
        return stop if done and stop.get("attempt") == restarts else None

    home, away = cluster.workers()
    try:
        # Admitted again with one worker cordoned, so that every pod starts on the other and
        # the node lost below takes the driver with the trainer (the driver names that loss
        # itself).
        cluster.cordon(away)
        stop = job.wait(stopped, "the preempted job's runtime to report its stop, and its "
                        "pods gone")
        assert stop["signal"] == "SIGTERM" and stop["exitCode"] == 143, stop
        assert stop["aborted"] is False and stop["checkpointStep"] == stop["step"], stop
        events = cluster.get("events", "-n", NAMESPACE, "--field-selector",
                             f"involvedObject.name={JOB}")["items"]
        assert [e for e in events if e["reason"] == "Preempted"], events
        print(cluster.kubectl("get", "rljobs", "-n", NAMESPACE).stdout)
        job.wait(lambda: cluster.get("job", "preemptor", "-n", NAMESPACE)["status"].get(
            "succeeded"), "the preemptor to run and finish", START_S)
        job.wait(lambda: len([p for c in ("trainer", "rollout", "head", "driver")
                              for p in job.pods(c) if p["spec"].get("nodeName") == home]) == 5,
                 f"the job's 5 pods on {home}", START_S)
    finally:
        cluster.cordon(away, False)

    def resumed() -> dict[str, Any] | None:
        status = job.status()
        loaded = status.get("resumed") or {}
        return status if loaded.get("at", "") >= stop["time"] and loaded.get(
            "attempt") == restarts and status.get("phase") == "Running" else None

    status = job.wait(resumed, "the readmitted job's runtime to report what it resumed from")
    assert status["resumed"]["found"] is True, status
    assert status["resumed"]["step"] == stop["checkpointStep"], (status, stop)
    assert status["recovery"]["restarts"] == restarts and "stopped" not in status, status
    rec = {**status["recovery"], "resumed": status["resumed"]}

    # The worker node running the trainer is lost: its pods come back on the other worker.
    third = job.checkpoint_after(rec["resumed"]["step"])
    (trainer,) = job.pods("trainer")
    lost = trainer["spec"]["nodeName"]
    (survivor,) = [w for w in cluster.workers() if w != lost]
    print(f"lost node at step {job.status()['progress']['rolloutStep']} of {TOTAL_STEPS}")
    cluster.stop_node(lost)
    try:
        rec = job.resumed_after(rec["restarts"])
        # Ray sees the node go before Kubernetes does; the reason is Kubernetes' word by the
        # time the next attempt starts (that attempt waits for the pod's replacement).
        _assert_resumed_from(rec, third, {"NodeLost"})
        for component in ("trainer", "rollout", "head", "driver"):
            for pod in job.pods(component):
                assert pod["spec"].get("nodeName") == survivor, (component, pod["spec"])

        # Finished: step, reward and checkpoint in `kubectl get rljobs`, from the runtime.
        job.wait(lambda: job.status().get("phase") in {"Succeeded", "Failed"}, "the job to end")
        status = job.status()
        assert status["phase"] == "Succeeded", job.describe()
        progress = status["progress"]
        assert progress["rolloutStep"] == TOTAL_STEPS, progress
        assert isinstance(progress.get("meanReward"), float | int), progress
        assert "nonFinite" not in progress, progress
        assert status["checkpoint"]["step"] == TOTAL_STEPS and status["checkpoint"]["verified"]
        assert status["recovery"]["restarts"] == 3, status["recovery"]
        table = cluster.kubectl("get", "rljobs", "-n", NAMESPACE).stdout.splitlines()
        header, row = table[0].split(), table[1].split()
        shown = dict(zip(header, row, strict=False))
        assert shown["PHASE"] == "Succeeded" and shown["STEP"] == str(TOTAL_STEPS), table
        assert shown["CHECKPOINT"] == str(TOTAL_STEPS) and shown["RESTARTS"] == "3", table
        assert float(shown["REWARD"]) == pytest.approx(progress["meanReward"], abs=0.01), table
        # Nor after three restarts and a suspension: the last driver's whole log included.
        assert not _shown(cluster, job, token)
    finally:
        cluster.start_node(lost)

    # Deleting the RLJob removes every child (owner references; the garbage collector).
    uid = cluster.get("rljob", JOB, "-n", NAMESPACE)["metadata"]["uid"]
    cluster.kubectl("delete", "rljob", JOB, "-n", NAMESPACE, "--wait=true", timeout=600)

    def children() -> list[str]:
        left = []
        for kind in ("pods", "rayclusters", "configmaps", "secrets", "serviceaccounts",
                     "roles", "rolebindings", "persistentvolumeclaims", "services",
                     "workloads.kueue.x-k8s.io"):
            for item in cluster.get(kind, "-n", NAMESPACE)["items"]:
                owners = item["metadata"].get("ownerReferences") or []
                labelled = item["metadata"].get("labels", {}).get("rljob.io/job") == JOB
                if labelled or any(o.get("uid") == uid for o in owners):
                    left.append(f"{kind}/{item['metadata']['name']}")
        return left

    wait_for(lambda: not children(), timeout=300, interval=2,
             what="every child of the deleted RLJob to be gone",
             describe=lambda: f"still there: {children()}")
