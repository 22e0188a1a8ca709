"""The operator's API calls: thin, idempotent wrappers over the kubernetes client.

Every create treats 409 AlreadyExists as done and every delete treats 404 NotFound as done,
so a reconcile that is interrupted and repeated never fails on its own earlier work (the
kopf trap of a handler that deletes and then hits 404 on every retry). Every call carries a
timeout so a stalled connection cannot hang a reconcile.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from rljob_api import API_VERSION, GROUP, KIND, PLURAL, VERSION
from rljob_operator import names
from rljob_operator.status import Event

Obj = dict[str, Any]
TIMEOUT = (5.0, 30.0)  # connect, read


def load_configuration(kubeconfig: str | None) -> client.Configuration:
    """In-cluster service account when no kubeconfig is given and one exists."""
    cfg = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return cfg


def _json(resp: Any) -> Obj:
    return dict(json.loads(resp.data))


class Kube:
    """The calls one reconcile makes; raw camelCase dicts in and out."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.instance = socket.gethostname()

    # -- reads -----------------------------------------------------------------------------

    def get_rljob(self, namespace: str, name: str) -> Obj | None:
        try:
            return _json(self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name,
                _preload_content=False, _request_timeout=TIMEOUT))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def get_raycluster(self, namespace: str, name: str) -> Obj | None:
        try:
            return _json(self.custom.get_namespaced_custom_object(
                names.RAY_GROUP, names.RAY_VERSION, namespace, names.RAY_PLURAL, name,
                _preload_content=False, _request_timeout=TIMEOUT))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def list_pods(self, namespace: str, job: str) -> list[Obj]:
        resp = self.core.list_namespaced_pod(
            namespace, label_selector=f"{names.LABEL_JOB}={job}",
            _preload_content=False, _request_timeout=TIMEOUT)
        return list(_json(resp).get("items") or [])

    def list_nodes(self) -> list[Obj]:
        # resourceVersion "0" is served from the API server's watch cache: cheap.
        resp = self.core.list_node(resource_version="0", _preload_content=False,
                                   _request_timeout=TIMEOUT)
        return list(_json(resp).get("items") or [])

    # -- writes ----------------------------------------------------------------------------

    def create(self, obj: Obj) -> bool:
        """Create `obj`; False when it already exists."""
        ns = obj["metadata"].get("namespace", "")
        kind = obj["kind"]
        body: Any = obj  # the client accepts plain dicts as well as its models
        kw: dict[str, Any] = {"_request_timeout": TIMEOUT}
        try:
            if kind == "Pod":
                self.core.create_namespaced_pod(ns, body, **kw)
            elif kind == "ConfigMap":
                self.core.create_namespaced_config_map(ns, body, **kw)
            elif kind == "Secret":
                self.core.create_namespaced_secret(ns, body, **kw)
            elif kind == "PersistentVolumeClaim":
                self.core.create_namespaced_persistent_volume_claim(ns, body, **kw)
            elif kind == "ServiceAccount":
                self.core.create_namespaced_service_account(ns, body, **kw)
            elif kind == "Role":
                self.rbac.create_namespaced_role(ns, body, **kw)
            elif kind == "RoleBinding":
                self.rbac.create_namespaced_role_binding(ns, body, **kw)
            elif kind == "RayCluster":
                self.custom.create_namespaced_custom_object(
                    names.RAY_GROUP, names.RAY_VERSION, ns, names.RAY_PLURAL, body, **kw)
            else:
                raise ValueError(f"the operator does not create {kind} objects")
        except ApiException as err:
            if err.status == 409:
                return False
            raise
        return True

    def sync_configmap(self, obj: Obj) -> None:
        """Create the ConfigMap, or bring its data up to date with the spec."""
        if self.create(obj):
            return
        meta = obj["metadata"]
        self.core.patch_namespaced_config_map(
            meta["name"], meta["namespace"], {"data": obj["data"]}, _request_timeout=TIMEOUT)

    def delete_pod(self, namespace: str, name: str, force: bool = False) -> None:
        try:
            self.core.delete_namespaced_pod(
                name, namespace, grace_period_seconds=0 if force else None,
                _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status != 404:
                raise

    def delete_raycluster(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(
                names.RAY_GROUP, names.RAY_VERSION, namespace, names.RAY_PLURAL, name,
                propagation_policy="Background", _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status != 404:
                raise

    def apply_status(self, namespace: str, name: str, status: Obj) -> None:
        """Server-side apply of the operator's status fields under its own field manager;
        fields owned by the runtime's manager are untouched."""
        body = {"apiVersion": API_VERSION, "kind": KIND,
                "metadata": {"name": name, "namespace": namespace}, "status": status}
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, body,
            field_manager=names.FIELD_MANAGER, force=True,
            _content_type="application/apply-patch+yaml", _request_timeout=TIMEOUT)

    def post_event(self, job: Obj, event: Event) -> None:
        meta = job["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body: Any = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}",
                         "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "type": event.type,
            "reason": event.reason,
            "message": event.message[:1024],
            "source": {"component": names.FIELD_MANAGER},
            "reportingComponent": names.FIELD_MANAGER,
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.core.create_namespaced_event(meta["namespace"], body, _request_timeout=TIMEOUT)
