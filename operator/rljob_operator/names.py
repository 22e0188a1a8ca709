"""Names, labels and annotations shared by the operator's builders and observers.

Every child name derives from the RLJob name alone, so a restarted operator finds the
children its predecessor made instead of creating duplicates.
"""

from __future__ import annotations

from rljob_api import GROUP
from rljob_api.layout import COLOCATED, HEAD, ROLLOUT, TRAINER
from rljob_api.status import OPERATOR_MANAGER

LABEL_JOB = f"{GROUP}/job"
LABEL_COMPONENT = f"{GROUP}/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
ANNOTATION_RESTARTS = f"{GROUP}/restarts"
ANNOTATION_COMPUTE_PODS = f"{GROUP}/compute-pods"
# What a child was built from (builders.revisions): a RayCluster, pod template or driver
# whose revision differs from what the current spec builds is patched or replaced.
ANNOTATION_REVISION = f"{GROUP}/revision"

COMPUTE_COMPONENTS = (HEAD, TRAINER, ROLLOUT, COLOCATED)

RAY_API_VERSION = "ray.io/v1"
RAY_GROUP = "ray.io"
RAY_VERSION = "v1"
RAY_PLURAL = "rayclusters"
WEIGHT_SYNC = "weight-sync"
SPEC_FILE = "rljob.yaml"
SPEC_DIR = "/etc/rljob"
# The key of the Ray token in the job's Secret (the name KubeRay's own token Secrets use).
RAY_TOKEN_KEY = "auth_token"


def raycluster_name(job: str) -> str:
    return job


def head_service(job: str, namespace: str) -> str:
    """The DNS name KubeRay gives the head Service of the job's RayCluster."""
    return f"{raycluster_name(job)}-head-svc.{namespace}.svc"


def driver_name(job: str) -> str:
    return f"{job}-driver"


def configmap_name(job: str) -> str:
    return f"{job}-spec"


def service_account_name(job: str) -> str:
    return f"{job}-runtime"


def role_name(job: str) -> str:
    return f"{job}-status-writer"


def ray_token_secret(job: str, uid: str) -> str:
    """The Secret holding the job's Ray authentication token.

    Its name carries the RLJob's UID: the operator may create Secrets but never read one, so
    it cannot check who owns a Secret that is in the way; with the UID in the name, one that
    exists already is this job's own (a leftover of an earlier job of the same name has
    another name, and cannot hand this job a token someone else knows)."""
    return f"{job}-ray-token-{uid[:8]}"


def network_policy(job: str) -> str:
    """The NetworkPolicy letting only the job's own pods reach its pods."""
    return f"{job}-peers-only"


def checkpoint_claim(job: str) -> str:
    """The PersistentVolumeClaim the operator creates when `spec.checkpoint.pvc` is unset."""
    return f"{job}-checkpoints"


def labels(job: str, component: str) -> dict[str, str]:
    """Labels every child carries: `kubectl get pods -l rljob.io/job=NAME` finds them all."""
    return {LABEL_JOB: job, LABEL_COMPONENT: component, LABEL_MANAGED_BY: OPERATOR_MANAGER}


def per_engine(base: str, index: int, engines: int) -> str:
    """Name of engine `index`'s container or port: `base` in a one-engine pod (a rollout
    pod), `base-<index>` when the pod holds several (colocated); unique within the pod."""
    return base if engines == 1 else f"{base}-{index}"
