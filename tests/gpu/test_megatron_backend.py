"""The megatron backend on a real GPU: weight round trip, equivalence with the torch path, resume.

Skips (with the reason) where there is no CUDA GPU or no megatron-core; run on a GPU machine
with `pip install .[megatron]` as docs/megatron.md shows.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rljob.algo.losses import LossKind
    from rljob.trainer.megatron.training import MegatronTrainer, PolicyMicroBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None,
        reason="needs megatron-core (pip install .[megatron])",
    ),
]

SMALL: dict[str, Any] = {
    "vocab_size": 1000,  # not a multiple of 128: exercises vocab padding
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.fixture(scope="module", autouse=True)
def parallel() -> None:
    from rljob.trainer.megatron.training import init_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    init_parallel(1, 1, 1, seed=0)


def _hf_model(kind: str, tied: bool) -> PreTrainedModel:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    if kind == "qwen2":
        model: PreTrainedModel = Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=tied))
        with torch.no_grad():  # HF initialises biases to zero; make them matter
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.02)
    else:
        model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=tied))
    torch.nn.Module.to(model, device="cuda", dtype=torch.float32)
    return model


def _hf_state(model: PreTrainedModel, tied: bool) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    return state


def _trainer(
    model: PreTrainedModel, tied: bool, dtype: torch.dtype = torch.float32, kind: LossKind = "ppo"
) -> MegatronTrainer:
    from rljob.trainer.megatron.shape import ModelShape
    from rljob.trainer.megatron.training import MegatronTrainer, PolicyLossConfig

    return MegatronTrainer(
        ModelShape.from_hf(model.config),
        _hf_state(model, tied),
        dtype=dtype,
        lr=1e-3,
        weight_decay=0.0,
        max_grad_norm=1e9,
        loss=PolicyLossConfig(kind=kind, clip_low=0.2, clip_high=0.28, kl_coef=0.05,
                              entropy_coef=0.01),
    )


def _batches(seed: int, n: int = 2, batch: int = 3, tis: bool = False) -> list[PolicyMicroBatch]:
    from rljob.trainer.megatron.training import PolicyMicroBatch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompts = torch.randint(3, 9, (batch,), generator=g).tolist()
        responses = torch.randint(5, 20, (batch,), generator=g).tolist()
        seq = max(p + r for p, r in zip(prompts, responses, strict=True))
        r_max = max(responses)
        tokens = torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=g)
        mask = torch.zeros(batch, r_max)
        for i, r in enumerate(responses):
            mask[i, :r] = 1.0
        old = -4.0 - torch.rand(batch, r_max, generator=g) * 5
        out.append(
            PolicyMicroBatch(
                tokens=tokens,
                prompt_lengths=prompts,
                response_lengths=responses,
                loss_mask=mask,
                old_logp=old,
                advantages=torch.randn(batch, r_max, generator=g),
                ref_logp=old - 0.1 * torch.rand(batch, r_max, generator=g),
                is_weight=(torch.rand(batch, r_max, generator=g) * 2).clamp(max=1.5)
                if tis else None,
            )
        )
    return out


def _torch_path(model: PreTrainedModel, batches: list[PolicyMicroBatch], kind: LossKind = "ppo"
                ) -> tuple[float, float]:
    """The torch backend's computation: HF model, chunked log-probs, the shared policy loss."""
    from rljob.algo.losses import policy_loss
    from rljob.kernels.logprobs import chunked_logprobs, pad_responses, response_index

    model.zero_grad()
    total_tokens = sum(float(b.loss_mask.sum()) for b in batches)
    loss_value = 0.0
    for b in batches:
        tokens = b.tokens.cuda()
        hidden = model.model(input_ids=tokens).last_hidden_state
        rows, cols = response_index(b.prompt_lengths, b.response_lengths)
        rows, cols = rows.cuda(), cols.cuda()
        lp, ent = chunked_logprobs(
            hidden[rows, cols], model.lm_head.weight, tokens[rows, cols + 1], chunk_tokens=16
        )
        rl = b.response_lengths
        terms = policy_loss(
            pad_responses(lp, rl),
            b.old_logp.cuda(),
            None if b.ref_logp is None else b.ref_logp.cuda(),
            b.advantages.cuda(),
            pad_responses(ent, rl),
            b.loss_mask.cuda(),
            denominator=total_tokens,
            clip_low=0.2,
            clip_high=0.28,
            kl_coef=0.05,
            entropy_coef=0.01,
            kind=kind,
            is_weight=None if b.is_weight is None else b.is_weight.cuda(),
        )
        torch.autograd.backward(terms.loss)
        loss_value += float(terms.loss.detach())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm = math.sqrt(sum(float(g.norm()) ** 2 for g in grads))
    return loss_value, grad_norm


@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("qwen2", True)])
def test_hf_megatron_hf_round_trip_is_bit_exact(kind: str, tied: bool) -> None:
    model = _hf_model(kind, tied)
    trainer = _trainer(model, tied)
    exported = dict(trainer.export_hf())
    original = _hf_state(model, tied)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert exported["model.embed_tokens.weight"].shape[0] == SMALL["vocab_size"]


@pytest.mark.parametrize(("kind", "tied", "loss", "tis"), [
    ("llama", False, "ppo", False), ("qwen2", True, "ppo", False),
    ("qwen2", True, "gspo", False), ("llama", False, "cispo", False),
    ("qwen2", True, "ppo", True), ("llama", False, "gspo", True)])
def test_same_loss_and_grad_norm_as_torch_path(kind: str, tied: bool, loss: LossKind, tis: bool
                                               ) -> None:
    """Every policy loss the API offers (grpo and reinforce++ use `ppo`), with and without
    truncated importance weights, gives the torch path's loss and gradient norm."""
    model = _hf_model(kind, tied)
    trainer = _trainer(model, tied, kind=loss)
    batches = _batches(seed=7, tis=tis)
    ref_loss, ref_norm = _torch_path(model, batches, kind=loss)
    metrics = trainer.train_step(batches)
    print(f"{kind} {loss} tis={tis}: loss {metrics.loss:.8f} vs {ref_loss:.8f}; "
          f"grad norm {metrics.grad_norm:.8f} vs {ref_norm:.8f}")
    assert metrics.loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-5)
    assert metrics.grad_norm == pytest.approx(ref_norm, rel=1e-4)


@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("qwen2", True)])
def test_resume_from_distributed_checkpoint_is_exact(kind: str, tied: bool, tmp_path: Path) -> None:
    """Save after two steps inside the atomic checkpoint contract, keep training, then load into
    a fresh trainer and repeat the same steps: same weights, same per-step figures. Two steps
    before the save make Adam's step count (2) differ from a freshly allocated state's (1)."""
    import torch.distributed as dist

    from rljob.checkpoint.store import CheckpointStore

    model = _hf_model(kind, tied)
    first = _trainer(model, tied, dtype=torch.bfloat16)
    for seed in (1, 3):
        first.train_step(_batches(seed=seed))
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2)
    staging = store.begin(2)
    first.save(staging / "megatron")
    dist.barrier()
    if dist.get_rank() == 0:
        store.commit(staging, 2)
    dist.barrier()
    # export_hf yields views of the live parameters: copy before training on.
    saved = {k: v.clone() for k, v in first.export_hf()}
    uninterrupted = [first.train_step(_batches(seed=s)) for s in (2, 4)]
    del first

    latest = store.latest()
    assert latest is not None and latest.step == 2
    resumed = _trainer(model, tied, dtype=torch.bfloat16)  # the untrained weights
    resumed.load(latest.path / "megatron")
    for name, tensor in resumed.export_hf():
        assert torch.equal(tensor, saved[name]), name
    continued = [resumed.train_step(_batches(seed=s)) for s in (2, 4)]
    for step, (want, got) in enumerate(zip(uninterrupted, continued, strict=True)):
        print(f"{kind} step {step + 3}: loss {got.loss!r} vs uninterrupted {want.loss!r}; "
              f"grad norm {got.grad_norm!r} vs {want.grad_norm!r}")
        # Same weights, optimizer state (Adam's step count included) and batch, same kernels:
        # the figures are bit-identical (measured on an H200), not merely close.
        assert got == want, step


def test_old_logprobs_match_training_forward() -> None:
    model = _hf_model("llama", False)
    trainer = _trainer(model, False)
    batches = _batches(seed=3, n=1)
    (logp,) = trainer.logprobs(batches)
    from rljob.kernels.logprobs import naive_logprobs

    b = batches[0]
    tokens = b.tokens.cuda()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    ref = naive_logprobs(logits[:, :-1], tokens[:, 1:])
    for i, (p, r) in enumerate(zip(b.prompt_lengths, b.response_lengths, strict=True)):
        torch.testing.assert_close(logp[i, :r], ref[i, p - 1 : p - 1 + r], atol=1e-4, rtol=0)


def test_actor_logprobs_are_the_policys_and_what_train_starts_from(tmp_path: Path) -> None:
    """`MegatronTrainerActor.logprobs` (the TrainerActor call for checking a backend against
    the engines or another backend): equal to a float64 forward of the model files at the
    rollout temperature, no gap against the old-policy log-probs `train` computes, and moved
    by its steps."""
    from transformers import AutoModelForCausalLM

    from rljob.driver.model_files import prepare_model
    from rljob.trainer.megatron.actor import MegatronTrainerActor
    from tests.logprob_samples import TEMPERATURE, check_policy_logprobs, samples_of
    from tests.runtime.jobs import job_spec

    spec = job_spec(tmp_path, {
        "trainer": {"backend": "megatron", "gpusPerReplica": 1},
        "rollout": {"sampling": {"temperature": TEMPERATURE}},
        "algorithm": {"estimator": "grpo", "rolloutBatchSize": 2, "nSamplesPerPrompt": 4,
                      "globalBatchSize": 4, "stepsPerRollout": 2, "microBatchSize": 2},
    })
    model_dir = prepare_model(spec, tmp_path)
    vocab = int(AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size)
    samples = samples_of(vocab)
    # One rank: the actor finds the module's process group and parallel state and keeps
    # them (no shutdown here, which would end them for the tests after this one).
    actor = MegatronTrainerActor(spec.model_dump_json(by_alias=True), str(model_dir), 0, 1,
                                 "", "cuda")
    check_policy_logprobs(actor.logprobs, actor.train, model_dir, samples)
    actor.sync.close()


def test_actor_clips_against_the_engines_logprobs_with_old_logprobs_rollout(tmp_path: Path
                                                                            ) -> None:
    """`algorithm.oldLogprobs: rollout` in `MegatronTrainerActor.train`: the engine's
    log-probs, one nat above the policy's, are the old policy the clip measures from, so
    every negative-advantage token of the first step is clipped (none would be against the
    trainer's own)."""
    from transformers import AutoModelForCausalLM

    from rljob.driver.model_files import prepare_model
    from rljob.trainer.megatron.actor import MegatronTrainerActor
    from tests.logprob_samples import (
        ENGINE_EXCESS,
        NEGATIVE_ADVANTAGE_SHARE,
        TEMPERATURE,
        samples_of,
        with_engine_excess,
    )
    from tests.runtime.jobs import job_spec

    spec = job_spec(tmp_path, {
        "trainer": {"backend": "megatron", "gpusPerReplica": 1},
        "rollout": {"sampling": {"temperature": TEMPERATURE}},
        "algorithm": {"estimator": "grpo", "rolloutBatchSize": 2, "nSamplesPerPrompt": 4,
                      "globalBatchSize": 8, "stepsPerRollout": 1, "microBatchSize": 4,
                      "oldLogprobs": "rollout"},
    })
    model_dir = prepare_model(spec, tmp_path)
    samples = samples_of(int(AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size))
    actor = MegatronTrainerActor(spec.model_dump_json(by_alias=True), str(model_dir), 0, 1,
                                 "", "cuda")
    metrics = actor.train(with_engine_excess(samples, actor.logprobs(samples)), False)
    actor.sync.close()
    assert metrics.optimizer_steps == 1
    assert metrics.logprob_gap == pytest.approx(ENGINE_EXCESS, abs=1e-4)
    assert metrics.step_means.clipfrac == pytest.approx(NEGATIVE_ADVANTAGE_SHARE, abs=1e-6)
