"""One way to turn text into ids and back, for the built-in char tokenizer or any HF one.

transformers picks a tokenizer class from the model type (a qwen2 config gets the
byte-level Qwen2 tokenizer), which would mangle the tiny model's character vocabulary, so
the tiny model's directory is recognised by its marker file and read directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from rljob.model.tokenizer import CharTokenizer

TINY_MARKER = "rljob_tiny.json"


class TextCodec(Protocol):
    @property
    def eos_id(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class HFCodec:
    """A transformers tokenizer behind the TextCodec interface."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def load_codec(directory: Path) -> TextCodec:
    if (directory / TINY_MARKER).exists():
        return CharTokenizer.load(directory)
    from transformers import AutoTokenizer

    return HFCodec(AutoTokenizer.from_pretrained(str(directory)))
