"""Which trainer-actor class runs `spec.trainer.backend`.

Both classes implement `rljob.trainer.interface.TrainerActor`, so the driver places and
drives either one the same way. This module sits above both backends (they never import
each other). The megatron one is imported only when asked for: megatron-core is an optional
dependency (`.[megatron]`) that only GPU images carry. Neither is imported before it is
asked for: the driver imports this module before Ray starts, and a backend's imports (torch;
megatron-core for megatron) take seconds that `import_backend` spends while Ray starts instead.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from rljob_api.spec import RLJobSpec

if TYPE_CHECKING:
    from rljob.trainer.interface import TrainerActor


def import_backend(spec: RLJobSpec) -> None:
    """Import the module of `spec.trainer.backend`'s actor class now (torch; megatron-core
    for megatron); a missing megatron-core is left for `trainer_class` to report."""
    with contextlib.suppress(ValueError):
        trainer_class(spec, use_gpu=True)


def trainer_class(spec: RLJobSpec, use_gpu: bool) -> type[TrainerActor]:
    """The actor class for `spec.trainer.backend`; ValueError (naming the field) if it cannot
    run here."""
    if spec.trainer.backend != "megatron":
        from rljob.trainer.torch.actor import TorchTrainer

        return TorchTrainer
    if not use_gpu:
        raise ValueError(
            "spec.trainer.backend megatron needs a GPU for every trainer rank and this Ray "
            "cluster has too few; run on a GPU machine or use spec.trainer.backend: torch"
        )
    try:
        from rljob.trainer.megatron.actor import MegatronTrainerActor, check_supported
    except ImportError as err:
        raise ValueError(
            f"spec.trainer.backend megatron needs megatron-core ({err}); install it with "
            "`pip install '.[megatron]'` or use spec.trainer.backend: torch"
        ) from None
    check_supported(spec)
    return MegatronTrainerActor
