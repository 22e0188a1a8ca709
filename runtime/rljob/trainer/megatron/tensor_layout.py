"""HF (Llama/Qwen2 family) <-> megatron-core GPTModel tensor layouts, as pure functions.

Megatron fuses q/k/v into one `linear_qkv` whose rows are grouped per query group
(`[q heads of group g, k_g, v_g]` for each group g), fuses the SwiGLU `gate` and `up`
projections into `linear_fc1` (`[gate; up]`), pads the vocabulary to a multiple of
`divisor * tensor_parallel`, and shards tensors over tensor-parallel ranks. Every function here
only slices, concatenates and reshapes, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from rljob.trainer.megatron.shape import ModelShape

COLUMN_PARALLEL = ("self_attention.linear_qkv", "mlp.linear_fc1")
ROW_PARALLEL = ("self_attention.linear_proj", "mlp.linear_fc2")
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape
) -> torch.Tensor:
    """HF q/k/v projections (weights `[out, in]` or biases `[out]`) -> Megatron `linear_qkv`."""
    g, d = shape.num_query_groups, shape.head_dim
    per_group = shape.num_attention_heads // g
    tail = q.shape[1:]
    qg = q.reshape(g, per_group * d, *tail)
    kg = k.reshape(g, d, *tail)
    vg = v.reshape(g, d, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def split_qkv(
    qkv: torch.Tensor, shape: ModelShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron `linear_qkv` -> HF q/k/v projections (inverse of `fuse_qkv`)."""
    g, d = shape.num_query_groups, shape.head_dim
    per_group = shape.num_attention_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per_group + 2) * d, *tail)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate, up


def pad_vocab(weight: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """Append zero rows up to `padded_vocab`; the log-prob path never reads them."""
    extra = padded_vocab - weight.shape[0]
    if extra < 0:
        raise ValueError(f"padded vocab {padded_vocab} is smaller than {weight.shape[0]}")
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])], dim=0)


def strip_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return weight[:vocab_size]


def _layer_pairs(hf: str, mg: str) -> tuple[str, str]:
    return f"model.layers.{{}}.{hf}", f"decoder.layers.{{}}.{mg}"


_ONE_TO_ONE = [
    _layer_pairs("input_layernorm.weight", "input_layernorm.weight"),
    _layer_pairs("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    _layer_pairs("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    _layer_pairs("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
]


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    shape: ModelShape,
    padded_vocab: int,
    layers: Iterable[tuple[int, int]] | None = None,
    *,
    pre_process: bool = True,
    post_process: bool = True,
) -> dict[str, torch.Tensor]:
    """HF state dict -> full (unsharded) Megatron state dict of one pipeline stage.

    `layers` maps `(global_index, local_index)`; by default all layers, numbered as in HF.
    `pre_process` / `post_process` select the embedding / final norm and output layer.
    """
    pairs = layers if layers is not None else [(i, i) for i in range(shape.num_layers)]
    out: dict[str, torch.Tensor] = {}
    if pre_process:
        out["embedding.word_embeddings.weight"] = pad_vocab(
            hf["model.embed_tokens.weight"], padded_vocab
        )
    for gi, li in pairs:
        for hf_name, mg_name in _ONE_TO_ONE:
            out[mg_name.format(li)] = hf[hf_name.format(gi)]
        attn = f"model.layers.{gi}.self_attn"
        qkv = f"decoder.layers.{li}.self_attention.linear_qkv"
        out[f"{qkv}.weight"] = fuse_qkv(
            hf[f"{attn}.q_proj.weight"], hf[f"{attn}.k_proj.weight"], hf[f"{attn}.v_proj.weight"],
            shape,
        )
        if shape.qkv_bias:
            out[f"{qkv}.bias"] = fuse_qkv(
                hf[f"{attn}.q_proj.bias"], hf[f"{attn}.k_proj.bias"], hf[f"{attn}.v_proj.bias"],
                shape,
            )
        mlp = f"model.layers.{gi}.mlp"
        out[f"decoder.layers.{li}.mlp.linear_fc1.weight"] = fuse_gate_up(
            hf[f"{mlp}.gate_proj.weight"], hf[f"{mlp}.up_proj.weight"]
        )
    if post_process:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not shape.tie_word_embeddings:
            out["output_layer.weight"] = pad_vocab(hf["lm_head.weight"], padded_vocab)
        elif not pre_process:
            # A last pipeline stage without the embedding holds its own copy of the tied weight.
            out["output_layer.weight"] = pad_vocab(hf["model.embed_tokens.weight"], padded_vocab)
    return out


def megatron_to_hf(
    mg: Mapping[str, torch.Tensor],
    shape: ModelShape,
    layers: Iterable[tuple[int, int]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (unsharded) Megatron tensors of one stage -> HF-named tensors, padding stripped.

    Yields lazily so weight sync can stream tensors into buckets. Tensors absent from `mg`
    (another pipeline stage's) are skipped.
    """
    pairs = layers if layers is not None else [(i, i) for i in range(shape.num_layers)]
    if "embedding.word_embeddings.weight" in mg:
        yield "model.embed_tokens.weight", strip_vocab(
            mg["embedding.word_embeddings.weight"], shape.vocab_size
        )
    for gi, li in pairs:
        for hf_name, mg_name in _ONE_TO_ONE:
            yield hf_name.format(gi), mg[mg_name.format(li)]
        qkv = f"decoder.layers.{li}.self_attention.linear_qkv"
        attn = f"model.layers.{gi}.self_attn"
        q, k, v = split_qkv(mg[f"{qkv}.weight"], shape)
        yield f"{attn}.q_proj.weight", q
        yield f"{attn}.k_proj.weight", k
        yield f"{attn}.v_proj.weight", v
        if shape.qkv_bias:
            qb, kb, vb = split_qkv(mg[f"{qkv}.bias"], shape)
            yield f"{attn}.q_proj.bias", qb
            yield f"{attn}.k_proj.bias", kb
            yield f"{attn}.v_proj.bias", vb
        gate, up = split_gate_up(mg[f"decoder.layers.{li}.mlp.linear_fc1.weight"])
        yield f"model.layers.{gi}.mlp.gate_proj.weight", gate
        yield f"model.layers.{gi}.mlp.up_proj.weight", up
    if "decoder.final_layernorm.weight" in mg:
        yield "model.norm.weight", mg["decoder.final_layernorm.weight"]
    if "output_layer.weight" in mg and not shape.tie_word_embeddings:
        yield "lm_head.weight", strip_vocab(mg["output_layer.weight"], shape.vocab_size)


def tp_split_dim(name: str) -> int | None:
    """Dimension a Megatron tensor is sharded along under tensor parallelism (None: replicated)."""
    if name in VOCAB_PARALLEL or any(name.endswith(f"{p}.weight") for p in COLUMN_PARALLEL):
        return 0
    if any(name.endswith(f"{p}.bias") for p in COLUMN_PARALLEL):
        return 0
    if any(name.endswith(f"{p}.weight") for p in ROW_PARALLEL):
        return 1
    return None


def tp_shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This tensor-parallel rank's shard of a full Megatron tensor.

    `linear_fc1` is `[gate; up]` on every rank, so gate and up are sharded separately; the
    grouped `linear_qkv` rows shard contiguously (whole query groups per rank).
    """
    dim = tp_split_dim(name)
    if dim is None or size == 1:
        return full
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = split_gate_up(full)
        return fuse_gate_up(gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank])
    return full.chunk(size, dim)[rank]


def tp_unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Full Megatron tensor from every tensor-parallel rank's shard (inverse of `tp_shard`)."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [split_gate_up(s) for s in shards]
        return fuse_gate_up(torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]))
    return torch.cat(shards, dim=dim)
