"""Character tokenizer of the built-in tiny model.

One token per character keeps the vocabulary tiny (a random model then lands on the
task's alphabet often enough for RL to find a signal), and the files it writes are a
standard `tokenizers` JSON, so `transformers.AutoTokenizer` (and SGLang) load the same
vocabulary from the model directory.
"""

from __future__ import annotations

import json
from pathlib import Path

PAD = "<pad>"
EOS = "<eos>"
UNK = "<unk>"
SPECIALS = (PAD, EOS, UNK)
TOKENIZER_FILE = "tokenizer.json"


class CharTokenizer:
    """Maps each character of a fixed alphabet to one id; ids 0-2 are pad, eos and unk."""

    def __init__(self, alphabet: str) -> None:
        chars = sorted(set(alphabet))
        self.vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIALS)}
        for ch in chars:
            self.vocab[ch] = len(self.vocab)
        self.inverse = {i: tok for tok, i in self.vocab.items()}

    @property
    def pad_id(self) -> int:
        return self.vocab[PAD]

    @property
    def eos_id(self) -> int:
        return self.vocab[EOS]

    @property
    def unk_id(self) -> int:
        return self.vocab[UNK]

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return [self.vocab.get(ch, self.unk_id) for ch in text]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, dropping special tokens (as `skip_special_tokens=True` does)."""
        return "".join(
            self.inverse[i] for i in ids if i in self.inverse and self.inverse[i] not in SPECIALS
        )

    def alphabet(self) -> str:
        return "".join(tok for tok in self.vocab if tok not in SPECIALS)

    def save(self, directory: Path) -> None:
        """Write `tokenizer.json` (tokenizers format) and `tokenizer_config.json`."""
        added = [
            {"id": self.vocab[tok], "content": tok, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for tok in SPECIALS
        ]
        spec = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {
                "type": "Split",
                "pattern": {"Regex": "[\\s\\S]"},
                "behavior": "Isolated",
                "invert": False,
            },
            "post_processor": None,
            "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": self.vocab, "unk_token": UNK},
        }
        (directory / TOKENIZER_FILE).write_text(json.dumps(spec, ensure_ascii=False, indent=1))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "pad_token": PAD,
            "eos_token": EOS,
            "unk_token": UNK,
            "model_max_length": 4096,
            "clean_up_tokenization_spaces": False,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

    @classmethod
    def load(cls, directory: Path) -> CharTokenizer:
        """The tokenizer saved by `save`; refuses a tokenizer.json that is not character-level."""
        spec = json.loads((directory / TOKENIZER_FILE).read_text())
        vocab: dict[str, int] = spec["model"]["vocab"]
        if spec["model"].get("type") != "WordLevel" or any(
            len(tok) != 1 for tok in vocab if tok not in SPECIALS
        ):
            raise ValueError(f"{directory / TOKENIZER_FILE} is not a character tokenizer")
        tok = cls("")
        tok.vocab = dict(vocab)
        tok.inverse = {i: t for t, i in tok.vocab.items()}
        return tok
