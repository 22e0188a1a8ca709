"""Each GPU example's pods as Kubernetes allocates GPUs, and the device every process would use.

The kind workers advertise `nvidia.com/gpu` through the fake device plugin
(hack/fake-gpu-plugin: 8 a worker, allocated per container as NVIDIA's plugin does), so the
examples' GPU pods are scheduled and started by the real scheduler and kubelet and each
`ray-worker` container holds the GPUs the kubelet gave it. The RLJob sets
`spec.planOnly: true`: the runtime places every worker as the real job would (the same
placement group and actor options) but starts probes in place of trainers, engines and
weight-sync sidecars; each reports the device it would use, the driver prints one
`device-plan:` line per process and the job ends Succeeded.

The test reads what the kubelet allocated each pod independently of the runtime (`printenv`
in the running container) and checks the runtime's plan against it: every process uses GPUs
of its own container, no two trainer ranks or engines share one, every sidecar stages on its
engine's GPUs in its engine's pod, and engines share the trainer's GPUs exactly when the
example is colocated.

Each example is changed only where a kind cluster cannot hold it (each change says why):
the CPU images kind-up builds, CPU and memory scaled to 2-core nodes, and the claims,
PriorityClass and node label the example expects a GPU cluster to have.
"""

from __future__ import annotations

import json
import tomllib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.kind.kindcluster import KindCluster
from rljob.cluster.device_plan import LINE_PREFIX
from rljob_api.spec import RLJobSpec
from tests.controlplane import REPO
from tests.polling import wait_for

pytestmark = pytest.mark.e2e

RESOURCE = "nvidia.com/gpu"
PRODUCT_LABEL = "nvidia.com/gpu.product"
PRIORITY_CLASS = "training"
COMPUTE = ("trainer", "rollout", "colocated")  # the worker groups' component labels
START_S = 900     # images are local; KubeRay starts up to 6 Ray nodes on 2 busy cores
END_S = 900       # Ray on every pod, a placement group and a probe per process, then the end
GONE_S = 300


@dataclass(frozen=True)
class Example:
    """A GPU example and the namespace its job runs in."""

    file: str
    namespace: str

    @property
    def path(self) -> Path:
        return REPO / "examples" / self.file


QWEN = Example("qwen-7b-megatron-sglang.yaml", "plan-qwen-7b")
COLOCATED = Example("colocated-gpu.yaml", "plan-colocated")
TINY_MEGATRON = Example("tiny-megatron-gpu.yaml", "plan-tiny-megatron")


def _version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def _gpus_per_pod(spec: dict[str, Any], group: str) -> int:
    """GPUs a pod of `group` asks for, by the example's own counts: a trainer or colocated
    pod `gpusPerReplica`, a rollout pod one engine's `gpusPerEngine`."""
    if group == "rollout":
        return int(spec["rollout"].get("gpusPerEngine", 1))
    return int(spec["trainer"].get("gpusPerReplica", 1))


def _pods_expected(spec: dict[str, Any]) -> int:
    """Compute pods (trainer, rollout or colocated) the job's RayCluster has."""
    replicas = int(spec["trainer"].get("replicas", 1))
    if spec.get("placement") == "colocated":
        return replicas
    return replicas + _engines(spec)


def _engines(spec: dict[str, Any]) -> int:
    """The example's engine count (`rollout.engines`, as the operator reads it)."""
    return RLJobSpec.model_validate(spec).rollout.engine_count


def kind_job(example: Example) -> dict[str, Any]:
    """The example as a kind cluster can hold it, in plan-only mode."""
    doc: dict[str, Any] = yaml.safe_load(example.path.read_text())
    spec = doc["spec"]
    version = _version()
    colocated = spec.get("placement") == "colocated"
    # Images: nothing is pulled here, so the CPU images hack/kind-up builds and loads stand in
    # for the CUDA ones. Planning needs only the runtime, which both CPU images carry (the
    # same Python, torch and rljob). A colocated SGLang job refuses the trainer image by name
    # (it has no SGLang), so it gets the CPU rollout image, which holds the same runtime.
    trainer_image = (f"ghcr.io/rljob/rollout:{version}-cpu"
                     if colocated and spec["rollout"].get("backend") == "sglang"
                     else f"ghcr.io/rljob/trainer:{version}-cpu")
    spec["trainer"]["image"] = trainer_image
    spec["rollout"]["image"] = f"ghcr.io/rljob/rollout:{version}-cpu"
    # CPU and memory: kind nodes have 2 CPUs and the machine's memory, so requests are small.
    # The CPU limit is each pod's number of placement slots (one per GPU): the runtime's
    # placement bundles ask {"GPU": 1, "CPU": 1} a slot, and KubeRay (v1.5
    # ray-operator/controllers/ray/common/pod.go, generateRayStartCommand) passes Ray
    # `--num-cpus` from the Ray container's CPU limit, rounded up, falling back to its
    # request: a 100m request alone would advertise one CPU and leave every bundle but one
    # unplaceable. A limit above the node's CPUs is allowed (the scheduler counts requests).
    groups = ["colocated"] if colocated else ["trainer", "rollout"]
    for group in groups:
        field = "rollout" if group == "rollout" else "trainer"
        spec[field]["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"},
                                    "limits": {"cpu": str(_gpus_per_pod(spec, group))}}
    # Planning starts no engine: SGLang's own arguments stay, unused.
    spec["planOnly"] = True
    return doc


def claims(doc: dict[str, Any]) -> list[str]:
    """The PersistentVolumeClaims the example expects to exist (a GPU cluster's shared
    storage for models, data sets and checkpoints); a job that names none gets its
    checkpoint claim from the operator."""
    spec = doc["spec"]
    names = [spec.get("model", {}).get("pvc"), spec.get("data", {}).get("pvc"),
             spec.get("checkpoint", {}).get("pvc")]
    return [n for n in names if n]


def _claim(name: str, namespace: str) -> dict[str, Any]:
    # kind's default StorageClass (the in-tree host-path provisioner) makes the volume in the
    # directory every node shares, as the cluster's shared storage would be.
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"accessModes": ["ReadWriteMany"],
                     "resources": {"requests": {"storage": "1Gi"}}}}


@dataclass(frozen=True)
class Report:
    """One `device-plan:` line: the device a process of the job would use."""

    role: str            # trainer | engine | sidecar
    index: int           # trainer rank, or engine index
    pod: str             # the pod it runs in (its HOSTNAME)
    allocation: list[str] | None  # its container's NVIDIA_VISIBLE_DEVICES (None: not stated)
    visible: list[str]     # its CUDA_VISIBLE_DEVICES
    device: str
    gpus: list[str]        # the GPUs it would use, in rank order


def parse_plan(log: str) -> list[Report]:
    reports = []
    for line in log.splitlines():
        if line.startswith(LINE_PREFIX):
            fields = json.loads(line.removeprefix(LINE_PREFIX))
            reports.append(Report(
                role=fields["role"], index=int(fields["index"]), pod=fields["pod"],
                allocation=fields["allocation"], visible=[str(v) for v in fields["visible"]],
                device=fields["device"], gpus=list(fields["gpus"])))
    return reports


@dataclass(frozen=True)
class Pod:
    """A compute pod while it ran: its group and what the kubelet allocated its container."""

    name: str
    component: str
    node: str
    asked: int               # the ray-worker container's nvidia.com/gpu limit
    allocation: list[str]    # its NVIDIA_VISIBLE_DEVICES, read in the container


class Job:
    """One example's RLJob in its namespace, seen through kubectl."""

    def __init__(self, cluster: KindCluster, example: Example) -> None:
        self.cluster = cluster
        self.example = example
        self.doc = kind_job(example)
        self.name: str = self.doc["metadata"]["name"]
        self.ns = example.namespace

    @property
    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.doc["spec"]
        return spec

    def apply(self) -> None:
        self.cluster.kubectl("delete", "namespace", self.ns, "--ignore-not-found",
                             "--wait=true", timeout=600)
        self.cluster.kubectl("create", "namespace", self.ns)
        for claim in claims(self.doc):
            self.cluster.kubectl("apply", "-f", "-", input=json.dumps(_claim(claim, self.ns)))
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=yaml.safe_dump(self.doc))

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.cluster.get("rljob", self.name, "-n", self.ns).get(
            "status") or {}
        return status

    def describe(self) -> str:
        pods = self.cluster.kubectl("get", "pods", "-n", self.ns, "-o", "wide",
                                    check=False).stdout
        return f"{pods}\nstatus: {json.dumps(self.status(), indent=1)[-3000:]}"

    def compute_pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.get(
            "pods", "-n", self.ns, "-l",
            f"rljob.io/job={self.name},rljob.io/component in ({','.join(COMPUTE)})")["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def allocation(self, pod: dict[str, Any]) -> Pod:
        """What the kubelet allocated the pod's ray-worker container, read inside it (every
        compute pod of these examples asks for GPUs, so the variable is set)."""
        name = pod["metadata"]["name"]
        (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "ray-worker"]
        asked = int(container["resources"].get("limits", {}).get(RESOURCE, 0))
        env = self.cluster.kubectl("exec", "-n", self.ns, name, "-c", "ray-worker", "--",
                                   "printenv", "NVIDIA_VISIBLE_DEVICES", check=False)
        if env.returncode != 0:
            raise RuntimeError(f"printenv NVIDIA_VISIBLE_DEVICES in {name}: {env.returncode} "
                               f"{env.stderr.strip()}")
        return Pod(name, pod["metadata"]["labels"]["rljob.io/component"],
                   pod["spec"]["nodeName"], asked, env.stdout.strip().split(","))

    def record(self, seen: dict[str, Pod]) -> bool:
        """Read the allocation of every running compute pod not read yet into `seen`; whether
        all the job's compute pods now run, each read.

        Read while the pods run: the operator deletes them once the job ends. And read again
        for each new pod until then: KubeRay replaces a pod whose Ray exits before the
        driver starts (as `ray start` may, timing out on a loaded machine), and the plan is
        of the pods the driver found."""
        pods = self.compute_pods()
        for pod in pods:
            if pod["status"].get("phase") == "Running" and pod["metadata"]["name"] not in seen:
                seen[pod["metadata"]["name"]] = self.allocation(pod)
        return len(pods) == _pods_expected(self.spec) and all(
            p["status"].get("phase") == "Running" and p["metadata"]["name"] in seen
            for p in pods)

    def ended(self) -> dict[str, Any] | None:
        status = self.status()
        return status if status.get("phase") in {"Succeeded", "Failed"} else None

    def driver_log(self) -> str:
        return self.cluster.kubectl("logs", "-n", self.ns, f"{self.name}-driver",
                                    check=False).stdout

    def delete(self) -> None:
        """The job and every child gone (their GPUs free for the next example)."""
        self.cluster.kubectl("delete", "rljob", self.name, "-n", self.ns, "--ignore-not-found",
                             "--wait=true", timeout=GONE_S)
        wait_for(lambda: not self.cluster.get("pods", "-n", self.ns, "-l",
                                              f"rljob.io/job={self.name}")["items"],
                 timeout=GONE_S, interval=2, what=f"the pods of {self.name} to go",
                 describe=self.describe)
        self.cluster.kubectl("delete", "namespace", self.ns, "--wait=true", timeout=GONE_S,
                             check=False)


def check_plan(job: Job, pods: dict[str, Pod], reports: list[Report]) -> None:
    """The runtime's device plan against the example's counts and the kubelet's allocations."""
    spec = job.spec
    colocated = spec.get("placement") == "colocated"
    per_engine = int(spec["rollout"].get("gpusPerEngine", 1))
    ranks = int(spec["trainer"].get("replicas", 1)) * int(spec["trainer"]["gpusPerReplica"])
    engines = _engines(spec)
    where = f"{job.name}: {reports}, pods {pods}"

    # Every pod got the GPUs its container asked for, of its own node.
    for pod in pods.values():
        assert pod.asked == _gpus_per_pod(spec, pod.component) == len(pod.allocation), pod
        assert all(u.startswith(f"GPU-{pod.node}-") for u in pod.allocation), pod
    # The plan is of a whole set of the job's pods (a pod replaced before the driver started
    # is not in it), each read while it ran, no GPU held by two of them.
    planned = {r.pod for r in reports}
    assert planned <= set(pods), (planned - set(pods), where)
    assert len(planned) == _pods_expected(spec), where
    held = [u for name in planned for u in pods[name].allocation]
    assert len(held) == len(set(held)), where

    # (a) One report per trainer rank, per engine and per sidecar (one an engine).
    by_role: dict[str, dict[int, Report]] = {"trainer": {}, "engine": {}, "sidecar": {}}
    for r in reports:
        assert r.role in by_role and r.index not in by_role[r.role], (r, where)
        by_role[r.role][r.index] = r
    assert sorted(by_role["trainer"]) == list(range(ranks)), where
    assert sorted(by_role["engine"]) == list(range(engines)), where
    assert sorted(by_role["sidecar"]) == list(range(engines)), where

    for r in reports:
        # (b) Each process runs in one of the job's pods, which its role belongs in; the
        # allocation it reports is the one the kubelet gave that pod's container, and every
        # GPU it would use is in it.
        assert r.pod in pods, (r, where)
        pod = pods[r.pod]
        want = {"trainer": "colocated" if colocated else "trainer",
                "engine": "colocated" if colocated else "rollout",
                "sidecar": "colocated" if colocated else "rollout"}[r.role]
        assert pod.component == want, (r, pod)
        assert r.allocation == pod.allocation, (r, pod)
        assert r.allocation is not None and r.gpus and set(r.gpus) <= set(r.allocation), r
        # The device it names is the first GPU it would use, as CUDA numbers what the
        # process sees: Ray's CUDA_VISIBLE_DEVICES are ordinals into the container's
        # NVIDIA_VISIBLE_DEVICES.
        assert r.device.startswith("cuda:"), r
        ordinal = int(r.visible[int(r.device.removeprefix("cuda:"))])
        assert r.allocation[ordinal] == r.gpus[0], r

    # (c) Trainer ranks hold one GPU each, no two the same; engines gpusPerEngine each,
    # disjoint.
    trainer_gpus = [g for r in by_role["trainer"].values() for g in r.gpus]
    assert all(len(r.gpus) == 1 for r in by_role["trainer"].values()), where
    assert len(set(trainer_gpus)) == ranks, where
    engine_gpus = [g for r in by_role["engine"].values() for g in r.gpus]
    assert all(len(r.gpus) == per_engine for r in by_role["engine"].values()), where
    assert len(set(engine_gpus)) == engines * per_engine, where

    for i, engine in by_role["engine"].items():
        sidecar = by_role["sidecar"][i]
        # (d) The sidecar stages rank r's entry on rank r's GPU, in its engine's pod.
        assert sidecar.pod == engine.pod and sidecar.gpus == engine.gpus, (engine, sidecar)
        # (e) Colocated: the engine's GPUs are trainer GPUs of its own pod; disaggregated:
        # no engine GPU is a trainer's.
        pod_trainer_gpus = {g for r in by_role["trainer"].values() if r.pod == engine.pod
                            for g in r.gpus}
        if colocated:
            assert set(engine.gpus) <= pod_trainer_gpus, (engine, where)
        else:
            assert not set(engine.gpus) & set(trainer_gpus), (engine, where)

    # Every GPU of every pod is used by some trainer rank or engine: none idle, none forgotten.
    assert set(trainer_gpus) | set(engine_gpus) == set(held), where
    assert Counter(r.role for r in reports) == {"trainer": ranks, "engine": engines,
                                                "sidecar": engines}, where


@pytest.fixture
def gpu_cluster(collect_on_failure: KindCluster) -> Iterator[KindCluster]:
    """The kind cluster dressed as the examples' GPU cluster: a PriorityClass `training` and
    the workers labelled with the GPU product the examples select (left as it was after)."""
    cluster = collect_on_failure
    workers = cluster.workers()
    made_priority = cluster.kubectl("get", "priorityclass", PRIORITY_CLASS,
                                    check=False).returncode != 0
    if made_priority:
        cluster.kubectl("create", "priorityclass", PRIORITY_CLASS, "--value=1000",
                        "--description=rljob e2e: the GPU examples' priorityClassName")
    for node in workers:
        cluster.kubectl("label", "node", node, f"{PRODUCT_LABEL}=NVIDIA-H200", "--overwrite")
    try:
        yield cluster
    finally:
        for node in workers:
            cluster.kubectl("label", "node", node, f"{PRODUCT_LABEL}-", check=False)
        if made_priority:
            cluster.kubectl("delete", "priorityclass", PRIORITY_CLASS, check=False)


def _run(cluster: KindCluster, examples: list[Example]) -> None:
    """Apply the examples together, read their pods' allocations while they run, then check
    each job's plan once it has ended; the jobs and their children are gone after."""
    jobs = [Job(cluster, e) for e in examples]
    for job in jobs:
        job.apply()
    seen: dict[str, dict[str, Pod]] = {job.name: {} for job in jobs}

    def describe() -> str:
        return "\n".join(job.describe() for job in jobs)

    # Every compute pod scheduled and running, each holding the GPUs the plugin allocated.
    wait_for(lambda: all([job.record(seen[job.name]) for job in jobs]), timeout=START_S,
             interval=1, what="every compute pod to run", describe=describe)

    def ended() -> list[dict[str, Any]] | None:
        for job in jobs:
            job.record(seen[job.name])
        ended = [status for status in map(Job.ended, jobs) if status is not None]
        return ended if len(ended) == len(jobs) else None

    statuses = wait_for(ended, timeout=END_S, interval=2, what="the jobs to end",
                        describe=describe)
    for job, status in zip(jobs, statuses, strict=True):
        log = job.driver_log()
        assert status["phase"] == "Succeeded", (job.describe(), log[-4000:])
        (done,) = [c for c in status.get("conditions", []) if c["type"] == "Succeeded"]
        assert "plan" in done.get("message", "").lower(), status
        reports = parse_plan(log)
        assert reports, log[-4000:]
        check_plan(job, seen[job.name], reports)
    # A failed run leaves its jobs for the artifacts; the next run's apply removes them.
    for job in jobs:
        job.delete()


@pytest.mark.timeout(3600)  # includes a cold hack/kind-up when this test runs first
def test_gpu_examples_plan_devices_within_their_allocations(gpu_cluster: KindCluster) -> None:
    # The 7B job needs all 16 GPUs (an 8-GPU trainer pod, four 2-GPU rollout pods): alone.
    _run(gpu_cluster, [QWEN])
    # The colocated ones need 8 and 1: together.
    _run(gpu_cluster, [COLOCATED, TINY_MEGATRON])
