"""Build a megatron-core GPTModel from a `ModelShape` and move HF weights in and out of it.

The layer spec is megatron-core's own ("local", no Transformer Engine) with the core attention
swapped for PyTorch's fused `scaled_dot_product_attention` (flash / memory-efficient kernels),
so the model needs nothing beyond megatron-core and PyTorch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from rljob.trainer.megatron.shape import ModelShape
from rljob.trainer.megatron.tensor_layout import (
    hf_to_megatron,
    megatron_to_hf,
    tp_shard,
    tp_unshard,
)

VOCAB_DIVISOR = 128
"""Megatron-LM's default `make_vocab_size_divisible_by`."""


class SdpaAttention(DotProductAttention):  # type: ignore[misc]
    """Causal core attention through `F.scaled_dot_product_attention` (GQA without repeats)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None or packed_seq_params:
            raise ValueError(
                "SdpaAttention is causal over right-padded rows: pass no attention mask, "
                "bias or packed sequences"
            )
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def layer_spec() -> ModuleSpec:
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    attention = spec.submodules.self_attention
    attention.submodules = dataclasses.replace(attention.submodules, core_attention=SdpaAttention)
    return spec


def transformer_config(
    shape: ModelShape, dtype: torch.dtype, overrides: Mapping[str, Any]
) -> TransformerConfig:
    """TransformerConfig for `shape`; `overrides` (from `megatronArgs`) win over defaults."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    fields = {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "ffn_hidden_size": shape.ffn_hidden_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_query_groups": shape.num_query_groups,
        "kv_channels": shape.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": shape.norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": shape.qkv_bias,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        # RL rows differ in length per micro-batch; only pipeline send/recv needs to know.
        # (megatron-core ties this flag to the MoE dispatcher check, hence alltoall.)
        "variable_seq_lengths": pp > 1,
        "moe_token_dispatcher_type": "alltoall" if pp > 1 else "allgather",
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
    }
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_model(shape: ModelShape, config: TransformerConfig) -> GPTModel:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(),
        vocab_size=shape.padded_vocab(VOCAB_DIVISOR, tp),
        max_sequence_length=shape.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        rope_scaling=shape.llama3_rope_factor is not None,
        rope_scaling_factor=shape.llama3_rope_factor or 8.0,
        parallel_output=True,
    )


def _layer_pairs(model: GPTModel) -> list[tuple[int, int]]:
    offset = get_transformer_layer_offset(model.config)
    return [(offset + i, i) for i in range(len(model.decoder.layers))]


def _parameters(model: GPTModel) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def load_hf_weights(model: GPTModel, hf: Mapping[str, torch.Tensor], shape: ModelShape) -> None:
    """Copy HF-named full tensors into this rank's (pipeline stage, tensor shard) parameters."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    full = hf_to_megatron(
        hf,
        shape,
        shape.padded_vocab(VOCAB_DIVISOR, tp_size),
        _layer_pairs(model),
        pre_process=model.pre_process,
        post_process=model.post_process,
    )
    own = _parameters(model)
    missing = sorted(set(own) - set(full))
    if missing:
        raise KeyError(f"HF weights give no value for Megatron parameters {missing[:5]}")
    with torch.no_grad():
        for name, param in own.items():
            shard = tp_shard(name, full[name], tp_rank, tp_size)
            if shard.shape != param.shape:
                raise ValueError(
                    f"{name}: HF weights give shape {tuple(shard.shape)}, model has "
                    f"{tuple(param.shape)}"
                )
            param.copy_(shard)


def export_hf_weights(model: GPTModel, shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's weights in HF names, full tensors (tensor shards gathered).

    Every tensor-parallel rank yields the same tensors; vocabulary padding is stripped.
    """
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    full: dict[str, torch.Tensor] = {}
    for name, shard in _parameters(model).items():
        if tp_size == 1:
            full[name] = shard.detach()
            continue
        shards = [torch.empty_like(shard) for _ in range(tp_size)]
        dist.all_gather(shards, shard.detach().contiguous(), group=group)
        full[name] = tp_unshard(name, shards)
    yield from megatron_to_hf(full, shape, _layer_pairs(model))
