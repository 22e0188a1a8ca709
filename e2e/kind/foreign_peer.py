"""A pod of another namespace tries the job's engine and weight-sync store, and is refused.

`assert_foreign_pod_refused(cluster, namespace, job)` runs, while the job runs, a pod in a
namespace of its own (the job's rollout image, nothing pulled) that, with no key:
- POSTs `/generate` and `/update_weights_from_tensor` to an engine of the job (a rollout or
  colocated pod's IP, port `layout.ENGINE_PORT`), the update's body a pickle that would
  create MARKER in the engine's container if it were ever unpickled;
- connects to the weight-sync store through the head Service (`<job>-head-svc.<ns>.svc`,
  port `layout.WEIGHT_SYNC_PORT`) and, if it gets in, reads what the trainer wrote there and
  writes a registration of a made-up engine, untagged (what a stranger can write);
- tries a TCP connection to Ray's GCS on the head (reported, not judged: Ray's token guards it).

It passes when each attempt was refused, by the network (connection refused or timed out:
the job's NetworkPolicy, where the network plugin enforces it) or by the job (401 from the
engine routes; in the store, values the stranger cannot sign and a registration the trainer
ignores, so the job's weight version goes on advancing with its own engines), MARKER never
appeared in the engine's container, and the job's NetworkPolicy is there, owned by the job.

On this repository's kind cluster the plugin enforces no NetworkPolicy: its node image has
no kindnetd (the pod network is `rljob-podnet`, CNI `ptp` routes, no policy agent), so the
engine answers 401 and the store port is reachable, its protection being the signed values.
Where an enforcing plugin runs (Calico, Cilium, kindnetd >= kind v0.24), every connection
is refused by the network instead.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from e2e.kind.kindcluster import KindCluster
from rljob_api import layout
from rljob_operator import names
from tests.polling import wait_for

MARKER = "/tmp/rljob-foreign-peer-unpickled"
PROBE_TIMEOUT_S = 300.0
RESULT = "FOREIGN-PEER-RESULT "

# Run in the foreign pod (the rollout image's Python; torch for the store client).
PROBE = r'''
import base64, json, os, pickle, socket, urllib.error, urllib.request
from datetime import timedelta

out = {}


class Touch:
    def __reduce__(self):
        return open, (os.environ["MARKER"], "w")


def post(path, body):
    req = urllib.request.Request(os.environ["ENGINE_URL"] + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as answer:
            return {"status": answer.status, "body": answer.read(300).decode(errors="replace")}
    except urllib.error.HTTPError as err:
        return {"status": err.code, "body": err.read(300).decode(errors="replace")}
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


def reach(host, port):
    try:
        socket.create_connection((host, port), timeout=5).close()
        return None
    except OSError as err:
        return f"{type(err).__name__}: {err}"


evil = base64.b64encode(pickle.dumps(Touch())).decode()
out["generate"] = post("/generate", {"input_ids": [1, 2, 3],
                                     "sampling_params": {"max_new_tokens": 1}})
out["update"] = post("/update_weights_from_tensor",
                     {"serialized_named_tensors": [evil], "weight_version": "999999"})
host, port = os.environ["STORE_HOST"], int(os.environ["STORE_PORT"])
refused = reach(host, port)
if refused:
    out["store"] = {"error": refused}
else:
    from torch.distributed import TCPStore

    def client(libuv):
        return TCPStore(host, port, is_master=False, wait_for_workers=False,
                        timeout=timedelta(seconds=15), use_libuv=libuv)

    try:
        try:
            store = client(True)
        except RuntimeError as err:
            if "libuv" not in str(err):
                raise
            store = client(False)
        trainer = bytes(store.get("ws/trainer")) if store.check(["ws/trainer"]) else b""
        index = int(store.add("ws/members", 1)) - 1
        store.set(f"ws/member/{index}", json.dumps({
            "engine": "foreign-peer", "incarnation": "forged", "engine_version": "",
            "health_url": "http://127.0.0.1:1", "gpu": ""}))
        out["store"] = {"reachable": True, "trainer_value": trainer[:120].decode(errors="replace"),
                        "forged_member": index}
    except Exception as err:
        out["store"] = {"error": f"{type(err).__name__}: {err}"}
gcs = reach(os.environ["GCS_HOST"], int(os.environ["GCS_PORT"]))
out["ray_gcs"] = {"error": gcs} if gcs else {"reachable": True}
print(os.environ["RESULT"] + json.dumps(out), flush=True)
'''


def _refused_by_network(attempt: dict[str, Any]) -> bool:
    error = str(attempt.get("error", ""))
    return any(word in error for word in ("refused", "timed out", "timeout", "Timeout",
                                          "unreachable", "No route"))


def _engine_pod(cluster: KindCluster, namespace: str, job: str) -> dict[str, Any]:
    pods = cluster.get("pods", "-n", namespace, "-l", f"{names.LABEL_JOB}={job}")["items"]
    engines = [p for p in pods if p["metadata"]["labels"].get(names.LABEL_COMPONENT)
               in (layout.ROLLOUT, layout.COLOCATED) and p["status"].get("phase") == "Running"
               and p["status"].get("podIP")]
    assert engines, f"no running engine pod of {namespace}/{job}"
    engine: dict[str, Any] = engines[0]
    return engine


def _probe_pod(name: str, namespace: str, image: str, env: dict[str, str]) -> dict[str, Any]:
    script = 'exec "$(command -v python3 || command -v python)" -c "$PROBE"'
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "probe", "image": image, "imagePullPolicy": "Never",
                "command": ["sh", "-c", script],
                "env": [{"name": k, "value": v} for k, v in {**env, "PROBE": PROBE}.items()],
                "resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                              "limits": {"memory": "1Gi"}},
            }],
        },
    }


def assert_foreign_pod_refused(cluster: KindCluster, namespace: str, job: str,
                               timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Run the foreign pod against the running job `namespace/job`, assert it was refused
    everywhere (see the module's docstring) and return what it saw, with
    `network_enforced` (whether the network refused it) added."""
    rljob = cluster.get("rljob", job, "-n", namespace)
    uid = rljob["metadata"]["uid"]
    policy = cluster.get("networkpolicy", names.network_policy(job), "-n", namespace)
    assert policy["metadata"]["ownerReferences"][0]["uid"] == uid, policy["metadata"]
    engine = _engine_pod(cluster, namespace, job)
    engine_name = engine["metadata"]["name"]
    head = names.head_service(job, namespace)
    foreign = f"rljob-foreign-{uuid.uuid4().hex[:6]}"
    env = {"ENGINE_URL": f"http://{engine['status']['podIP']}:{layout.ENGINE_PORT}",
           "STORE_HOST": head, "STORE_PORT": str(layout.WEIGHT_SYNC_PORT),
           "GCS_HOST": head, "GCS_PORT": str(layout.RAY_GCS_PORT),
           "MARKER": MARKER, "RESULT": RESULT}
    cluster.kubectl("create", "namespace", foreign)
    try:
        pod = _probe_pod("foreign-peer", foreign, rljob["spec"]["rollout"]["image"], env)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))

        def finished() -> str | None:
            phase = cluster.get("pod", "foreign-peer", "-n", foreign)["status"].get("phase")
            return phase if phase in ("Succeeded", "Failed") else None

        phase = wait_for(finished, timeout=timeout, interval=2,
                         what="the foreign pod to finish its attempts",
                         describe=lambda: cluster.kubectl("describe", "pod", "foreign-peer",
                                                          "-n", foreign, check=False).stdout)
        log = cluster.kubectl("logs", "foreign-peer", "-n", foreign).stdout
        lines = [line for line in log.splitlines() if line.startswith(RESULT)]
        assert phase == "Succeeded" and lines, f"the foreign pod ended {phase}:\n{log[-4000:]}"
        seen: dict[str, Any] = json.loads(lines[-1][len(RESULT):])
    finally:
        cluster.kubectl("delete", "namespace", foreign, "--wait=false", check=False)

    for route in ("generate", "update"):
        attempt = seen[route]
        assert _refused_by_network(attempt) or attempt.get("status") == 401, (route, attempt)
    # The update's pickle was never unpickled in the engine's container.
    check = cluster.kubectl("exec", "-n", namespace, engine_name, "-c", "ray-worker", "--",
                            "sh", "-c", f"test ! -e {MARKER}", check=False)
    assert check.returncode == 0, f"{MARKER} exists in {engine_name}: the body was unpickled"

    store = seen["store"]
    if store.get("reachable"):
        # No network refusal: what the trainer wrote carries its tag (64 hex characters
        # before the value), which the stranger cannot make; its own untagged registration
        # is ignored, so the job's weight version goes on advancing with its own engines
        # (a registration taken would put the made-up engine in the broadcast group, which
        # would wait for it until the sync failed).
        value = store["trainer_value"]
        tag = value[:64]
        assert len(tag) == 64 and all(c in "0123456789abcdef" for c in tag), value

        def version() -> int:
            status = cluster.get("rljob", job, "-n", namespace).get("status") or {}
            return int((status.get("progress") or {}).get("weightVersion") or 0)

        # Read once the forged registration is in the store (the pod has finished).
        version_after_probe = version()
        wait_for(lambda: version() >= version_after_probe + 2,
                 timeout=timeout, interval=5,
                 what="two more weight versions served after the forged registration")
    else:
        assert _refused_by_network(store), store
    seen["network_enforced"] = all(_refused_by_network(seen[k])
                                   for k in ("generate", "update", "store"))
    return seen
