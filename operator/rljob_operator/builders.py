"""Pure builders: an RLJob spec in, the Kubernetes objects that run it out.

Nothing here talks to the API server, so every manifest can be checked in unit tests and
building it twice gives the same object (the reconciler relies on that for idempotence).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from rljob_api import API_VERSION, GROUP, KIND, PLURAL, env
from rljob_api.layout import (
    COLOCATED,
    DRIVER,
    ENGINE_PORT,
    HEAD,
    RAY_GCS_PORT,
    ROLLOUT,
    TRAINER,
    WEIGHT_SYNC_PORT,
    engine_count,
    engine_port,
    engines_per_pod,
    group_resource,
    group_slots,
    rollout_gpus_per_pod,
    weight_sync_health_port,
)
from rljob_api.mutability import Effect, paths_with
from rljob_api.spec import Placement, ResourceRequirements, RLJobSpec
from rljob_operator import names
from rljob_operator.sidecar_memory import add_memory, sidecar_memory_mib
from rljob_operator.status_writer import status_writer_parts

Obj = dict[str, Any]
GPU = "nvidia.com/gpu"
SHM_GIB_PER_GPU = 8  # NCCL and SGLang stage buffers in /dev/shm; 1 GiB floor for CPU pods
# The driver pod is a Ray node too: its object store (what the driver gets from actors) lives
# in /dev/shm, and Ray sizes it at 30 % of the pod's memory limit (4 GiB).
DRIVER_SHM_GIB = 2
HEAD_RESOURCES: Obj = {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
# The driver container's share of the driver pod's 500m CPU and 1 GiB; its status writer
# (`status_writer.RESOURCES`, 10m and 128 MiB) has the rest.
DRIVER_RESOURCES: Obj = {"requests": {"cpu": "490m", "memory": "896Mi"},
                         "limits": {"memory": "4Gi"}}

@dataclass(frozen=True)
class JobRef:
    """Identity of one RLJob: enough to name, label and own its children."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, body: Obj) -> JobRef:
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta["uid"])


def owner_reference(job: JobRef) -> Obj:
    """Makes the RLJob the controller of a child, so deleting it garbage-collects the child."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(job: JobRef, name: str, component: str) -> Obj:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": names.labels(job.name, component),
        "ownerReferences": [owner_reference(job)],
    }


def _resources(spec: ResourceRequirements, gpus: int) -> Obj:
    requests = {k: str(v) for k, v in spec.requests.items()}
    limits = {k: str(v) for k, v in spec.limits.items()}
    if gpus > 0:
        requests[GPU] = limits[GPU] = str(gpus)
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _env(job: JobRef, component: str) -> list[Obj]:
    return [
        {"name": env.JOB_NAME, "value": job.name},
        {"name": env.JOB_NAMESPACE, "value": job.namespace},
        {"name": env.COMPONENT, "value": component},
    ]


def _ray_auth_env(job: JobRef) -> list[Obj]:
    """Ray token authentication for a container that runs Ray (head, workers, driver).

    Every Ray process of the job must run with the same mode and token or its connections
    are refused; the token is read from the job's Secret, so it never appears in a pod spec,
    the status, an event or a log.
    """
    secret = {"name": names.ray_token_secret(job.name, job.uid), "key": names.RAY_TOKEN_KEY}
    return [
        {"name": env.RAY_AUTH_MODE, "value": "token"},
        {"name": env.RAY_AUTH_TOKEN, "valueFrom": {"secretKeyRef": secret}},
    ]


def _shm_volume(gpus: int) -> Obj:
    size = max(1, SHM_GIB_PER_GPU * gpus)
    return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{size}Gi"}}


def checkpoint_claim_name(job: str, spec: RLJobSpec) -> str:
    """The claim every pod mounts at `spec.checkpoint.path`: the user's, else the operator's."""
    return spec.checkpoint.pvc or names.checkpoint_claim(job)


def claim_names(job: str, spec: RLJobSpec) -> tuple[str, ...]:
    """Every PersistentVolumeClaim the job's pods mount: checkpoints, then model and data."""
    return tuple(c for c in (checkpoint_claim_name(job, spec), spec.model.pvc, spec.data.pvc)
                 if c)


def _checkpoint_volume(job: JobRef, spec: RLJobSpec) -> Obj:
    # Never an emptyDir: the driver, trainers and engines are different pods and must see
    # the same files (the built-in model the driver writes, every checkpoint).
    return {"name": "checkpoints",
            "persistentVolumeClaim": {"claimName": checkpoint_claim_name(job.name, spec)}}


def _data_volumes(job: JobRef, spec: RLJobSpec) -> tuple[list[Obj], list[Obj]]:
    """Volumes and mounts every job container shares: shm, checkpoints, model and data."""
    volumes = [_checkpoint_volume(job, spec)]
    mounts: list[Obj] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "checkpoints", "mountPath": spec.checkpoint.path},
    ]
    if spec.model.pvc:
        claim: Obj = {"claimName": spec.model.pvc, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": "/model", "readOnly": True})
    if spec.data.pvc:
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": spec.data.pvc}})
        mounts.append({"name": "data", "mountPath": "/data"})
    return volumes, mounts


def _scheduling(spec: RLJobSpec) -> Obj:
    sched = spec.scheduling
    out: Obj = {}
    if sched.node_selector:
        out["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        out["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in sched.tolerations
        ]
    if sched.priority_class_name:
        out["priorityClassName"] = sched.priority_class_name
    return out


def _pod_template(job: JobRef, spec: RLJobSpec, component: str, containers: list[Obj],
                  gpus: int) -> Obj:
    volumes, _ = _data_volumes(job, spec)
    return {
        "metadata": {"labels": names.labels(job.name, component)},
        "spec": {
            # No Kubernetes API token: Ray pods (head, trainers, engines, sidecars) never call
            # the API server; only the driver writes the job's status. They run as the
            # namespace's default ServiceAccount, not the job's, whose Role can write it.
            "automountServiceAccountToken": False,
            # A dead Ray container fails the pod; KubeRay replaces it and the operator
            # restarts the driver, instead of a silent in-place restart losing actors.
            "restartPolicy": "Never",
            "containers": containers,
            "volumes": [_shm_volume(gpus), *volumes],
            **_scheduling(spec),
        },
    }


def _ray_container(job: JobRef, spec: RLJobSpec, name: str, component: str, image: str,
                   resources: Obj, ports: list[Obj] | None = None) -> Obj:
    _, mounts = _data_volumes(job, spec)
    container: Obj = {
        "name": name,
        "image": image,
        "env": [*_env(job, component), *_ray_auth_env(job)],
        "resources": resources,
        "volumeMounts": mounts,
    }
    if ports:
        container["ports"] = ports
    return container


def _field_env(name: str, field_path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def weight_sync_store(job: JobRef) -> str:
    """HOST:PORT of the weight-sync store: on the Ray head, behind its stable Service."""
    return f"{names.head_service(job.name, job.namespace)}:{WEIGHT_SYNC_PORT}"


def _engine_ports(engines: int) -> list[Obj]:
    """Each engine's port and its sidecar's (/health, /metrics), engine by engine."""
    return [port for i in range(engines) for port in (
        {"containerPort": engine_port(i), "name": names.per_engine("engine", i, engines)},
        {"containerPort": weight_sync_health_port(i),
         "name": names.per_engine(names.WEIGHT_SYNC, i, engines)})]


def _ray_resources(slot: str, count: int) -> str:
    """rayStartParams `resources`: a custom Ray resource, one unit per placement slot of the
    pod (`rljob_api.layout.group_slots`), that the runtime requests so trainer and rollout
    actors land on their own group's pods.

    JSON in single quotes: KubeRay puts the value into the `ray start` shell line as it is,
    and also reads it itself (stripping the single quotes) before it adds `--num-gpus` from
    the container's `nvidia.com/gpu` limit. Escaped JSON in double quotes starts Ray as well,
    but KubeRay cannot read it and then adds no `--num-gpus`: Ray finds GPUs only through
    NVML, and none where NVML is not in the container."""
    return "'" + json.dumps({slot: count}) + "'"


def worker_groups(spec: RLJobSpec) -> dict[str, int]:
    """Worker group name → pod count; the operator waits for exactly these (plus the head)."""
    if spec.placement == Placement.colocated:
        return {COLOCATED: spec.trainer.replicas}
    return {TRAINER: spec.trainer.replicas, ROLLOUT: engine_count(spec)}


def _worker_group(job: JobRef, spec: RLJobSpec, group: str, replicas: int) -> Obj:
    # Engines per pod: one in a rollout pod, gpusPerReplica / gpusPerEngine in a colocated one.
    engines = 0 if group == TRAINER else engines_per_pod(spec)
    if group == ROLLOUT:
        gpus = rollout_gpus_per_pod(spec)
        main = _ray_container(job, spec, "ray-worker", group, spec.rollout.image,
                              _resources(spec.rollout.resources, gpus), _engine_ports(engines))
    else:
        gpus = spec.trainer.gpus_per_replica
        main = _ray_container(job, spec, "ray-worker", group, spec.trainer.image,
                              _resources(spec.trainer.resources, gpus), _engine_ports(engines))
    if engines:
        add_memory(main["resources"], engines * sidecar_memory_mib(spec))
    template = _pod_template(job, spec, group, [main], gpus)
    return {
        "groupName": group,
        "replicas": replicas,
        "minReplicas": replicas,
        "maxReplicas": replicas,
        "rayStartParams": {"resources": _ray_resources(group_resource(group),
                                                       group_slots(spec, group))},
        "template": template,
    }


def _revision(obj: Any) -> str:
    """A short digest of something built: equal builds give equal revisions, so comparing a
    child's revision with the one the current spec builds says whether it is outdated."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _stamp(meta: Obj, revision: str) -> None:
    meta.setdefault("annotations", {})[names.ANNOTATION_REVISION] = revision


def build_raycluster(job: JobRef, spec: RLJobSpec) -> Obj:
    """The RayCluster: a CPU-only head and the trainer/rollout (or one colocated) groups.

    Every pod template carries its revision (KubeRay copies it onto the pods), and the
    RayCluster the revision of its whole spec: after a spec edit the operator patches a
    RayCluster of another revision and replaces the pods whose template revision changed.
    A worker template's revision includes the head's, since workers cannot outlive their
    head; replica counts are in no template, so scaling replaces no pod."""
    # KubeRay's head Service exposes exactly the head container's ports.
    head_ports = [{"containerPort": RAY_GCS_PORT, "name": "gcs"},
                  {"containerPort": WEIGHT_SYNC_PORT, "name": "weight-sync"}]
    head = _ray_container(job, spec, "ray-head", HEAD, spec.trainer.image,
                          HEAD_RESOURCES, head_ports)
    head_group: Obj = {
        # No work on the head: every actor lands on a trainer or rollout pod.
        "rayStartParams": {"num-cpus": "0"},
        "template": _pod_template(job, spec, HEAD, [head], 0),
    }
    head_revision = _revision(head_group)
    _stamp(head_group["template"]["metadata"], head_revision)
    groups = []
    for group, replicas in worker_groups(spec).items():
        worker = _worker_group(job, spec, group, replicas)
        shape = {k: v for k, v in worker.items()
                 if k not in ("replicas", "minReplicas", "maxReplicas")}
        _stamp(worker["template"]["metadata"], _revision({HEAD: head_revision, **shape}))
        groups.append(worker)
    cluster_spec: Obj = {"headGroupSpec": head_group, "workerGroupSpecs": groups}
    meta = _metadata(job, names.raycluster_name(job.name), HEAD)
    _stamp(meta, _revision(cluster_spec))
    return {
        "apiVersion": names.RAY_API_VERSION,
        "kind": "RayCluster",
        "metadata": meta,
        "spec": cluster_spec,
    }


def runtime_config(spec: RLJobSpec) -> Obj:
    """The spec as far as the driver's runtime depends on it: everything but the fields the
    operator alone applies (`rljob_api.mutability`, effect `operator`), whose edits must not
    restart the driver."""
    doc: Obj = spec.model_dump(by_alias=True, mode="json")
    for path in paths_with(Effect.operator):
        *parents, leaf = path.split(".")
        node = doc
        for part in parents:
            node = node[part]
        node.pop(leaf, None)
    return doc


@dataclass(frozen=True)
class Revisions:
    """What the current spec builds, as revisions: the RayCluster's, each pod template's by
    component (`head`, `trainer`, `rollout`, `colocated`), and the driver's."""

    cluster: str
    templates: Mapping[str, str]
    driver: str


def revisions(job: JobRef, spec: RLJobSpec) -> Revisions:
    rc = build_raycluster(job, spec)
    head = rc["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
    templates = {HEAD: head[names.ANNOTATION_REVISION]}
    for group in rc["spec"]["workerGroupSpecs"]:
        templates[group["groupName"]] = group["template"]["metadata"]["annotations"][
            names.ANNOTATION_REVISION]
    cluster = rc["metadata"]["annotations"][names.ANNOTATION_REVISION]
    return Revisions(cluster, templates, _driver_revision(job, spec, cluster))


def _driver_revision(job: JobRef, spec: RLJobSpec, cluster: str) -> str:
    """The driver restarts when its pod, the config its runtime reads, or the RayCluster it
    drives would change; not for an edit the operator alone applies (recovery, suspend)."""
    pod = _driver_pod(job, spec, 0, [])
    # The grace is spec.recovery's, which the operator applies without a restart (it deletes
    # the driver with the current one); the next driver pod carries the new value.
    body = {k: v for k, v in pod["spec"].items() if k != "terminationGracePeriodSeconds"}
    return _revision({"cluster": cluster, "pod": body, "config": runtime_config(spec)})


def driver_command(job: JobRef, spec: RLJobSpec) -> list[str]:
    """`rljob run` joining the job's Ray cluster as a node of its own (a Ray driver needs a
    raylet on its host); it resumes from its workdir on the shared volume by itself."""
    return [
        "rljob", "run", f"{names.SPEC_DIR}/{names.SPEC_FILE}",
        "--workdir", f"{spec.checkpoint.path.rstrip('/')}/{job.name}",
        "--join", f"{names.head_service(job.name, job.namespace)}:{RAY_GCS_PORT}",
        *(["--plan-only"] if spec.plan_only else []),
    ]


def build_driver(job: JobRef, spec: RLJobSpec, restarts: int, compute_pods: list[str]) -> Obj:
    """The driver pod of one attempt.

    A bare pod, not a batch Job: the operator owns restarts (with backoff and the
    checkpoint bookkeeping), so nothing else should retry it. The annotations record which
    attempt it is and which compute pods it started with; a later reconcile compares them
    with what exists to tell that a pod was lost, even across operator restarts. Its
    revision says which spec it runs: after an edit that changes it, the driver is replaced
    (not counted as a restart) and resumes from the latest checkpoint.

    The driver runs a Ray node of its own (`rljob run --join`): it gets the Ray token, its
    pod IP as the node address, and a /dev/shm for that node's object store. It holds no
    Kubernetes API token: it reports status through the pod's status writer
    (`status_writer`), the one container that does.
    """
    pod = _driver_pod(job, spec, restarts, compute_pods)
    _stamp(pod["metadata"], revisions(job, spec).driver)
    return pod


def _driver_pod(job: JobRef, spec: RLJobSpec, restarts: int, compute_pods: list[str]) -> Obj:
    volumes, mounts = _data_volumes(job, spec)
    writer = status_writer_parts(spec.trainer.image, _env(job, DRIVER))
    meta = _metadata(job, names.driver_name(job.name), DRIVER)
    meta["annotations"] = {
        names.ANNOTATION_RESTARTS: str(restarts),
        names.ANNOTATION_COMPUTE_PODS: ",".join(sorted(compute_pods)),
        # `kubectl logs/exec <job>-driver` mean the driver, not its status writer.
        "kubectl.kubernetes.io/default-container": "driver",
    }
    container = {
        "name": "driver",
        "image": spec.trainer.image,
        "command": driver_command(job, spec),
        "env": [
            *_env(job, DRIVER),
            *_ray_auth_env(job),
            {"name": env.RESTARTS, "value": str(restarts)},
            _field_env(env.POD_NAME, "metadata.name"),
            _field_env(env.POD_IP, "status.podIP"),
            _field_env(env.POD_UID, "metadata.uid"),
            # Weight sync: engines listen on the ports their pods declare, and the store
            # takes the port the head Service exposes.
            {"name": env.ENGINE_PORT, "value": str(ENGINE_PORT)},
            {"name": env.WEIGHT_SYNC_PORT, "value": str(WEIGHT_SYNC_PORT)},
            *writer.driver_env,
        ],
        "resources": DRIVER_RESOURCES,
        "volumeMounts": [
            {"name": "spec", "mountPath": names.SPEC_DIR, "readOnly": True},
            writer.driver_mount,
            *mounts,
        ],
    }
    if spec.tracking.env_secret:
        # Credentials of the trackers (the driver logs to them) stay in a Secret. Optional,
        # so a missing one starts the driver anyway: a tracker never stops training.
        container["envFrom"] = [{"secretRef": {"name": spec.tracking.env_secret,
                                               "optional": True}}]
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{DRIVER_SHM_GIB}Gi"}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            # The only pod of the job with a Kubernetes API token, and only in its status
            # writer, which reports progress, checkpoints and failures to the RLJob's
            # status (build_rbac); the driver container mounts none.
            "serviceAccountName": names.service_account_name(job.name),
            "automountServiceAccountToken": False,
            "initContainers": [writer.container],
            "restartPolicy": "Never",
            # SIGTERM (a deletion by anyone, a preemption): the runtime finishes its step and
            # saves it within this grace.
            "terminationGracePeriodSeconds": spec.recovery.stop_grace_period_seconds,
            "containers": [container],
            "volumes": [
                {"name": "spec", "configMap": {"name": names.configmap_name(job.name)}},
                shm,
                *writer.volumes,
                *volumes,
            ],
            **_scheduling(spec),
        },
    }


def build_checkpoint_claim(job: JobRef, spec: RLJobSpec) -> Obj | None:
    """The shared checkpoint volume's claim, when the job does not bring one (`checkpoint.pvc`).

    ReadWriteMany, because the driver, the Ray head, the trainers and the engines are
    different pods (on different nodes) that all read and write the workdir. Owned by the
    RLJob: it outlives restarts and suspension, and goes when the job is deleted.
    """
    if spec.checkpoint.pvc:
        return None
    claim: Obj = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(job, names.checkpoint_claim(job.name), DRIVER),
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": spec.checkpoint.size}},
        },
    }
    if spec.checkpoint.storage_class_name:
        claim["spec"]["storageClassName"] = spec.checkpoint.storage_class_name
    return claim


def build_ray_token_secret(job: JobRef, token: str) -> Obj:
    """The job's Ray authentication token. Created once with a fresh random token and never
    rewritten (immutable): every Ray process of the job, across restarts, uses the same one."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(job, names.ray_token_secret(job.name, job.uid), HEAD),
        "type": "Opaque",
        "immutable": True,
        "stringData": {names.RAY_TOKEN_KEY: token},
    }


def job_pod_selector(job: JobRef) -> Obj:
    """The label selector of every pod of the job (head, workers, driver): each carries
    `names.labels(job.name, ...)`, KubeRay copying the templates' labels onto its pods."""
    return {"matchLabels": {names.LABEL_JOB: job.name}}


def build_network_policy(job: JobRef) -> Obj:
    """Ingress to the job's pods from the job's own pods only, on every port.

    Its pods serve what must never be reachable from outside the job: the engines (whose
    weight updates are pickles), the weight-sync store (on the head, through the head
    Service), the sidecars, and Ray's GCS, raylets, object managers, workers and agents,
    which Ray places on ports of its choosing. So the policy names no ports: any traffic to
    them from a pod of the job is allowed, and from anywhere else (another job's pods, the
    namespace's other pods, any other namespace, outside the cluster) none, where the
    cluster's network plugin enforces NetworkPolicies. Nothing else of the job takes ingress
    (the operator's metrics are the operator pod's own); `kubectl port-forward` and exec
    probes go through the kubelet to the pod's loopback, which no policy filters. Egress is
    left alone: the driver reaches the API server and the trackers. Owned by the RLJob, so
    it goes with the job; made before any pod, with the job's other support objects."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, names.network_policy(job.name), HEAD),
        "spec": {
            "podSelector": job_pod_selector(job),
            "policyTypes": ["Ingress"],
            # A podSelector without a namespaceSelector: pods of the policy's namespace only.
            "ingress": [{"from": [{"podSelector": job_pod_selector(job)}]}],
        },
    }


def spec_document(job: JobRef, spec: Obj) -> str:
    """The RLJob manifest the driver runs, as `rljob run` reads it."""
    doc = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": job.name, "namespace": job.namespace},
        "spec": spec,
    }
    return yaml.safe_dump(doc, sort_keys=False)


def build_configmap(job: JobRef, spec: Obj) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, names.configmap_name(job.name), DRIVER),
        "data": {names.SPEC_FILE: spec_document(job, spec)},
    }


def build_rbac(job: JobRef) -> list[Obj]:
    """ServiceAccount, Role and RoleBinding letting the driver pod read and patch its own
    RLJob's status (`resourceNames`), and nothing else.

    Only the driver pod runs as this ServiceAccount, and only its status writer container
    mounts the token (`status_writer`): the one process that writes the job's status
    (progress, checkpoints, what it resumed from, runtime failures), as JSON fields the
    driver hands it. The driver container, where the users' reward and generate hooks and
    any actor Ray places on the driver's node run, and the Ray pods mount no token at all.
    """
    sa = names.service_account_name(job.name)
    role = names.role_name(job.name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": _metadata(job, sa, DRIVER)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(job, role, DRIVER),
            # Used by the driver pod's status writer alone: what it needs, for this one
            # RLJob.
            "rules": [
                {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"],
                 "resourceNames": [job.name], "verbs": ["get", "patch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(job, role, DRIVER),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": job.namespace}],
        },
    ]
