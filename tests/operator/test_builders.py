"""Pure builders: spec → RayCluster, driver pod, ConfigMap and RBAC."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from rljob_api.spec import COLOCATED_IMAGE, RLJobSpec
from rljob_api.validate import spec_problems
from rljob_operator import builders
from rljob_operator.builders import JobRef
from rljob_operator.sidecar_memory import sidecar_memory_mib

pytestmark = pytest.mark.unit
JOB = JobRef("rl", "team-a", "uid-1")


def spec(**raw: Any) -> RLJobSpec:
    """A valid spec of `raw`; a colocated SGLang job gets the colocated image it needs."""
    if raw.get("placement") == "colocated" and "image" not in raw.get("trainer", {}):
        raw["trainer"] = {**raw.get("trainer", {}), "image": f"{COLOCATED_IMAGE}:0.1.0"}
    assert spec_problems(raw) == []
    return RLJobSpec.model_validate(raw)


def containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    return list(group["template"]["spec"]["containers"])


def test_disaggregated_cluster_has_head_trainer_and_rollout_groups() -> None:
    s = spec(trainer={"replicas": 2, "gpusPerReplica": 4, "image": "t:1",
                      "resources": {"requests": {"cpu": "8"}, "limits": {"memory": "64Gi"}}},
             rollout={"engines": 3, "gpusPerEngine": 2, "image": "r:1"},
             scheduling={"nodeSelector": {"pool": "h200"}, "priorityClassName": "high",
                         "tolerations": [{"key": "gpu", "operator": "Exists",
                                          "effect": "NoSchedule"}]},
             checkpoint={"pvc": "ckpt", "path": "/ckpt"})
    rc = builders.build_raycluster(JOB, s)
    assert rc["metadata"]["name"] == "rl"
    assert rc["metadata"]["ownerReferences"] == [{
        "apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "name": "rl", "uid": "uid-1",
        "controller": True, "blockOwnerDeletion": True}]
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert {k: g["replicas"] for k, g in groups.items()} == {"trainer": 2, "rollout": 3}

    trainer = containers(groups["trainer"])[0]
    assert trainer["image"] == "t:1"
    assert trainer["resources"] == {
        "requests": {"cpu": "8", "nvidia.com/gpu": "4"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "4"}}
    assert {"name": "checkpoints", "mountPath": "/ckpt"} in trainer["volumeMounts"]
    pod = groups["trainer"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}} \
        in pod["volumes"]
    assert pod["nodeSelector"] == {"pool": "h200"}
    assert pod["priorityClassName"] == "high"
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert groups["trainer"]["template"]["metadata"]["labels"]["rljob.io/component"] == "trainer"

    # The engine's weight-sync sidecar is a Ray actor in the engine's own container, which
    # holds the GPUs: no second container, which the device plugin could not give them.
    (engine,) = containers(groups["rollout"])
    assert engine["image"] == "r:1"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["RLJOB_NAME"] == "rl" and env["RLJOB_NAMESPACE"] == "team-a"

    head = containers(rc["spec"]["headGroupSpec"])[0]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    assert rc["spec"]["headGroupSpec"]["rayStartParams"] == {"num-cpus": "0"}
    # Placement: one unit of the group's custom Ray resource per slot of the pod.
    # Single-quoted JSON: KubeRay reads it before it adds --num-gpus (e2e/kind's GPU plan).
    assert groups["trainer"]["rayStartParams"] == {"resources": '\'{"rljob_trainer": 4}\''}
    assert groups["rollout"]["rayStartParams"] == {"resources": '\'{"rljob_rollout": 2}\''}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_weight_sync_rendezvous_goes_through_the_head_service(placement: str) -> None:
    s = spec(placement=placement, trainer={"replicas": 1, "gpusPerReplica": 2},
             rollout={"engines": 1, "gpusPerEngine": 2})
    rc = builders.build_raycluster(JOB, s)
    head = containers(rc["spec"]["headGroupSpec"])[0]
    # KubeRay's head Service exposes exactly these ports: GCS and the weight-sync store.
    assert head["ports"] == [{"containerPort": 6379, "name": "gcs"},
                             {"containerPort": 29600, "name": "weight-sync"}]
    group = next(g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] != "trainer")
    (engine,) = containers(group)
    assert {"containerPort": 30000, "name": "engine"} in engine["ports"]
    assert {"containerPort": 8090, "name": "weight-sync"} in engine["ports"]
    # The driver puts the store and engines where the pods declare them.
    (driver,) = builders.build_driver(JOB, s, 0, [])["spec"]["containers"]
    denv = env_of(driver)
    assert (denv["RLJOB_WEIGHT_SYNC_PORT"], denv["RLJOB_ENGINE_PORT"]) == ("29600", "30000")


def test_colocated_uses_one_shared_group_with_a_port_per_engine() -> None:
    s = spec(placement="colocated", trainer={"replicas": 2, "gpusPerReplica": 8},
             rollout={"engines": 8, "gpusPerEngine": 2})
    groups = builders.build_raycluster(JOB, s)["spec"]["workerGroupSpecs"]
    assert [(g["groupName"], g["replicas"]) for g in groups] == [("colocated", 2)]
    # Each pod holds 8 / 2 = 4 engines: a port for each and one for its sidecar, which runs
    # in the same container.
    (main,) = containers(groups[0])
    assert main["ports"] == [port for i in range(4) for port in (
        {"containerPort": 30000 + i, "name": f"engine-{i}"},
        {"containerPort": 8090 + i, "name": f"weight-sync-{i}"})]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "8"


@pytest.mark.parametrize(("resources", "want"), [
    # 4 engines × (768 MiB process + 256 MiB bucket) = 4096 MiB on top of the user's figures
    ({"requests": {"memory": "8Gi"}, "limits": {"memory": "64Gi"}},
     {"requests": "12Gi", "limits": "68Gi"}),  # written as the API server writes them
    ({"requests": {"memory": "1G"}}, {"requests": "5050Mi", "limits": None}),  # 953.7 + 4096, up
    ({}, {"requests": "4Gi", "limits": None}),  # no limit stays no limit
])
def test_sidecar_memory_is_added_to_the_engine_container(
        resources: dict[str, Any], want: dict[str, str | None]) -> None:
    s = spec(placement="colocated", trainer={"replicas": 1, "gpusPerReplica": 4,
                                             "resources": resources},
             rollout={"engines": 4, "gpusPerEngine": 1},
             weightSync={"bucketSizeMb": 256})
    assert sidecar_memory_mib(s) == 768 + 256
    (group,) = builders.build_raycluster(JOB, s)["spec"]["workerGroupSpecs"]
    (main,) = containers(group)
    got = {kind: main["resources"].get(kind, {}).get("memory") for kind in want}
    assert got == want


def test_trainer_pods_get_no_sidecar_memory() -> None:
    s = spec(trainer={"replicas": 1, "gpusPerReplica": 2,
                      "resources": {"limits": {"memory": "64Gi"}}},
             rollout={"engines": 2, "gpusPerEngine": 1,
                      "resources": {"limits": {"memory": "32Gi"}}})
    groups = {g["groupName"]: g for g in builders.build_raycluster(JOB, s)["spec"]
              ["workerGroupSpecs"]}
    assert containers(groups["trainer"])[0]["resources"]["limits"]["memory"] == "64Gi"
    rollout = containers(groups["rollout"])[0]["resources"]
    # the request Kubernetes would have taken from the limit, grown as the limit is
    assert rollout["limits"]["memory"] == rollout["requests"]["memory"] == \
        f"{32 * 1024 + 768 + 512}Mi"


def test_hf_rollout_and_cpu_trainer_request_no_gpus() -> None:
    s = spec(trainer={"backend": "torch", "gpusPerReplica": 0},
             rollout={"backend": "hf", "engines": 2, "gpusPerEngine": 1})
    for group in builders.build_raycluster(JOB, s)["spec"]["workerGroupSpecs"]:
        resources = containers(group)[0]["resources"]
        assert "nvidia.com/gpu" not in resources.get("limits", {})


def test_driver_runs_the_job_against_the_head_and_records_its_attempt() -> None:
    s = spec(checkpoint={"path": "/ckpt/"})
    pod = builders.build_driver(JOB, s, restarts=2, compute_pods=["b", "a"])
    assert pod["metadata"]["name"] == "rl-driver"
    assert pod["metadata"]["annotations"] == {
        "rljob.io/restarts": "2", "rljob.io/compute-pods": "a,b",
        "rljob.io/revision": builders.revisions(JOB, s).driver,
        "kubectl.kubernetes.io/default-container": "driver"}
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["serviceAccountName"] == "rl-runtime"
    (container,) = pod["spec"]["containers"]
    # One readable line: the runtime itself joins the head as a Ray node of its own.
    assert container["command"] == [
        "rljob", "run", "/etc/rljob/rljob.yaml", "--workdir", "/ckpt/rl",
        "--join", "rl-head-svc.team-a.svc:6379"]
    assert pod["metadata"]["labels"]["rljob.io/component"] == "driver"
    env = env_of(container)
    assert env["RLJOB_RESTARTS"] == "2"
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    # Time to finish the step and save on SIGTERM, from spec.recovery (default 300 s).
    assert pod["spec"]["terminationGracePeriodSeconds"] == 300
    # Its Ray node keeps its object store in /dev/shm.
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_a_plan_only_job_s_driver_plans_only() -> None:
    (container,) = builders.build_driver(JOB, spec(planOnly=True), 0, [])["spec"]["containers"]
    assert container["command"][-1] == "--plan-only"
    (plain,) = builders.build_driver(JOB, spec(), 0, [])["spec"]["containers"]
    assert "--plan-only" not in plain["command"]


def _all_containers(job: RLJobSpec) -> dict[str, dict[str, Any]]:
    """`<pod kind>/<container>` → container, for every container the job runs."""
    rc = builders.build_raycluster(JOB, job)
    out = {f"head/{c['name']}": c for c in containers(rc["spec"]["headGroupSpec"])}
    for group in rc["spec"]["workerGroupSpecs"]:
        out.update({f"{group['groupName']}/{c['name']}": c for c in containers(group)})
    (driver,) = builders.build_driver(JOB, job, 0, [])["spec"]["containers"]
    out["driver/driver"] = driver
    return out


def test_only_the_driver_gets_the_trackers_secret_and_starts_without_it() -> None:
    """The trackers run in the driver; their credentials come from the user's Secret (never
    the spec), optional so that a missing Secret does not keep the driver from starting."""
    plain = _all_containers(spec())
    assert not any("envFrom" in c for c in plain.values())
    s = spec(tracking={"wandb": {"enabled": True, "mode": "online"}, "envSecret": "rl-wandb"})
    for name, container in _all_containers(s).items():
        if name == "driver/driver":
            assert container["envFrom"] == [{"secretRef": {"name": "rl-wandb",
                                                           "optional": True}}]
        else:
            assert "envFrom" not in container, name


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_every_ray_container_and_only_those_get_the_token_from_the_secret(
        placement: str) -> None:
    s = spec(placement=placement, trainer={"replicas": 1, "gpusPerReplica": 2},
             rollout={"engines": 2, "gpusPerEngine": 1})
    ray = {"head/ray-head", "driver/driver"}
    for name, container in _all_containers(s).items():
        env = env_of(container)
        if name in ray or name.endswith("/ray-worker"):
            assert env["RAY_AUTH_MODE"] == "token", name
            assert env["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": "rl-ray-token-uid-1",
                                                              "key": "auth_token"}}, name
        else:
            raise AssertionError(f"{name} is not a Ray container")
    # The token never appears in a manifest, only the reference to the Secret.
    secret = builders.build_ray_token_secret(JOB, "f" * 64)
    # Named after the job and its UID: an existing Secret of that name can only be this job's.
    assert secret["metadata"]["name"] == "rl-ray-token-uid-1" and secret["immutable"] is True
    assert secret["stringData"] == {"auth_token": "f" * 64}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert "f" * 64 not in yaml.safe_dump([builders.build_raycluster(JOB, s),
                                           builders.build_driver(JOB, s, 0, [])])


def test_without_checkpoint_pvc_every_pod_mounts_the_operators_shared_claim() -> None:
    s = spec(checkpoint={"path": "/ckpt", "size": "50Gi", "storageClassName": "nfs"})
    claim = builders.build_checkpoint_claim(JOB, s)
    assert claim is not None
    assert claim["metadata"]["name"] == "rl-checkpoints"
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "RLJob"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"],
                             "resources": {"requests": {"storage": "50Gi"}},
                             "storageClassName": "nfs"}
    default = builders.build_checkpoint_claim(JOB, spec())
    assert default is not None and "storageClassName" not in default["spec"]
    assert default["spec"]["resources"]["requests"]["storage"] == "10Gi"
    rc = builders.build_raycluster(JOB, s)
    templates = [rc["spec"]["headGroupSpec"]["template"],
                 *(g["template"] for g in rc["spec"]["workerGroupSpecs"])]
    pods = [t["spec"] for t in templates] + [builders.build_driver(JOB, s, 0, [])["spec"]]
    for pod in pods:
        (volume,) = [v for v in pod["volumes"] if v["name"] == "checkpoints"]
        assert volume == {"name": "checkpoints",
                          "persistentVolumeClaim": {"claimName": "rl-checkpoints"}}
        # Only /dev/shm and the status writer's socket are pod-local; never the checkpoints.
        assert not any("emptyDir" in v for v in pod["volumes"]
                       if v["name"] not in {"dshm", "status-socket"})
    for name, container in _all_containers(s).items():
        assert {"name": "checkpoints", "mountPath": "/ckpt"} in container["volumeMounts"], name


def test_checkpoint_pvc_brings_your_own_claim() -> None:
    s = spec(checkpoint={"pvc": "team-nfs"})
    assert builders.build_checkpoint_claim(JOB, s) is None
    (driver,) = builders.build_driver(JOB, s, 0, [])["spec"]["containers"]
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in driver["volumeMounts"]
    volumes = builders.build_driver(JOB, s, 0, [])["spec"]["volumes"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "team-nfs"}} in volumes


def test_configmap_holds_a_manifest_rljob_run_accepts() -> None:
    raw = {"trainer": {"replicas": 1}}
    cm = builders.build_configmap(JOB, raw)
    doc = yaml.safe_load(cm["data"]["rljob.yaml"])
    assert doc["kind"] == "RLJob" and doc["metadata"] == {"name": "rl", "namespace": "team-a"}
    assert doc["spec"] == raw


def test_role_grants_only_this_jobs_status() -> None:
    sa, role, binding = builders.build_rbac(JOB)
    assert sa["metadata"]["name"] == "rl-runtime"
    assert all(rule["resourceNames"] == ["rl"] for rule in role["rules"])
    verbs = {r["resources"][0]: r["verbs"] for r in role["rules"]}
    assert verbs == {"rljobs/status": ["get", "patch"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rl-runtime",
                                    "namespace": "team-a"}]


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_only_the_driver_pods_status_writer_gets_a_kubernetes_api_token(placement: str) -> None:
    """The status writer writes the job's status; Ray pods never call the API server, so they
    mount no token and do not run as the job's ServiceAccount (whose Role can write the
    status); in the driver pod only the writer container mounts the token, and the driver
    container (hooks, Ray actors) gets the writer's socket instead."""
    gpus = {"trainer": {"gpusPerReplica": 2}, "rollout": {"engines": 2, "gpusPerEngine": 1}}
    s = spec(placement=placement, **gpus)
    rc = builders.build_raycluster(JOB, s)
    templates = [rc["spec"]["headGroupSpec"]["template"],
                 *(g["template"] for g in rc["spec"]["workerGroupSpecs"])]
    assert len(templates) == (2 if placement == "colocated" else 3)
    for template in templates:
        assert template["spec"]["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in template["spec"]
    driver = builders.build_driver(JOB, s, 0, [])["spec"]
    assert driver["serviceAccountName"] == "rl-runtime"
    assert driver["automountServiceAccountToken"] is False
    (writer,) = driver["initContainers"]
    (main,) = driver["containers"]
    token_volumes = {v["name"] for v in driver["volumes"] if "serviceAccountToken" in str(v)}
    assert len(token_volumes) == 1
    assert {m["name"] for m in writer["volumeMounts"]} & token_volumes
    assert not {m["name"] for m in main["volumeMounts"]} & token_volumes
    assert any(m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
               for m in writer["volumeMounts"])
    # A native sidecar: up before the driver, stopped after it, never deciding the phase.
    assert writer["restartPolicy"] == "Always"
    socket = {e["name"]: e["value"] for e in writer["env"]}["RLJOB_STATUS_SOCKET"]
    assert {e["name"]: e.get("value") for e in main["env"]}["RLJOB_STATUS_SOCKET"] == socket
    shared = {m["name"] for m in writer["volumeMounts"]} & {m["name"] for m in main["volumeMounts"]}
    assert any(socket.startswith(m["mountPath"] + "/") for m in main["volumeMounts"]
               if m["name"] in shared)
    (_, _role, binding) = builders.build_rbac(JOB)
    assert binding["subjects"][0]["name"] == driver["serviceAccountName"]


def test_builders_are_deterministic() -> None:
    s = spec()
    assert builders.build_raycluster(JOB, s) == builders.build_raycluster(JOB, s)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector applied to `labels` (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        held = {"In": key in labels and labels[key] in values,
                "NotIn": key not in labels or labels[key] not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not held:
            return False
    return True


def _admits(policy: dict[str, Any], to: tuple[str, dict[str, str]],
            source: tuple[str, dict[str, str]], port: int) -> bool:
    """Whether `policy` (networking.k8s.io/v1, Ingress) lets `source` (namespace, labels)
    reach `to` on `port`; a pod it does not select is not isolated by it."""
    namespace = policy["metadata"]["namespace"]
    if to[0] != namespace or not _selects(policy["spec"]["podSelector"], to[1]):
        return True
    for rule in policy["spec"].get("ingress") or []:
        if rule.get("ports") and not any(p.get("port") == port for p in rule["ports"]):
            continue
        for peer in rule.get("from") or [{}]:
            assert "ipBlock" not in peer, "no address range is let in"
            if "namespaceSelector" in peer:
                raise AssertionError("the job's pods are let in from its own namespace only")
            if source[0] == namespace and _selects(peer.get("podSelector", {}), source[1]):
                return True
    return False


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_network_policy_admits_exactly_the_jobs_own_pods(placement: str) -> None:
    """The NetworkPolicy, evaluated on the labels of every pod the builders make for the
    job (the head, each worker group, the driver): each is isolated by it, each reaches each
    on any port (engines, the store, Ray's ports of its choosing), and a pod of another job,
    an unlabelled pod of the same namespace, or a pod of another namespace that copies the
    job's labels reaches none of them."""
    gpus = {"trainer": {"gpusPerReplica": 2}, "rollout": {"engines": 2, "gpusPerEngine": 1}}
    s = spec(placement=placement, **gpus)
    policy = builders.build_network_policy(JOB)
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["name"] == "rl-peers-only"
    assert policy["metadata"]["namespace"] == "team-a"
    assert policy["metadata"]["ownerReferences"] == [builders.owner_reference(JOB)]
    assert policy["spec"]["policyTypes"] == ["Ingress"]

    def pods_of(job: JobRef) -> list[dict[str, str]]:
        rc = builders.build_raycluster(job, s)
        templates = [rc["spec"]["headGroupSpec"]["template"],
                     *(g["template"] for g in rc["spec"]["workerGroupSpecs"])]
        return [*(t["metadata"]["labels"] for t in templates),
                builders.build_driver(job, s, 0, [])["metadata"]["labels"]]

    mine = [("team-a", labels) for labels in pods_of(JOB)]
    assert len(mine) == (3 if placement == "colocated" else 4)
    other_job = [("team-a", labels) for labels in pods_of(JobRef("rl-2", "team-a", "uid-2"))]
    strangers = [*other_job, ("team-a", {}), ("team-a", {"app": "notebook"}),
                 *(("team-b", labels) for labels in pods_of(JobRef("rl", "team-b", "uid-3")))]
    ports = [6379, 29600, 30000, 30001, 8090, 10002, 19999, 52365, 8265, 10001]
    for to in mine:
        assert _selects(policy["spec"]["podSelector"], to[1]), f"{to} is not isolated"
        for port in ports:
            for source in mine:
                assert _admits(policy, to, source, port), (to, source, port)
            for source in strangers:
                assert not _admits(policy, to, source, port), (to, source, port)
    for other in other_job:  # it isolates only this job's pods
        assert not _selects(policy["spec"]["podSelector"], other[1])
