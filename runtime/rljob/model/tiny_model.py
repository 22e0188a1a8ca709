"""The built-in tiny model: a real transformers architecture, random init, char tokenizer.

It is written in HF format (safetensors, config.json, tokenizer files) so every other part
(trainer, hf engine, SGLang, the disk weight sync) loads it exactly like a hub checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.utils import logging as transformers_logging

from rljob.model.dtypes import torch_dtype
from rljob.model.staged_dir import staged
from rljob.model.text_codec import TINY_MARKER
from rljob.model.tokenizer import CharTokenizer
from rljob_api.rules import TINY_SHAPE_MESSAGE
from rljob_api.spec import TinyModel

MAX_POSITIONS = 512


def tiny_config(shape: TinyModel, tokenizer: CharTokenizer) -> PretrainedConfig:
    """The transformers config of `spec.model.tiny` for this vocabulary."""
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_heads,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "pad_token_id": tokenizer.pad_id,
        "eos_token_id": tokenizer.eos_id,
        "bos_token_id": None,
    }
    if shape.architecture == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(**common)


def build_tiny(shape: TinyModel, alphabet: str, seed: int) -> tuple[PreTrainedModel, CharTokenizer]:
    if shape.hidden_size % (2 * shape.num_heads):  # refused at admission too (rules.py)
        raise ValueError(f"{TINY_SHAPE_MESSAGE} (got hiddenSize {shape.hidden_size}, "
                         f"numHeads {shape.num_heads})")
    tokenizer = CharTokenizer(alphabet)
    config = tiny_config(shape, tokenizer)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model_cls: type[PreTrainedModel] = (
        LlamaForCausalLM if shape.architecture == "llama" else Qwen2ForCausalLM
    )
    model = model_cls(config)
    torch.random.set_rng_state(generator_state)
    return model, tokenizer


def write_tiny(directory: Path, shape: TinyModel, alphabet: str, seed: int, dtype: str) -> Path:
    """Create the tiny model under `directory` once; an existing one is reused unchanged.

    Reuse matters for resume: the reference policy is this initial model, so it must be
    the same bytes on every restart.
    """
    if (directory / "config.json").exists():
        return directory
    with staged(directory, last_file="config.json") as tmp:
        model, tokenizer = build_tiny(shape, alphabet, seed)
        torch.nn.Module.to(model, torch_dtype(dtype))
        transformers_logging.disable_progress_bar()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save(tmp)
        (tmp / TINY_MARKER).write_text(json.dumps({"seed": seed, "alphabet": alphabet}))
    return directory
