"""`spec.trainer.backend` → trainer-actor class, and the clear errors where it cannot run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rljob.trainer.select import trainer_class
from rljob.trainer.torch.actor import TorchTrainer
from rljob_api.spec import RLJobSpec
from rljob_api.validate import load_job

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and (
    importlib.util.find_spec("megatron.core") is not None
)


def _megatron_spec(**trainer: object) -> RLJobSpec:
    _, spec = load_job(str(EXAMPLES / "tiny-megatron-gpu.yaml"))
    return spec.model_copy(update={"trainer": spec.trainer.model_copy(update=trainer)})


def test_torch_backend_is_the_torch_trainer() -> None:
    _, spec = load_job(str(EXAMPLES / "tiny-cpu.yaml"))
    assert trainer_class(spec, use_gpu=False) is TorchTrainer


def test_megatron_without_gpus_names_the_field_and_the_way_out() -> None:
    with pytest.raises(ValueError, match=r"spec\.trainer\.backend megatron needs a GPU.*torch"):
        trainer_class(_megatron_spec(), use_gpu=False)


@pytest.mark.skipif(HAS_MEGATRON, reason="megatron-core is installed here")
def test_megatron_without_megatron_core_says_how_to_install_it() -> None:
    with pytest.raises(ValueError, match=r"needs megatron-core .*\.\[megatron\]"):
        trainer_class(_megatron_spec(), use_gpu=True)


@pytest.mark.skipif(not HAS_MEGATRON, reason="needs megatron-core (pip install .[megatron])")
def test_megatron_rejects_model_parallel_layouts_it_cannot_publish() -> None:
    spec = _megatron_spec(parallelism={"tensor": 2, "pipeline": 1, "context": 1})
    spec = RLJobSpec.model_validate(spec.model_dump(by_alias=True))
    with pytest.raises(ValueError, match=r"spec\.trainer\.parallelism: .*tensor 2"):
        trainer_class(spec, use_gpu=True)
