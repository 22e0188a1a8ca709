"""HF <-> Megatron tensor layouts: bit-exact round trips and the meaning of the fused layouts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rljob.trainer.megatron.shape import ModelShape, UnsupportedModel
from rljob.trainer.megatron.tensor_layout import (
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    tp_shard,
    tp_unshard,
)

pytestmark = pytest.mark.unit

SMALL: dict[str, Any] = {
    "vocab_size": 301,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _model(kind: str, tied: bool) -> tuple[dict[str, torch.Tensor], ModelShape]:
    torch.manual_seed(0)
    if kind == "qwen2":
        model: torch.nn.Module = Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=tied))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=tied))
    state = dict(model.state_dict())
    if tied:
        state.pop("lm_head.weight", None)
    return state, ModelShape.from_hf(model.config)


@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("qwen2", True), ("qwen2", False)])
def test_hf_megatron_hf_is_bit_exact(kind: str, tied: bool) -> None:
    hf, shape = _model(kind, tied)
    padded = shape.padded_vocab(128, 2)
    assert padded == 512
    mg = hf_to_megatron(hf, shape, padded)
    assert mg["embedding.word_embeddings.weight"].shape[0] == padded
    assert ("output_layer.weight" in mg) is not tied
    back = dict(megatron_to_hf(mg, shape))
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_rows_follow_megatron_query_groups() -> None:
    """Megatron splits x @ qkv.T per group into [q heads of the group, k, v]."""
    hf, shape = _model("qwen2", False)
    mg = hf_to_megatron(hf, shape, 384)
    x = torch.randn(5, shape.hidden_size)
    mixed = x @ mg["decoder.layers.1.self_attention.linear_qkv.weight"].t()
    mixed = mixed + mg["decoder.layers.1.self_attention.linear_qkv.bias"]
    g, d = shape.num_query_groups, shape.head_dim
    per = shape.num_attention_heads // g
    q, k, v = torch.split(mixed.view(5, g, (per + 2) * d), [per * d, d, d], dim=-1)
    attn = "model.layers.1.self_attn"
    ref_q = x @ hf[f"{attn}.q_proj.weight"].t() + hf[f"{attn}.q_proj.bias"]
    ref_k = x @ hf[f"{attn}.k_proj.weight"].t() + hf[f"{attn}.k_proj.bias"]
    ref_v = x @ hf[f"{attn}.v_proj.weight"].t() + hf[f"{attn}.v_proj.bias"]
    # HF query head h attends with kv head h // per: the same grouping.
    torch.testing.assert_close(q.reshape(5, -1), ref_q)
    torch.testing.assert_close(k.reshape(5, -1), ref_k)
    torch.testing.assert_close(v.reshape(5, -1), ref_v)


def test_fc1_is_gate_then_up() -> None:
    hf, shape = _model("llama", False)
    mg = hf_to_megatron(hf, shape, 384)
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[: shape.ffn_hidden_size], hf["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[shape.ffn_hidden_size :], hf["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_shards_round_trip(tp: int) -> None:
    hf, shape = _model("qwen2", False)
    mg = hf_to_megatron(hf, shape, shape.padded_vocab(128, tp))
    for name, full in mg.items():
        shards = [tp_shard(name, full, r, tp) for r in range(tp)]
        assert torch.equal(tp_unshard(name, shards), full), name
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    if tp == 2:
        ffn = shape.ffn_hidden_size
        rank1 = tp_shard(fc1, mg[fc1], 1, 2)
        gate = hf["model.layers.0.mlp.gate_proj.weight"]
        assert torch.equal(rank1[: ffn // 2], gate[ffn // 2 :])
        proj = "decoder.layers.0.self_attention.linear_proj.weight"
        assert tp_shard(proj, mg[proj], 0, 2).shape[1] == shape.hidden_size // 2


def test_pipeline_stage_layers_renumbered_and_tied_output_copied() -> None:
    hf, shape = _model("qwen2", True)
    mg = hf_to_megatron(hf, shape, 384, [(2, 0)], pre_process=False, post_process=True)
    assert "embedding.word_embeddings.weight" not in mg
    assert torch.equal(
        mg["decoder.layers.0.input_layernorm.weight"], hf["model.layers.2.input_layernorm.weight"]
    )
    output = mg["output_layer.weight"]
    assert torch.equal(output[: shape.vocab_size], hf["model.embed_tokens.weight"])
    back = dict(megatron_to_hf(mg, shape, [(2, 0)]))
    assert "lm_head.weight" not in back and "model.layers.2.mlp.up_proj.weight" in back


def test_fuse_qkv_rejects_nothing_silently_on_bad_shape() -> None:
    _, shape = _model("llama", False)
    with pytest.raises(RuntimeError):
        fuse_qkv(torch.zeros(7, 3), torch.zeros(16, 3), torch.zeros(16, 3), shape)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ],
)
def test_unsupported_configs_name_the_field(change: dict[str, object], field: str) -> None:
    config = {"model_type": "llama", **SMALL, **change}
    with pytest.raises(UnsupportedModel, match=field):
        ModelShape.from_hf(config)


def test_parameter_count_matches_transformers() -> None:
    for kind, tied in [("llama", False), ("qwen2", True)]:
        hf, shape = _model(kind, tied)
        assert shape.num_parameters() == sum(t.numel() for t in hf.values())
