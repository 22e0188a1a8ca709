"""The `torch` trainer: plain PyTorch on CPU or one GPU per rank, data parallel over gloo/NCCL.

Per rollout step it computes the old-policy, reference and (PPO) value estimates of all
samples, the advantages, then `stepsPerRollout` optimizer steps over consecutive
`globalBatchSize` slices. Ranks split each slice; gradients are summed across ranks and
every loss is normalised by the slice's total response tokens, so any rank count or
micro-batch size gives the same update. A step whose loss or gradient norm is NaN/Inf
is skipped (nothing is replaced) and reported.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor

from rljob.algo.losses import policy_loss, value_loss
from rljob.checkpoint import rng
from rljob.kernels.logprobs import chunked_logprobs, pad_responses, response_index
from rljob.kernels.logprobs_vocab_parallel import token_logprobs
from rljob.model.dtypes import torch_dtype
from rljob.model.offload import module_tensors, optimizer_tensors
from rljob.reporting import worker_metrics
from rljob.rollout.sample import Sample
from rljob.trainer.batch import (
    PaddedBatch,
    advantages,
    collate,
    micro_batches,
    old_policy_logprobs,
    per_sample,
    policy_settings,
    rewards_of,
    rollout_summary,
    truncated_is,
    verify_initial_kl,
    widen,
)
from rljob.trainer.interface import TrainerActor
from rljob.trainer.metrics import StepFigures, TrainMetrics
from rljob.trainer.publishing import TrainerSync
from rljob.weightsync.nonfinite import nonfinite_names
from rljob.weightsync.wire import NamedTensors
from rljob_api.spec import RLJobSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

VALUE_CLIP = 0.2


@dataclass
class Sums:
    """Per-optimizer-step figures summed over micro-batches (already token-normalised)."""

    loss: float = 0.0
    pg_loss: float = 0.0
    kl_loss: float = 0.0
    entropy: float = 0.0
    clipfrac: float = 0.0
    value_loss: float = 0.0

    def as_tensor(self) -> Tensor:
        return torch.tensor([self.loss, self.pg_loss, self.kl_loss, self.entropy, self.clipfrac,
                             self.value_loss], dtype=torch.float64)


@dataclass
class Inference:
    """Per-sample tensors [N, T] computed once per rollout step without gradients."""

    old_logp: Tensor
    ref_logp: Tensor
    values: Tensor | None
    rollout_logp: Tensor
    mask: Tensor
    extra: dict[str, Any] = field(default_factory=dict)


def response_logprobs(
    model: PreTrainedModel, batch: PaddedBatch, chunk_tokens: int, temperature: float
) -> tuple[Tensor, Tensor]:
    """Padded [B, T] log-probs and entropies of the response tokens, chunked."""
    hidden = model.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask
    ).last_hidden_state
    rows, cols = response_index(batch.prompt_lengths, batch.response_lengths)
    rows, cols = rows.to(hidden.device), cols.to(hidden.device)
    head = model.get_output_embeddings()
    if hidden.is_cuda and head.bias is None:
        # The fused kernels: exact fp32 statistics, one 128 MiB chunk of logits at a time.
        logp, maybe_ent = token_logprobs(
            hidden[rows, cols], head.weight, batch.input_ids[rows, cols + 1],
            temperature=temperature, with_entropy=True,
        )
        assert maybe_ent is not None
        ent = maybe_ent
    else:
        logp, ent = chunked_logprobs(
            hidden[rows, cols], head.weight, batch.input_ids[rows, cols + 1],
            chunk_tokens=chunk_tokens, temperature=temperature, bias=head.bias,
        )
    return pad_responses(logp, batch.response_lengths), pad_responses(ent, batch.response_lengths)


def response_values(critic: PreTrainedModel, batch: PaddedBatch) -> Tensor:
    out = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[..., 0]
    rows, cols = response_index(batch.prompt_lengths, batch.response_lengths)
    return pad_responses(out[rows.to(out.device), cols.to(out.device)].float(),
                         batch.response_lengths)


class TorchTrainer(TrainerActor):
    def __init__(
        self, spec_json: str, model_dir: str, rank: int, world: int, init_method: str,
        device: str,
    ) -> None:
        self.spec = RLJobSpec.model_validate_json(spec_json)
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        algo = self.spec.algorithm
        torch.manual_seed(algo.seed + rank)
        # transformers' model classes are imported here, in the actor, not with this module:
        # the driver imports the module to create the actor, and they are seconds of CPU.
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        if world > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=world)
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32)
        torch.nn.Module.to(self.model, self.device)
        self.model.train()
        self.ref: PreTrainedModel = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.lr,
                                           weight_decay=algo.weight_decay)
        self.critic: PreTrainedModel | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if algo.estimator == "ppo":
            self.critic = AutoModelForTokenClassification.from_pretrained(
                model_dir, num_labels=1, dtype=torch.float32)
            torch.nn.Module.to(self.critic, self.device)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(),
                                                      lr=algo.critic_lr)
        self.serve_dtype = torch_dtype(self.spec.model.dtype)
        self.sync = TrainerSync(self.spec.weight_sync, cuda=self.device.type == "cuda",
                                config_json=self.model.config.to_json_string())
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.metrics_port = worker_metrics.serve()

    # ---- forward helpers -------------------------------------------------------------

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.serve_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.serve_dtype)

    @torch.no_grad()
    def _infer(self, samples: list[Sample]) -> Inference:
        algo = self.spec.algorithm
        temp = self.spec.rollout.sampling.temperature
        width = max(s.response_length for s in samples)
        parts: dict[str, list[Tensor]] = {"old": [], "ref": [], "val": [], "roll": [], "mask": []}
        for mb in micro_batches(list(range(len(samples))), algo.micro_batch_size):
            batch = collate([samples[i] for i in mb], self.pad_id).to(self.device)
            with self._autocast():
                old, _ = response_logprobs(self.model, batch, algo.logprob_chunk_tokens, temp)
                ref, _ = response_logprobs(self.ref, batch, algo.logprob_chunk_tokens, temp)
                if self.critic is not None:
                    parts["val"].append(widen(response_values(self.critic, batch), width))
            parts["old"].append(widen(old, width))
            parts["ref"].append(widen(ref, width))
            parts["roll"].append(widen(batch.rollout_logp, width))
            parts["mask"].append(widen(batch.loss_mask, width))
        return Inference(
            old_logp=torch.cat(parts["old"]), ref_logp=torch.cat(parts["ref"]),
            values=torch.cat(parts["val"]) if parts["val"] else None,
            rollout_logp=torch.cat(parts["roll"]), mask=torch.cat(parts["mask"]),
        )

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The policy's response log-probs, computed as `train` computes the old policy's."""
        self.on_device()
        algo = self.spec.algorithm
        temp = self.spec.rollout.sampling.temperature
        out: list[list[float]] = []
        for mb in micro_batches(list(range(len(samples))), algo.micro_batch_size):
            batch = collate([samples[i] for i in mb], self.pad_id).to(self.device)
            with self._autocast():
                logp, _ = response_logprobs(self.model, batch, algo.logprob_chunk_tokens, temp)
            out += per_sample(logp, batch.response_lengths)
        return out

    # ---- training ----------------------------------------------------------------------

    def _held_tensors(self) -> Iterator[Tensor]:
        yield from module_tensors([self.model, self.ref, self.critic])
        yield from optimizer_tensors([self.optimizer, self.critic_optimizer])
        yield from self.sync.device_buffers()

    def train(self, samples: list[Sample], check_initial_kl: bool) -> TrainMetrics:
        """Train on one rollout step's samples; return its metrics (same on every rank)."""
        self.on_device()
        algo = self.spec.algorithm
        temp = self.spec.rollout.sampling.temperature
        inf = self._infer(samples)
        if check_initial_kl:
            verify_initial_kl(inf.old_logp, inf.ref_logp)
        adv, returns = advantages(algo, rewards_of(samples, self.device), inf.old_logp,
                                  inf.ref_logp, inf.mask, inf.values)
        mask = inf.mask
        policy = policy_settings(algo)
        tis = truncated_is(algo, inf.old_logp, inf.rollout_logp, mask)
        old = old_policy_logprobs(self.spec.old_logprobs(), inf.old_logp, inf.rollout_logp, mask)
        step_metrics: list[StepFigures] = []
        skipped: list[str] = []
        for k in range(algo.steps_per_rollout):
            idx = list(range(k * algo.global_batch_size, (k + 1) * algo.global_batch_size))
            denominator = float(mask[idx].sum())
            sums = Sums()
            for mb in micro_batches(idx[self.rank :: self.world], algo.micro_batch_size):
                batch = collate([samples[i] for i in mb], self.pad_id).to(self.device)
                t = max(batch.response_lengths)
                with self._autocast():
                    logp, ent = response_logprobs(self.model, batch, algo.logprob_chunk_tokens,
                                                  temp)
                terms = policy_loss(
                    logp, old[mb, :t], inf.ref_logp[mb, :t], adv[mb, :t],
                    ent, mask[mb, :t], denominator=max(denominator, 1.0),
                    clip_low=policy.clip_low, clip_high=policy.clip_high,
                    kl_coef=policy.kl_coef, entropy_coef=policy.entropy_coef,
                    kind=policy.kind, is_weight=None if tis is None else tis.weights[mb, :t],
                )
                torch.autograd.backward(terms.loss)
                sums.loss += float(terms.loss)
                sums.pg_loss += float(terms.pg_loss)
                sums.kl_loss += float(terms.kl)
                sums.entropy += float(terms.entropy)
                sums.clipfrac += float(terms.clipfrac)
                if self.critic is not None and inf.values is not None and returns is not None:
                    with self._autocast():
                        values = response_values(self.critic, batch)
                    vloss = value_loss(values, inf.values[mb, :t], returns[mb, :t],
                                       mask[mb, :t], clip=VALUE_CLIP,
                                       denominator=max(denominator, 1.0))
                    torch.autograd.backward(vloss)
                    sums.value_loss += float(vloss)
            step_metrics.append(self._optimizer_step(sums, skipped, k))
        return rollout_summary(samples, inf.old_logp, inf.ref_logp, inf.rollout_logp, inf.mask,
                               step_metrics, skipped, tis)

    def _all_reduce(self, t: Tensor) -> Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def _optimizer_step(self, sums: Sums, skipped: list[str], k: int) -> StepFigures:
        totals = self._all_reduce(sums.as_tensor())
        models: list[tuple[PreTrainedModel, torch.optim.Optimizer]] = [
            (self.model, self.optimizer)]
        if self.critic is not None and self.critic_optimizer is not None:
            models.append((self.critic, self.critic_optimizer))
        norms = []
        for model, _ in models:
            for p in model.parameters():
                if p.grad is not None:
                    self._all_reduce(p.grad)
            norms.append(float(torch.nn.utils.clip_grad_norm_(
                model.parameters(), self.spec.algorithm.max_grad_norm)))
        reason = None
        if not bool(torch.isfinite(totals).all()):
            reason = f"optimizer step {k}: non-finite loss ({float(totals[0])})"
        elif not all(np.isfinite(norms)):
            reason = f"optimizer step {k}: non-finite gradient norm ({norms})"
        for _, optimizer in models:
            if reason is None:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        worker_metrics.record_train_step(float(totals[0]), norms[0], skipped=reason is not None)
        if reason is not None:
            skipped.append(reason)
        loss, pg_loss, kl_loss, entropy, clipfrac, value_loss = totals.tolist()
        return StepFigures(loss=loss, pg_loss=pg_loss, kl_loss=kl_loss, entropy=entropy,
                           clipfrac=clipfrac, value_loss=value_loss, grad_norm=norms[0],
                           skipped=reason is not None)

    # ---- weights ---------------------------------------------------------------------

    def named_weights(self) -> NamedTensors:
        self.on_device()
        return [(n, t.detach().to(self.serve_dtype).clone())
                for n, t in self.model.state_dict().items()]

    def nonfinite_weights(self) -> list[str]:
        self.on_device()
        return nonfinite_names(list(self.model.state_dict().items()))

    # ---- checkpoints -----------------------------------------------------------------

    def save(self, directory: str, hf_export: bool) -> None:
        self.on_device()
        d = Path(directory)
        rng.save(d / f"trainer_rng_rank{self.rank}.pt", cuda=torch.cuda.is_available())
        if self.rank != 0:
            return
        save_file(self.model.state_dict(), str(d / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), d / "optimizer.pt")
        if self.critic is not None and self.critic_optimizer is not None:
            save_file(self.critic.state_dict(), str(d / "critic.safetensors"))
            torch.save(self.critic_optimizer.state_dict(), d / "critic_optimizer.pt")
        if hf_export:
            self.model.save_pretrained(d / "hf", safe_serialization=True)

    def load(self, directory: str) -> None:
        self.on_device()
        d = Path(directory)
        self.model.load_state_dict(load_file(str(d / "model.safetensors"),
                                             device=str(self.device)))
        self.optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=False))
        if self.critic is not None and self.critic_optimizer is not None:
            self.critic.load_state_dict(load_file(str(d / "critic.safetensors"),
                                                  device=str(self.device)))
            self.critic_optimizer.load_state_dict(
                torch.load(d / "critic_optimizer.pt", weights_only=False))
        rng_file = d / f"trainer_rng_rank{self.rank}.pt"
        if rng_file.exists():
            rng.load(rng_file)

    def shutdown(self) -> None:
        self.sync.close()
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
