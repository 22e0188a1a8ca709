"""The megatron trainer: GPTModel + distributed optimizer trained on the shared RL loss.

Data flow per optimizer step: micro-batches of right-padded `[prompt + response]` rows go
through megatron-core's forward/backward schedule (pipeline-parallel aware); on the last stage
the decoder's hidden states are projected only at positions that predict response tokens,
through the vocab-parallel tiled log-prob function, and fed to `rljob.algo.losses.policy_loss`
(the same loss as the torch backend). Losses are per-token sums; megatron-core divides the
gradients by the step's response-token count over all data-parallel ranks
(`calculate_per_token_loss`), so micro-batching and data parallelism give one big batch's
gradient.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

from rljob.algo.losses import LossKind, policy_loss
from rljob.checkpoint import rng
from rljob.kernels.logprobs import pad_responses, response_index
from rljob.kernels.logprobs_vocab_parallel import token_logprobs
from rljob.trainer.megatron.args import route_megatron_args
from rljob.trainer.megatron.model import (
    VOCAB_DIVISOR,
    build_model,
    export_hf_weights,
    load_hf_weights,
    transformer_config,
)
from rljob.trainer.megatron.shape import ModelShape

METRICS = ("loss", "pg_loss", "kl", "entropy", "clipfrac")  # the loss terms a step sums


class NonFiniteError(FloatingPointError):
    """A loss or gradient norm was NaN/inf; the step was not applied."""


@dataclass(frozen=True)
class StepResult:
    """One applied optimizer step: each of its loss terms (`METRICS`) as a token mean over
    the step, the gradient norm and the response tokens it trained on."""

    loss: float
    pg_loss: float
    kl: float
    entropy: float
    clipfrac: float
    grad_norm: float
    tokens: float


@dataclass(frozen=True)
class PolicyLossConfig:
    kind: LossKind = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    temperature: float = 1.0


@dataclass
class PolicyMicroBatch:
    """Right-padded rows `[prompt + response]` and `[batch, max response]` per-token tensors."""

    tokens: torch.Tensor
    prompt_lengths: list[int]
    response_lengths: list[int]
    loss_mask: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    ref_logp: torch.Tensor | None = None
    is_weight: torch.Tensor | None = None  # truncated importance weights, when TIS is on


def init_parallel(tensor: int, pipeline: int, context: int, seed: int) -> None:
    """torch.distributed (NCCL, from torchrun-style env, single process by default) + Megatron
    model-parallel groups sized from `spec.trainer.parallelism`."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group(
            "nccl",
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
        )
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = dist.get_world_size()
    if world % (tensor * pipeline * context):
        raise ValueError(
            f"spec.trainer.parallelism: tensor {tensor} x pipeline {pipeline} x context "
            f"{context} must divide the {world} trainer GPUs"
        )
    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        context_parallel_size=context,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


class MegatronTrainer:
    """One policy replica's trainer; every rank of the job constructs one (collectives)."""

    def __init__(
        self,
        shape: ModelShape,
        hf_weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        loss: PolicyLossConfig,
        megatron_args: Sequence[str] = (),
    ) -> None:
        routed = route_megatron_args(
            megatron_args,
            {
                "transformer": _field_names(TransformerConfig),
                "optimizer": _field_names(OptimizerConfig),
                "ddp": _field_names(DistributedDataParallelConfig),
            },
        )
        self.shape = shape
        self.dtype = dtype
        self.loss_config = loss
        self.config = transformer_config(
            shape, dtype, {"calculate_per_token_loss": True, **routed["transformer"]}
        )
        tp = parallel_state.get_tensor_model_parallel_world_size()
        padded = shape.padded_vocab(VOCAB_DIVISOR, tp)
        if padded - shape.vocab_size >= padded // tp:
            raise ValueError(
                f"vocab {shape.vocab_size} is too small for tensor parallel size {tp}: the last "
                "rank would hold only padding"
            )
        # Every parameter in the training dtype, as Megatron-LM's Float16Module leaves them
        # (megatron-core's norms are created in fp32 otherwise). The distributed optimizer
        # needs it: within a parameter group it orders fp32 shards before 16-bit ones, while
        # its checkpoint index keeps buffer order, so a group mixing the two (Qwen2's q/k/v
        # biases with the norms) saves and loads each state under another parameter.
        model = build_model(shape, self.config).to(device="cuda", dtype=dtype)
        load_hf_weights(model, hf_weights, shape)
        ddp_config = DistributedDataParallelConfig(
            **{
                "use_distributed_optimizer": True,
                "grad_reduce_in_fp32": True,
                "check_for_nan_in_grad": True,
                **routed["ddp"],
            }
        )
        self.model = DistributedDataParallel(self.config, ddp_config, model)
        opt_config = OptimizerConfig(
            **{
                "optimizer": "adam",
                "lr": lr,
                "min_lr": lr,
                "weight_decay": weight_decay,
                "clip_grad": max_grad_norm,
                "bf16": dtype == torch.bfloat16,
                "fp16": dtype == torch.float16,
                "params_dtype": dtype,
                "use_distributed_optimizer": True,
                **routed["optimizer"],
            }
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        for group in self.optimizer.param_groups:
            group["lr"] = opt_config.lr
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync

    def frozen_copy(self, hf_weights: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        """A forward-only GPTModel of this trainer's shape, config and dtype holding
        `hf_weights` (the frozen reference policy): no gradient hooks, no optimizer."""
        config = copy.copy(self.config)
        config.no_sync_func = None
        config.finalize_model_grads_func = None
        model: torch.nn.Module = build_model(self.shape, config).to(device="cuda",
                                                                    dtype=self.dtype)
        load_hf_weights(model, hf_weights, self.shape)
        model.eval().requires_grad_(False)
        return model

    # -- forward ---------------------------------------------------------------------------

    def _response_logprobs(
        self, mb: PolicyMicroBatch, hidden_states: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """`[2, batch, max response]`: log-probs and entropies of the response tokens."""
        seq_parallel = self.config.sequence_parallel
        if seq_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=True
            )
        rows, cols = response_index(mb.prompt_lengths, mb.response_lengths)
        rows, cols = rows.to(hidden_states.device), cols.to(hidden_states.device)
        tokens = mb.tokens.to(hidden_states.device)
        v_local = weight.shape[0]
        start = parallel_state.get_tensor_model_parallel_rank() * v_local
        real = max(0, min(v_local, self.shape.vocab_size - start))
        logp, entropy = token_logprobs(
            hidden_states[cols, rows],
            weight[:real],
            tokens[rows, cols + 1],
            vocab_start=start,
            temperature=self.loss_config.temperature,
            with_entropy=True,
            group=parallel_state.get_tensor_model_parallel_group(),
            reduce_hidden_grad=not seq_parallel,
        )
        assert entropy is not None
        return torch.stack(
            [pad_responses(logp, mb.response_lengths), pad_responses(entropy, mb.response_lengths)]
        )

    def _forward_step(
        self, data_iterator: Iterator[PolicyMicroBatch], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        tokens = mb.tokens.cuda(non_blocking=True)
        batch, seq = tokens.shape
        positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, seq)

        def processor(
            *, hidden_states: torch.Tensor, output_layer: Any, output_weight: Any, **_: Any
        ) -> torch.Tensor:
            weight = output_weight if output_weight is not None else output_layer.weight
            return self._response_logprobs(mb, hidden_states, weight)

        output = model(tokens, positions, None, output_processor=processor)
        return output, partial(self._loss, mb)

    def _loss(
        self, mb: PolicyMicroBatch, output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        device = output.device
        mask = mb.loss_mask.to(device).float()
        c = self.loss_config
        terms = policy_loss(
            output[0],
            mb.old_logp.to(device),
            None if mb.ref_logp is None else mb.ref_logp.to(device),
            mb.advantages.to(device),
            output[1],
            mask,
            denominator=1.0,
            clip_low=c.clip_low,
            clip_high=c.clip_high,
            kl_coef=c.kl_coef,
            entropy_coef=c.entropy_coef,
            kind=c.kind,
            is_weight=None if mb.is_weight is None else mb.is_weight.to(device),
        )
        n_tokens = mask.sum()
        sums = torch.stack(
            [
                terms.loss,
                terms.pg_loss,
                terms.kl.to(device),
                terms.entropy,
                terms.clipfrac,
                n_tokens,
            ]
        ).detach()
        return terms.loss, n_tokens.int(), {"sums": sums, "logp": output[0].detach()}

    def _run(
        self,
        micro_batches: Sequence[PolicyMicroBatch],
        forward_only: bool,
        model: torch.nn.Module | None = None,
    ) -> list[Any]:
        fb = get_forward_backward_func()
        result: list[Any] = fb(
            forward_step_func=self._forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model if model is None else model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
            micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
            forward_only=forward_only,
        )
        return result

    # -- public ----------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(
        self, micro_batches: Sequence[PolicyMicroBatch], model: torch.nn.Module | None = None
    ) -> list[torch.Tensor]:
        """Response log-probs `[batch, max response]` per micro-batch (last pipeline stage;
        other stages get an empty list) of the policy, or of `model` (a GPTModel of the same
        shape and config, e.g. the frozen reference). Only tokens, lengths and the mask of
        the micro-batches are read."""
        self.model.eval()
        out = self._run(micro_batches, forward_only=True, model=model)
        self.model.train()
        return [d["logp"] for d in out]

    def train_step(self, micro_batches: Sequence[PolicyMicroBatch]) -> StepResult:
        """One optimizer step over `micro_batches`; its loss terms are token means over the
        step. Raises NonFiniteError, having applied nothing, on a non-finite loss term or
        gradient norm."""
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run(micro_batches, forward_only=False)
        sums = torch.zeros(len(METRICS) + 1, device="cuda")
        for d in out:
            sums += d["sums"]
        # Only the last pipeline stage computed the loss; sum it over stages and data ranks.
        dist.all_reduce(sums, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        if not bool(torch.isfinite(sums).all()):
            self.optimizer.zero_grad()
            raise NonFiniteError(f"non-finite loss terms {sums.tolist()}; step not applied")
        applied, grad_norm, _ = self.optimizer.step()
        if grad_norm is None or not math.isfinite(grad_norm) or not applied:
            raise NonFiniteError(f"gradient norm {grad_norm}; step not applied")
        tokens = float(sums[-1].item())
        values = sums.tolist()[:-1]
        means = {k: float(v) / max(tokens, 1.0) for k, v in zip(METRICS, values, strict=True)}
        return StepResult(**means, grad_norm=float(grad_norm), tokens=tokens)

    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This pipeline stage's weights in HF names (tensor shards gathered, padding stripped):
        what weight sync broadcasts to the rollout engines."""
        return export_hf_weights(self.model.module, self.shape)

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [opt.optimizer for opt in chained]

    def _adam_step(self) -> int:
        """Adam's step count (torch's AdamW keeps one per parameter; all are equal)."""
        steps = {
            int(state["step"])
            for inner in self._inner_optimizers()
            for state in inner.state.values()
            if "step" in state
        }
        if len(steps) > 1:
            raise RuntimeError(f"optimizer parameters disagree on Adam's step count: {steps}")
        return steps.pop() if steps else 0

    def _allocate_optimizer_state(self) -> None:
        """Give a fresh optimizer its state tensors so a checkpoint can be loaded into them.

        With PyTorch's AdamW (no Apex / Transformer Engine) megatron-core reads the step count
        from the existing state when it builds the sharded state dict, and asserts on an empty
        one. A step on zero gradients allocates every tensor; the load overwrites all of them
        (master weights, moments, step count) and the model weights.
        """
        for inner in self._inner_optimizers():
            if inner.state:
                continue
            for group in inner.param_groups:
                for param in group["params"]:
                    param.grad = torch.zeros_like(param)
            inner.step()
            inner.zero_grad(set_to_none=True)

    def _set_adam_step(self, step: int) -> None:
        """Restore the step count after a load, one tensor per parameter as AdamW keeps it.

        megatron-core 0.19's `dp_reshardable` load hands the per-parameter `step` back as a
        local non-persistent value (the pre-load tensor) and copies it over the loaded one,
        which torch's `load_state_dict` also left shared between all parameters (AdamW
        increments it in place, once per parameter). So the count is checkpointed on its own.
        """
        for inner in self._inner_optimizers():
            for state in inner.state.values():
                if "step" in state:
                    state["step"] = torch.tensor(float(step), dtype=torch.float32)

    def _sharded_state(self, is_loading: bool) -> dict[str, Any]:
        model_sd = self.model.module.sharded_state_dict()
        # 'dp_reshardable': each rank writes its own optimizer shard in parallel, no gathering;
        # a resume may change the data-parallel size, not TP/PP (the model part reshards).
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=metadata
            ),
            "adam_step": self._adam_step(),
        }

    def _rng_file(self, directory: Path) -> Path:
        return directory / f"rng_rank{dist.get_rank()}.pt"

    def save(self, directory: Path) -> None:
        """Megatron distributed checkpoint (model + distributed optimizer) into `directory`,
        an empty folder inside the caller's atomic checkpoint staging dir, plus each rank's
        RNG states (dropout, if `megatronArgs` turns it on). Collective; returns on every rank
        once all have written (the caller's commit may follow at once)."""
        directory.mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(self._sharded_state(is_loading=False), str(directory))
        rng.save(self._rng_file(directory), cuda=True,
                 tracker=tensor_parallel.get_cuda_rng_tracker().get_states())
        dist.barrier()

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote, resharding over data-parallel ranks. Collective."""
        self._allocate_optimizer_state()
        state = dist_checkpointing.load(self._sharded_state(is_loading=True), str(directory))
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._set_adam_step(int(state["adam_step"]))
        rng_file = self._rng_file(directory)
        if rng_file.exists():  # absent when the data-parallel size changed
            tensor_parallel.get_cuda_rng_tracker().set_states(rng.load(rng_file)["tracker"])
