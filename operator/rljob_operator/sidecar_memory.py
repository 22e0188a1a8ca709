"""The memory an engine container is given for its weight-sync sidecars.

The sidecar runs in the container that holds its engine's GPU (docs/gpu-pods.md), so that
container is given the sidecar's memory on top of the user's `resources`.
"""

from __future__ import annotations

from typing import Any

from rljob_api.spec import RLJobSpec
from rljob_operator.quantity import MIB, mebibytes, memory_bytes

# What one engine's sidecar adds besides one bucket (`spec.weightSync.bucketSizeMb`, which it
# copies to the host to hash): a Python process with torch and a Ray worker. An estimate.
SIDECAR_PROCESS_MIB = 768


def sidecar_memory_mib(spec: RLJobSpec) -> int:
    """Memory one engine's weight-sync sidecar takes in its engine's container. A sidecar
    staging on the CPU (engines on CPU, or a CPU trainer's gloo group) also holds one whole
    weight version in /dev/shm, which the pod's shared-memory volume bounds."""
    return SIDECAR_PROCESS_MIB + spec.weight_sync.bucket_size_mb


def add_memory(resources: dict[str, Any], mib: int) -> None:
    """Add `mib` to the container's memory request, and to its limit where it has one (no
    limit stays no limit). A request left out defaults to the limit, as Kubernetes would
    make it. A quantity that is not memory is left for the API server to refuse, naming
    it."""
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    wanted = {"requests": requests.get("memory", limits.get("memory")),
              "limits": limits.get("memory")}
    for kind, have in wanted.items():
        if have is None and kind == "limits":
            continue
        try:
            total = (memory_bytes(have) if have is not None else 0) + mib * MIB
        except ValueError:
            continue
        resources.setdefault(kind, {})["memory"] = mebibytes(total)
