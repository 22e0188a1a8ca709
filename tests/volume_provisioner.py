"""A dynamic volume provisioner for the test control plane: `python -m tests.volume_provisioner`.

Every RLJob without `spec.checkpoint.pvc` gets a ReadWriteMany PersistentVolumeClaim from the
operator, and pods that mount an unbound claim are never scheduled. Real clusters provision
such claims through a StorageClass (NFS, Filestore, EFS, CephFS…); here a default
StorageClass names this provisioner, which does what an external provisioner does: for each
claim of that class it creates a PersistentVolume pre-bound to the claim (the
persistentvolume-binder controller then completes the binding, the scheduler places the pods,
kwok runs them without mounting anything), and deletes the volume when the claim goes.
The volume's NFS source points nowhere: nothing ever mounts it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

STORAGE_CLASS = "rljob-test-shared"
PROVISIONER = "rljob.io/test-provisioner"
log = logging.getLogger("volume-provisioner")


def storage_class() -> dict[str, Any]:
    """The cluster's default class: what an operator-made claim without a class gets."""
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": STORAGE_CLASS,
            "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
        },
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }


def volume_for(claim: dict[str, Any]) -> dict[str, Any]:
    meta, spec = claim["metadata"], claim["spec"]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"pvc-{meta['uid']}",
                     "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER}},
        "spec": {
            "capacity": {"storage": spec["resources"]["requests"]["storage"]},
            "accessModes": spec["accessModes"],
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": STORAGE_CLASS,
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "namespace": meta["namespace"], "name": meta["name"],
                         "uid": meta["uid"]},
            "nfs": {"server": "nfs.invalid", "path": f"/{meta['namespace']}/{meta['name']}"},
        },
    }


def serve(api: client.ApiClient) -> None:
    """Provision and delete volumes for claims of STORAGE_CLASS, forever."""
    core = client.CoreV1Api(api)
    while True:
        try:
            provision(api, core)
        except Exception as err:  # a broken watch (slow or restarted API server): list again
            log.warning("watch ended (%s: %s); listing the claims again", type(err).__name__, err)
            time.sleep(1.0)  # pace a retry while the API server does not answer


def provision(api: client.ApiClient, core: client.CoreV1Api) -> None:
    """One watch of the claims (it starts with every claim that exists, ends after 60 s)."""
    stream = watch.Watch().stream(core.list_persistent_volume_claim_for_all_namespaces,
                                  timeout_seconds=60, _request_timeout=90,
                                  _preload_content=True)
    for event in stream:
        claim = api.sanitize_for_serialization(event["object"])
        if claim["spec"].get("storageClassName") != STORAGE_CLASS:
            continue
        name = f"pvc-{claim['metadata']['uid']}"
        try:
            if event["type"] == "DELETED":
                core.delete_persistent_volume(name)
            elif not claim["spec"].get("volumeName"):
                volume: Any = volume_for(claim)  # the client takes plain dicts too
                core.create_persistent_volume(volume)
                log.info("provisioned %s for %s/%s", name, claim["metadata"]["namespace"],
                         claim["metadata"]["name"])
        except ApiException as err:
            if err.status not in (404, 409):
                log.warning("%s: %s", name, err.reason)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="volume-provisioner", description=__doc__)
    p.add_argument("--kubeconfig", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    api = config.new_client_from_config(config_file=args.kubeconfig)
    # Its own user agent: the benchmarks count the operator's requests by the kubernetes
    # client's default one, which this process would otherwise share.
    api.user_agent = "rljob-volume-provisioner"
    try:
        body: Any = storage_class()
        client.StorageV1Api(api).create_storage_class(body)
    except ApiException as err:
        if err.status != 409:
            raise
    print("provisioning", flush=True)
    serve(api)
    return 0


if __name__ == "__main__":
    sys.exit(main())
