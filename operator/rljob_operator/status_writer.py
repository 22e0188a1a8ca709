"""The driver pod's status writer: the only container of a job with a Kubernetes API token.

The driver container runs the driver, a Ray node of the job's cluster, the rollout worker and
with it the user's reward and generate hooks, and any actor Ray places there; none of them
should hold a credential. So the pod mounts no token by default
(`automountServiceAccountToken: false`), and the ServiceAccount's token is projected into
the writer container alone, at the path in-cluster clients read. The writer is a native
sidecar (an init container with `restartPolicy: Always`): it is up before the driver
starts, restarted by the kubelet if it dies, stopped only after the driver has ended (so the
driver's last report, a stop on SIGTERM, still reaches it), and never holds the pod open
or decides its phase. The two containers share a socket in an emptyDir
(`rljob.reporting.status_sink` says what travels over it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob_api import env

Obj = dict[str, Any]

CONTAINER = "status-writer"
SOCKET_VOLUME = "status-socket"
SOCKET_DIR = "/var/run/rljob-status"
SOCKET_PATH = f"{SOCKET_DIR}/status.sock"
TOKEN_VOLUME = "api-token"
# Where in-cluster clients look for the token, the CA and the namespace.
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_EXPIRATION_S = 3607  # what the kubelet gives an automounted token; it refreshes it
RESOURCES: Obj = {"requests": {"cpu": "10m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}


@dataclass(frozen=True)
class StatusWriterParts:
    """What the status writer adds to a driver pod."""

    container: Obj  # the native sidecar, for `initContainers`
    volumes: list[Obj]  # the socket's emptyDir and the projected token
    driver_env: list[Obj]  # tells the driver's runtime to report through the socket
    driver_mount: Obj  # the socket's volume in the driver container, read-only


def status_writer_parts(image: str, job_env: list[Obj]) -> StatusWriterParts:
    """The status writer of a driver pod running `image`; `job_env` names the job."""
    socket_env = {"name": env.STATUS_SOCKET, "value": SOCKET_PATH}
    socket_mount = {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR}
    container = {
        "name": CONTAINER,
        "image": image,
        "command": ["python", "-m", "rljob.reporting.status_writer"],
        "restartPolicy": "Always",
        "env": [*job_env, socket_env],
        "resources": RESOURCES,
        "volumeMounts": [
            socket_mount,
            {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
        ],
        # The driver starts once the socket exists: its first report finds a listener.
        "startupProbe": {"exec": {"command": ["test", "-S", SOCKET_PATH]},
                         "periodSeconds": 1, "failureThreshold": 120},
    }
    token = {
        "name": TOKEN_VOLUME,
        "projected": {"sources": [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_EXPIRATION_S}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt",
                                                                   "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
                "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
        ]},
    }
    return StatusWriterParts(
        container=container,
        volumes=[{"name": SOCKET_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                 token],
        driver_env=[socket_env],
        # Read-only: the driver connects to the socket (a read-only mount allows that) but
        # cannot remove it, put its own listener in its place, or block the path.
        driver_mount={**socket_mount, "readOnly": True},
    )
