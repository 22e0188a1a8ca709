"""The slots of a multi-GPU engine beyond its first, each held by a `SlotHolder` actor.

Ray gives an actor resources from one placement-group bundle only, while an SGLang engine of
tensor-parallel size N runs one rank on each of N GPUs. The engine actor sits on its first
slot; a SlotHolder on each further slot holds that slot's share for as long as the engine
lives (so Ray never counts it as free) and says which node and GPU Ray gave it. The engine
hands SGLang all of them as CUDA_VISIBLE_DEVICES (`engine_gpus`).
"""

from __future__ import annotations

import ray

# (Ray node id, GPU ids Ray assigned) of one slot; the ids are empty on CPU slots.
SlotDevices = tuple[str, list[str]]


class SlotDeviceError(RuntimeError):
    """The slots of one engine are not on one node, or hold the wrong number of GPUs."""


def here() -> SlotDevices:
    """The node and the GPUs Ray assigned to the calling actor."""
    return str(ray.get_runtime_context().get_node_id()), [str(g) for g in ray.get_gpu_ids()]


class SlotHolder:
    """Holds one further slot of an engine; its only call says where that slot is."""

    def where(self) -> SlotDevices:
        return here()


def engine_gpus(first: SlotDevices, further: list[SlotDevices]) -> list[str]:
    """The GPU ids of all of an engine's slots, first slot first.

    An engine cannot span nodes (its ranks talk over local NCCL and share one server), which
    the operator's pod layout and Ray's PACK strategy normally guarantee; this says so when
    they did not, rather than starting SGLang on GPUs it cannot see.
    """
    node, gpus = first
    for other_node, ids in further:
        if other_node != node:
            raise SlotDeviceError(
                f"an engine's slots landed on Ray nodes {node} and {other_node}; an engine "
                "needs all spec.rollout.gpusPerEngine GPUs on one node: retry the job")
        gpus = gpus + ids
    return gpus
