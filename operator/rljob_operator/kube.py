"""The operator's API calls: thin, idempotent wrappers over the kubernetes client.

A create that meets 409 AlreadyExists adopts the existing object only when it is this
RLJob's (an owner reference with the job's UID): a reconcile that is interrupted and repeated
never fails on its own earlier work, and an object someone else made (or an earlier job of
the same name left behind) is never taken over, it is reported (`ObjectInTheWay`). Every
delete treats 404 NotFound as done (the kopf trap of a handler that deletes and then hits
404 on every retry). Every call carries a timeout so a stalled connection cannot hang a
reconcile.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from rljob_api import API_VERSION, GROUP, KIND, PLURAL, VERSION
from rljob_api.status import OPERATOR_MANAGER, apply_status, timestamp
from rljob_operator import names
from rljob_operator.decision import Event
from rljob_operator.observe import InTheWay, owned_by, owner_words
from rljob_operator.status import merge_patch_to, needs_write, operator_fields

Obj = dict[str, Any]
TIMEOUT = (5.0, 30.0)  # connect, read
MAX_KNOWN_OWNED = 20000  # ownership checks remembered (about 8 children per job)
CONNECTIONS = 32


def load_configuration(kubeconfig: str | None) -> client.Configuration:
    """In-cluster service account when no kubeconfig is given and one exists."""
    cfg = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    # Reconcile workers and each one's concurrent support creates share one client: a pool
    # smaller than that would open and drop a connection per request.
    cfg.connection_pool_maxsize = CONNECTIONS
    return cfg


def _json(resp: Any) -> Obj:
    """The body of a response read with `_preload_content=False` (parsed once, not into
    the client's models); the connection goes back to the pool."""
    try:
        return dict(json.loads(resp.data))
    finally:
        resp.release_conn()


def terminating_namespace(err: ApiException) -> bool:
    """A create refused because its namespace is being deleted (the NamespaceLifecycle
    admission plugin's 403 with cause NamespaceTerminating)."""
    return err.status == 403 and "NamespaceTerminating" in str(err.body or "")


class NamespaceTerminating(Exception):
    """A create met a namespace being deleted: the job goes with it, and the reconcile
    stops without an error."""


class ObjectInTheWay(Exception):
    """A create met an object of the same name that belongs to someone else."""

    def __init__(self, found: InTheWay) -> None:
        super().__init__(f"{found.kind}/{found.name}: {found.owner}")
        self.found = found


class WriteCache(Protocol):
    """What keeps a copy of the objects the operator writes (the watch cache,
    `cache.Store`): told what each write's response shows, it holds the operator's own
    writes before their watch events arrive."""

    def put(self, kind: str, obj: Obj) -> object:
        """An object as a write's response shows it."""

    def remove(self, kind: str, obj: Obj) -> None:
        """An object a delete removed at once, in its last state."""

    def vanished(self, kind: str, namespace: str, name: str) -> None:
        """An object a delete removed when the response does not show it."""


class Kube:
    """The calls one reconcile makes; raw camelCase dicts in and out. `cache` is told of
    every Pod, RayCluster and RLJob the calls write or delete."""

    def __init__(self, api_client: client.ApiClient, cache: WriteCache) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.instance = socket.gethostname()
        self.cache = cache
        # (namespace, kind, name, owner uid) seen owned by that RLJob: a later 409 on the same
        # create needs no read to know it is ours.
        self._owned: set[tuple[str, str, str, str]] = set()

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

    def list_rayclusters(self, namespace: str, job: str) -> tuple[list[Obj], str | None]:
        """The job's RayClusters (by its label) and the list's resource version: the cache
        keeps what was made after the list, which a GET could not tell."""
        resp = _json(self.custom.list_namespaced_custom_object(
            names.RAY_GROUP, names.RAY_VERSION, namespace, names.RAY_PLURAL,
            label_selector=f"{names.LABEL_JOB}={job}",
            _preload_content=False, _request_timeout=TIMEOUT))
        return list(resp.get("items") or []), (resp.get("metadata") or {}).get(
            "resourceVersion")

    def list_pods(self, namespace: str, job: str) -> tuple[list[Obj], str | None]:
        """The job's pods and the list's resource version."""
        resp = _json(self.core.list_namespaced_pod(
            namespace, label_selector=f"{names.LABEL_JOB}={job}",
            _preload_content=False, _request_timeout=TIMEOUT))
        return list(resp.get("items") or []), (resp.get("metadata") or {}).get(
            "resourceVersion")

    def claim_access_modes(self, namespace: str, name: str) -> tuple[str, ...] | None:
        """The access modes a PersistentVolumeClaim asks for; None when it does not exist."""
        try:
            resp = self.core.read_namespaced_persistent_volume_claim(
                name, namespace, _preload_content=False, _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return tuple((_json(resp).get("spec") or {}).get("accessModes") or ())

    def list_nodes(self, consistent: bool = False) -> list[Obj]:
        """Every node. resourceVersion "0" is served from the API server's watch cache
        (cheap, maybe a moment behind); `consistent` reads etcd, for when a node's absence
        decides something."""
        kw: dict[str, Any] = {} if consistent else {"resource_version": "0"}
        resp = self.core.list_node(_preload_content=False, _request_timeout=TIMEOUT, **kw)
        return list(_json(resp).get("items") or [])

    # -- writes ----------------------------------------------------------------------------

    def read_meta(self, kind: str, namespace: str, name: str) -> Obj | None:
        """The metadata of one object of a kind the operator creates; None when absent."""
        kw: dict[str, Any] = {"_preload_content": False, "_request_timeout": TIMEOUT}
        readers: dict[str, Any] = {
            "Pod": self.core.read_namespaced_pod,
            "ConfigMap": self.core.read_namespaced_config_map,
            "PersistentVolumeClaim": self.core.read_namespaced_persistent_volume_claim,
            "ServiceAccount": self.core.read_namespaced_service_account,
            "Role": self.rbac.read_namespaced_role,
            "RoleBinding": self.rbac.read_namespaced_role_binding,
            "NetworkPolicy": self.networking.read_namespaced_network_policy,
        }
        try:
            if kind == "RayCluster":
                resp = self.custom.get_namespaced_custom_object(
                    names.RAY_GROUP, names.RAY_VERSION, namespace, names.RAY_PLURAL, name, **kw)
            else:
                resp = readers[kind](name, namespace, **kw)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return dict(_json(resp).get("metadata") or {})

    def in_the_way(self, kind: str, namespace: str, name: str, uid: str) -> InTheWay | None:
        """The object `kind/name` if it exists and is not owned by the RLJob with `uid`."""
        meta = self.read_meta(kind, namespace, name)
        if meta is None or owned_by(meta, uid):
            return None
        return InTheWay(kind, name, owner_words(meta))

    def create(self, obj: Obj, owner_uid: str) -> bool:
        """Create `obj` for the RLJob with `owner_uid`; False when it exists already and is
        that RLJob's. Raises ObjectInTheWay when an object of that name belongs to someone
        else. Secrets are never read: the job's Secret has the job's UID in its name, so one
        that exists is the job's (names.ray_token_secret)."""
        ns = obj["metadata"].get("namespace", "")
        kind = obj["kind"]
        body: Any = obj  # the client accepts plain dicts as well as its models
        kw: dict[str, Any] = {"_request_timeout": TIMEOUT, "_preload_content": False}
        creators: dict[str, Callable[..., Any]] = {
            "Pod": self.core.create_namespaced_pod,
            "ConfigMap": self.core.create_namespaced_config_map,
            "Secret": self.core.create_namespaced_secret,
            "PersistentVolumeClaim": self.core.create_namespaced_persistent_volume_claim,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
            "NetworkPolicy": self.networking.create_namespaced_network_policy,
        }
        try:
            if kind == "RayCluster":
                resp = self.custom.create_namespaced_custom_object(
                    names.RAY_GROUP, names.RAY_VERSION, ns, names.RAY_PLURAL, body, **kw)
            elif kind in creators:
                resp = creators[kind](ns, body, **kw)
            else:
                raise ValueError(f"the operator does not create {kind} objects")
            made = _json(resp)
            if kind in ("Pod", "RayCluster"):
                self.cache.put(kind, made)
        except ApiException as err:
            if terminating_namespace(err):
                raise NamespaceTerminating(ns) from err
            if err.status != 409:
                raise
            self._adopt(kind, ns, obj["metadata"]["name"], owner_uid)
            return False
        return True

    def _adopt(self, kind: str, namespace: str, name: str, uid: str) -> None:
        """After a 409: return if the existing object is the RLJob's, raise otherwise."""
        key = (namespace, kind, name, uid)
        if kind == "Secret" or key in self._owned:
            return
        found = self.in_the_way(kind, namespace, name, uid)
        if found is not None:
            raise ObjectInTheWay(found)
        if len(self._owned) >= MAX_KNOWN_OWNED:
            self._owned.clear()
        self._owned.add(key)

    def sync_configmap(self, obj: Obj, owner_uid: str) -> bool:
        """Create the ConfigMap, or bring the data of the job's own one up to date; True when
        it was created."""
        if self.create(obj, owner_uid):
            return True
        meta = obj["metadata"]
        self.core.patch_namespaced_config_map(
            meta["name"], meta["namespace"], {"data": obj["data"]}, _request_timeout=TIMEOUT)
        return False

    def delete_pod(self, namespace: str, name: str, force: bool = False,
                   grace_s: int | None = None) -> None:
        """Delete a pod: at once (`force`), with `grace_s` seconds to stop, or with the grace
        its spec sets."""
        try:
            self._deleted("Pod", namespace, name, self.core.delete_namespaced_pod(
                name, namespace, grace_period_seconds=0 if force else grace_s,
                _preload_content=False, _request_timeout=TIMEOUT))
        except ApiException as err:
            if err.status != 404:
                raise

    def _deleted(self, kind: str, namespace: str, name: str, resp: Any) -> None:
        """What a delete's response says of the object: terminating (still there, with a
        deletion time) or gone; the watch cache learns it before the watch event comes, so
        the next reconcile does not act on the object as if it were still live (its own
        watch stream may lag the others: a RayCluster still cached after its deletion would
        let a driver start on the pods it is about to lose). A bare Status says only that it
        is gone."""
        obj = _json(resp)
        if obj.get("kind") == "Status" or "metadata" not in obj:
            self.cache.vanished(kind, namespace, name)
            return
        if obj["metadata"].get("deletionTimestamp"):
            self.cache.put(kind, obj)
        else:
            self.cache.remove(kind, obj)

    def patch_raycluster(self, obj: Obj) -> None:
        """Bring the RayCluster's groups to `obj`'s (built from the current spec), then its
        revision annotation: replaced wholesale (a JSON patch), so a field the new spec drops
        goes too; `spec.suspend` and anything else in the RayCluster are left alone."""
        meta = obj["metadata"]
        ops: Any = [{"op": "replace", "path": f"/spec/{key}", "value": obj["spec"][key]}
                    for key in ("headGroupSpec", "workerGroupSpecs")]
        args = (names.RAY_GROUP, names.RAY_VERSION, meta["namespace"], names.RAY_PLURAL,
                meta["name"])
        self.custom.patch_namespaced_custom_object(
            *args, ops, _content_type="application/json-patch+json", _request_timeout=TIMEOUT)
        revision: Any = {"metadata": {"annotations": {
            names.ANNOTATION_REVISION: meta["annotations"][names.ANNOTATION_REVISION]}}}
        self.cache.put("RayCluster", _json(self.custom.patch_namespaced_custom_object(
            *args, revision, _content_type="application/merge-patch+json",
            _preload_content=False, _request_timeout=TIMEOUT)))

    def relabel(self, kind: str, namespace: str, name: str, labels: dict[str, str]) -> None:
        """Put back labels of a child of the job (a merge patch of exactly these, so no
        other label or field is touched); the watch cache learns the result. A child gone
        meanwhile needs none."""
        patch: Any = {"metadata": {"labels": labels}}
        kw: dict[str, Any] = {"_preload_content": False, "_request_timeout": TIMEOUT}
        try:
            if kind == "RayCluster":
                resp = self.custom.patch_namespaced_custom_object(
                    names.RAY_GROUP, names.RAY_VERSION, namespace, names.RAY_PLURAL, name,
                    patch, _content_type="application/merge-patch+json", **kw)
            elif kind == "Pod":
                resp = self.core.patch_namespaced_pod(name, namespace, patch, **kw)
            else:
                raise ValueError(f"the operator does not relabel {kind} objects")
        except ApiException as err:
            if err.status != 404:
                raise
            return
        self.cache.put(kind, _json(resp))

    def get_child(self, kind: str, namespace: str, name: str) -> Obj | None:
        """One Pod or RayCluster by name (a fresh read's look for a child of the job that
        its label list missed); None when absent."""
        kw: dict[str, Any] = {"_preload_content": False, "_request_timeout": TIMEOUT}
        try:
            if kind == "RayCluster":
                return _json(self.custom.get_namespaced_custom_object(
                    names.RAY_GROUP, names.RAY_VERSION, namespace, names.RAY_PLURAL, name,
                    **kw))
            return _json(self.core.read_namespaced_pod(name, namespace, **kw))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def delete_raycluster(self, namespace: str, name: str) -> None:
        try:
            resp = self.custom.delete_namespaced_custom_object(
                names.RAY_GROUP, names.RAY_VERSION, namespace, names.RAY_PLURAL, name,
                propagation_policy="Background", _preload_content=False,
                _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status != 404:
                raise
            return
        self._deleted("RayCluster", namespace, name, resp)

    def apply_status(self, namespace: str, name: str, status: Obj) -> Obj:
        """Server-side apply of the operator's status fields under its own field manager;
        fields owned by the runtime's manager are untouched.

        An apply only sets and removes fields its manager owns: operator fields someone else
        wrote (a hand edit through the status subresource: a condition type of their own, a
        recovery.action the operator has no value for) would stay, the status would never
        match the decision, and every reconcile would write it again. So when the applied
        result still differs in the operator's fields, a merge patch makes them exactly the
        decision's (the runtime's fields are not in it). Returns what the operator's fields
        were replaced with by that patch, if one was needed (for the log)."""
        made = _json(apply_status(self.custom, namespace, name, status, OPERATOR_MANAGER,
                                  TIMEOUT, _preload_content=False))
        stored = operator_fields(made.get("status") or {})
        fix: Obj = {}
        if needs_write(stored, status):
            fix = merge_patch_to(stored, status)
            made = _json(self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": fix},
                field_manager=OPERATOR_MANAGER, _preload_content=False,
                _content_type="application/merge-patch+json", _request_timeout=TIMEOUT))
        self.cache.put(KIND, made)
        return fix

    def hold_step(self, namespace: str, name: str, step: int, resource_version: str) -> None:
        """Write status.progress.rolloutStep (`held_step`) unless the RLJob changed since it
        was read at `resource_version` (a runtime may have reported meanwhile; the next
        reconcile decides again). A merge patch, not an apply: the operator
        keeps no ownership of the field that a later apply of its own would remove, and the
        runtime's next apply (with force) takes the field back."""
        body = {"metadata": {"resourceVersion": resource_version},
                "status": {"progress": {"rolloutStep": step}}}
        try:
            made = _json(self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, body,
                field_manager=OPERATOR_MANAGER, _preload_content=False,
                _content_type="application/merge-patch+json", _request_timeout=TIMEOUT))
        except ApiException as err:
            if err.status == 409:
                return
            raise
        self.cache.put(KIND, made)

    def post_event(self, job: Obj, event: Event) -> None:
        meta = job["metadata"]
        now = timestamp()
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
            "source": {"component": OPERATOR_MANAGER},
            "reportingComponent": OPERATOR_MANAGER,
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body,
                                              _request_timeout=TIMEOUT)
        except ApiException as err:
            if terminating_namespace(err):
                raise NamespaceTerminating(meta["namespace"]) from err
            raise
