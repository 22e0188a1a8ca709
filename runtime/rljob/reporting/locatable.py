"""Where the calling actor runs: every actor class the driver creates can say it, from inside
its own process, so the driver checks placement against Ray's facts (`rljob.cluster.whereabouts`).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Whereabouts:
    node_id: str  # Ray's node
    host: str  # in Kubernetes: the pod's name


def here() -> Whereabouts:
    """The Ray node and host of the calling process."""
    # Imported here: the trainer and engine classes inherit `Locatable` and also run where
    # Ray is not installed (the GPU measurements in benchmarks/).
    import ray

    return Whereabouts(str(ray.get_runtime_context().get_node_id()), socket.gethostname())


class Locatable:
    """Mixed into every actor class the driver creates, so each can say where it runs."""

    def whereabouts(self) -> Whereabouts:
        return here()
