"""The char tokenizer round-trips and its files load in the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from rljob.model.text_codec import load_codec
from rljob.model.tiny_model import build_tiny, write_tiny
from rljob.model.tokenizer import CharTokenizer
from rljob_api.spec import TinyModel

pytestmark = pytest.mark.unit


def test_roundtrip_and_specials() -> None:
    tok = CharTokenizer("ba+1")
    assert len(tok) == 3 + 4
    ids = tok.encode("1+ab")
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == "1+ab"
    assert tok.encode("z") == [tok.unk_id]


def test_saved_files_give_the_same_ids_in_tokenizers(tmp_path: Path) -> None:
    tok = CharTokenizer("0123456789+= \n")
    tok.save(tmp_path)
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "12+ 7=\n9"
    assert hf.encode(text).ids == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text
    assert CharTokenizer.load(tmp_path).vocab == tok.vocab


def test_tiny_model_is_seeded_and_in_hf_format(tmp_path: Path) -> None:
    a, _ = build_tiny(TinyModel(), "abc", seed=7)
    b, _ = build_tiny(TinyModel(), "abc", seed=7)
    c, _ = build_tiny(TinyModel(), "abc", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all((sa[k] == sb[k]).all() for k in sa)
    assert not all((sa[k] == sc[k]).all() for k in sa)
    d = write_tiny(tmp_path / "m", TinyModel(architecture="llama"), "abc", 1, "float32")
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert load_codec(d).encode("cab") == CharTokenizer("abc").encode("cab")


def test_bad_tiny_shape_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"spec\.model\.tiny\.hiddenSize"):
        build_tiny(TinyModel(hidden_size=30, num_heads=4), "ab", 0)
