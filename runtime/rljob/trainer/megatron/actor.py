"""`trainer.backend: megatron` behind the driver's trainer-actor interface.

The driver talks to every trainer rank the same way whatever the backend
(`rljob.trainer.interface.TrainerActor`). This actor turns one rollout
step's samples into `PolicyMicroBatch`es for `MegatronTrainer`: old-policy and reference
log-probs first (the reference is a frozen GPTModel of the initial weights), then the
advantages, then `stepsPerRollout` optimizer steps over consecutive `globalBatchSize` slices,
each data-parallel rank taking every n-th sample of a slice.

Weight sync (`rljob.trainer.publishing.TrainerSync`, shared with the torch backend) and
the non-finite scan run on trainer rank 0 alone, so this actor keeps all of
a rank's weights on it: tensor, pipeline and context parallel sizes must be 1 (data parallel
over several GPUs is fine). Checkpoints are Megatron distributed checkpoints in a
`megatron/` folder of the driver's atomic checkpoint directory.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file
from torch import Tensor
from torch._C._distributed_c10d import HashStore
from transformers import AutoModelForCausalLM

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
from rljob.trainer.megatron.shape import ModelShape
from rljob.trainer.megatron.training import (
    MegatronTrainer,
    NonFiniteError,
    PolicyLossConfig,
    PolicyMicroBatch,
    init_parallel,
)
from rljob.trainer.metrics import StepFigures, TrainMetrics
from rljob.trainer.publishing import TrainerSync
from rljob.weightsync.nonfinite import nonfinite_names
from rljob.weightsync.wire import NamedTensors
from rljob_api.spec import RLJobSpec

CHECKPOINT_DIR = "megatron"


def check_supported(spec: RLJobSpec) -> None:
    """What this actor cannot run yet, as errors naming the field and the way out."""
    par = spec.trainer.parallelism
    if (par.tensor, par.pipeline, par.context) != (1, 1, 1):
        raise ValueError(
            "spec.trainer.parallelism: `rljob run` publishes weights from trainer rank 0 alone, "
            "so the megatron backend needs tensor = pipeline = context = 1 here (data parallel "
            f"over more GPUs works); got tensor {par.tensor}, pipeline {par.pipeline}, "
            f"context {par.context}"
        )
    if spec.algorithm.estimator == "ppo":
        raise ValueError(
            "spec.algorithm.estimator: ppo needs a critic, which the megatron backend does not "
            "train; use grpo, gspo, cispo, reinforce++ or reinforce++_baseline, or "
            "spec.trainer.backend: torch"
        )


class MegatronTrainerActor(TrainerActor):
    def __init__(
        self, spec_json: str, model_dir: str, rank: int, world: int, init_method: str,
        device: str,
    ) -> None:
        self.spec = RLJobSpec.model_validate_json(spec_json)
        check_supported(self.spec)
        if device != "cuda" or not torch.cuda.is_available():
            raise ValueError("spec.trainer.backend megatron needs a CUDA GPU per trainer rank; "
                             "use spec.trainer.backend: torch on CPU")
        self.rank, self.world = rank, world
        self.model_dir = Path(model_dir)
        algo = self.spec.algorithm
        if not dist.is_initialized() and world == 1:
            # Megatron needs a process group even for one rank; an in-process store binds no
            # port, so nothing else on the machine can have taken it.
            dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
        elif not dist.is_initialized():
            dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world)
        par = self.spec.trainer.parallelism
        init_parallel(par.tensor, par.pipeline, par.context, seed=algo.seed)
        torch.manual_seed(algo.seed + rank)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.pad_id = int(hf.config.pad_token_id or 0)
        self.sync = TrainerSync(self.spec.weight_sync, cuda=True,
                                config_json=hf.config.to_json_string())
        shape = ModelShape.from_hf(hf.config)
        weights = {k: v for k, v in hf.state_dict().items()
                   if not (shape.tie_word_embeddings and k == "lm_head.weight")}
        dtype = torch_dtype(self.spec.model.dtype)
        self.serve_dtype = dtype
        policy = policy_settings(algo)
        self.trainer = MegatronTrainer(
            shape, weights, dtype=dtype, lr=algo.lr, weight_decay=algo.weight_decay,
            max_grad_norm=algo.max_grad_norm,
            loss=PolicyLossConfig(
                kind=policy.kind, clip_low=policy.clip_low, clip_high=policy.clip_high,
                kl_coef=policy.kl_coef, entropy_coef=policy.entropy_coef,
                temperature=self.spec.rollout.sampling.temperature),
            megatron_args=self.spec.trainer.megatron_args,
        )
        # The reference policy: the initial weights, frozen, same forward as the policy.
        self.reference = self.trainer.frozen_copy(weights)
        del hf, weights
        self.metrics_port = worker_metrics.serve()

    # ---- batches -----------------------------------------------------------------------

    def _policy_batch(self, batch: PaddedBatch, old: Tensor, ref: Tensor, adv: Tensor,
                      is_weight: Tensor | None = None) -> PolicyMicroBatch:
        t = max(batch.response_lengths)
        return PolicyMicroBatch(
            tokens=batch.input_ids, prompt_lengths=batch.prompt_lengths,
            response_lengths=batch.response_lengths, loss_mask=batch.loss_mask,
            old_logp=old[:, :t], advantages=adv[:, :t], ref_logp=ref[:, :t],
            is_weight=None if is_weight is None else is_weight[:, :t])

    def _batches(self, samples: list[Sample]) -> list[PaddedBatch]:
        """All samples of a rollout step in micro-batches, in order."""
        groups = micro_batches(list(range(len(samples))), self.spec.algorithm.micro_batch_size)
        return [collate([samples[i] for i in mb], self.pad_id) for mb in groups]

    def _infer(self, batches: list[PaddedBatch], width: int,
               models: tuple[torch.nn.Module | None, ...] = (None,)) -> list[Tensor]:
        """Log-probs `[N, width]` of all samples under each of `models` (None: the policy),
        on every rank."""
        zeros = [torch.zeros(len(b.prompt_lengths), width) for b in batches]
        inputs = [self._policy_batch(b, z, z, z) for b, z in zip(batches, zeros, strict=True)]
        return [torch.cat([widen(t.float().cpu(), width)
                           for t in self.trainer.logprobs(inputs, model=model)])
                for model in models]

    def _held_tensors(self) -> Iterator[Tensor]:
        """The DDP model with its contiguous parameter and gradient buffers, the frozen
        reference, the distributed optimizer (fp32 main parameters, Adam moments) and the
        publisher's send buffers."""
        yield from module_tensors([self.trainer.model, self.reference])
        yield from optimizer_tensors([self.trainer.optimizer])
        yield from self.sync.device_buffers()

    # ---- training ----------------------------------------------------------------------

    def train(self, samples: list[Sample], check_initial_kl: bool) -> TrainMetrics:
        """Train on one rollout step's samples; return its metrics (same on every rank)."""
        self.on_device()
        algo = self.spec.algorithm
        width = max(s.response_length for s in samples)
        batches = self._batches(samples)
        old, ref = self._infer(batches, width, (None, self.reference))
        mask = torch.cat([widen(b.loss_mask, width) for b in batches])
        rollout_logp = torch.cat([widen(b.rollout_logp, width) for b in batches])
        if check_initial_kl:
            verify_initial_kl(old, ref)
        adv, _ = advantages(algo, rewards_of(samples), old, ref, mask)
        tis = truncated_is(algo, old, rollout_logp, mask)
        behaviour = old_policy_logprobs(self.spec.old_logprobs(), old, rollout_logp, mask)
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        steps: list[StepFigures] = []
        skipped: list[str] = []
        for k in range(algo.steps_per_rollout):
            idx = list(range(k * algo.global_batch_size, (k + 1) * algo.global_batch_size))
            mbs = [self._policy_batch(collate([samples[i] for i in mb], self.pad_id),
                                      behaviour[mb], ref[mb], adv[mb],
                                      None if tis is None else tis.weights[mb])
                   for mb in micro_batches(idx[dp_rank::dp_size], algo.micro_batch_size)]
            try:
                r = self.trainer.train_step(mbs)
                step = StepFigures(loss=r.loss, pg_loss=r.pg_loss, kl_loss=r.kl,
                                   entropy=r.entropy, clipfrac=r.clipfrac, value_loss=0.0,
                                   grad_norm=r.grad_norm, skipped=False)
            except NonFiniteError as err:
                skipped.append(f"optimizer step {k}: {err}")
                nan = float("nan")
                step = StepFigures(loss=nan, pg_loss=nan, kl_loss=nan, entropy=nan,
                                   clipfrac=nan, value_loss=0.0, grad_norm=nan, skipped=True)
            worker_metrics.record_train_step(step.loss, step.grad_norm, skipped=step.skipped)
            steps.append(step)
        return rollout_summary(samples, old, ref, rollout_logp, mask, steps, skipped, tis)

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The policy's response log-probs, computed as `train` computes the old policy's."""
        self.on_device()
        width = max(s.response_length for s in samples)
        (logp,) = self._infer(self._batches(samples), width)
        return per_sample(logp, [s.response_length for s in samples])

    # ---- weights -----------------------------------------------------------------------

    def named_weights(self) -> NamedTensors:
        """HF-named weights in the serving dtype (what the engines load), left on this
        rank's GPU: the publisher packs them there for NCCL or CUDA IPC, with no round trip
        through host memory."""
        self.on_device()
        return [(n, t.detach().to(dtype=self.serve_dtype)) for n, t in self.trainer.export_hf()]

    def nonfinite_weights(self) -> list[str]:
        self.on_device()
        return nonfinite_names(list(self.trainer.export_hf()))

    # ---- checkpoints -------------------------------------------------------------------

    def save(self, directory: str, hf_export: bool) -> None:
        """Collective: every rank writes its shards; returns once all have (the driver then
        commits). `hf_export` adds an HF-format copy of the policy under `hf/`."""
        self.on_device()
        d = Path(directory)
        self.trainer.save(d / CHECKPOINT_DIR)
        if hf_export and self.rank == 0:
            hf_dir = d / "hf"
            shutil.copytree(self.model_dir, hf_dir, ignore=shutil.ignore_patterns(
                "*.safetensors", "*.bin", "*.safetensors.index.json"))
            save_file({k: v.contiguous().cpu() for k, v in self.named_weights()},
                      str(hf_dir / "model.safetensors"), metadata={"format": "pt"})

    def load(self, directory: str) -> None:
        self.on_device()
        self.trainer.load(Path(directory) / CHECKPOINT_DIR)

    def shutdown(self) -> None:
        self.sync.close()
        if dist.is_initialized():
            dist.destroy_process_group()
