"""The architecture facts of a Llama/Qwen2-family HF config that Megatron needs.

Kept free of megatron-core imports so that config checks and layout conversion run (and are
tested) on machines without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class UnsupportedModel(ValueError):
    """The HF config describes an architecture this backend cannot build exactly."""


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    llama3_rope_factor: float | None

    def padded_vocab(self, divisor: int, tensor_parallel: int) -> int:
        """Vocabulary rounded up so each tensor-parallel rank holds a `divisor`-aligned shard."""
        multiple = divisor * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self) -> int:
        """Parameters of the HF model (tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads + 2 * self.num_query_groups)
        attn += self.num_attention_heads * d * h
        if self.qkv_bias:
            attn += d * (self.num_attention_heads + 2 * self.num_query_groups)
        layer = attn + 3 * h * self.ffn_hidden_size + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | Any) -> ModelShape:
        """Read an HF config (a `PretrainedConfig` or its `config.json` dict).

        Raises `UnsupportedModel` naming the field for anything that would not convert exactly.
        """

        def get(key: str, default: Any = None) -> Any:
            if isinstance(config, Mapping):
                return config.get(key, default)
            return getattr(config, key, default)

        model_type = str(get("model_type", ""))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported by the megatron backend; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (or use trainer.backend: torch)"
            )
        act = get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"hidden_act {act!r}: only 'silu' (SwiGLU) is supported")
        if get("attention_bias", False) and model_type != "qwen2":
            raise UnsupportedModel(
                "attention_bias: true (bias on o_proj) is not supported; Qwen2's q/k/v bias is"
            )
        heads = int(get("num_attention_heads"))
        groups = int(get("num_key_value_heads", None) or heads)
        hidden = int(get("hidden_size"))
        if heads % groups:
            raise UnsupportedModel(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}"
            )
        head_dim = int(get("head_dim", None) or hidden // heads)
        rope_theta = get("rope_theta", None)
        scaling = get("rope_scaling", None)
        params = get("rope_parameters", None)
        if isinstance(params, Mapping):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                scaling = params
        llama3_factor = _llama3_factor(scaling)
        return cls(
            model_type=model_type,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            num_layers=int(get("num_hidden_layers")),
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=head_dim,
            ffn_hidden_size=int(get("intermediate_size")),
            norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            llama3_rope_factor=llama3_factor,
        )


def _llama3_factor(scaling: Any) -> float | None:
    """Megatron's rope scaling is Llama 3.1's with fixed low/high factors; accept only that."""
    if not scaling:
        return None
    if not isinstance(scaling, Mapping):
        raise UnsupportedModel(f"rope_scaling {scaling!r} is not a mapping")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
    if kind == "llama3" and all(float(scaling.get(k, v)) == v for k, v in expected.items()):
        return float(scaling.get("factor", 8.0))
    raise UnsupportedModel(
        f"rope_scaling {dict(scaling)!r}: only Llama 3.1-style 'llama3' scaling with "
        "low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192 is supported"
    )
