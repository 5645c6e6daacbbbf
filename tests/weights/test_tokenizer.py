"""weights.Tokenizer on the real Llama 2 tokenizer.model, against transformers' Llama tokenizer.

transformers 5 has a single ``LlamaTokenizer`` (the Rust ``tokenizers`` BPE; LlamaTokenizerFast
is an alias). ``from_pretrained`` on a folder holding only a ``tokenizer.model`` converts the
SentencePiece model to it, which needs protobuf. It is an independent implementation of the
same BPE, so agreement with it is worth something. Two settings are chosen to match Llama 2,
whose reference tokenizer (Meta's llama/tokenizer.py) is SentencePiece's ``encode`` on the
whole string:

* ``split_special_tokens=True``: Meta's code has no special-token strings, so "<s>" typed in
  text is the characters < s >, never id 1. By default transformers would turn it into BOS
  and (with ``legacy=True``) also prepend a "▁" to the text after it (transformers issues
  #24569, #25881). With no special tokens split out, ``legacy`` changes nothing (both values
  give the ids checked here); we pass ``legacy=False``.
* ``add_bos_token=True``: a folder without tokenizer_config.json otherwise adds no BOS.

One documented corner remains where transformers' BPE is not Llama 2: runs of spaces before
a word or at the start of the text. SentencePiece never merges the "▁" that starts a word
into the whitespace run before it ("a  b" -> ▁a ▁ ▁b), while tokenizers' BPE applies the
"▁▁" merge across that boundary (-> ▁a ▁▁ b); see transformers issue #25069. For those
strings we pin the ids Llama 2's own SentencePiece model gives.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.paths import SHARED_DATA, needs_shared
from weights import CheckpointError, SentencePieceTokenizer, Tokenizer, load_tokenizer

pytestmark = needs_shared

LLAMA2_TOKENIZER = SHARED_DATA / "llama2_tokenizer" / "tokenizer.model"
TOK512 = SHARED_DATA / "stories260K" / "tok512.model"

# Strings on which transformers' tokenizer is an exact oracle.
TEXTS = [
    "Hello world",
    "Once upon a time, there was a little girl named Lily.",
    "Crème brûlée, naïve façade, São Paulo, Zürich, Øresund, Ærøskøbing",
    "日本語のテキストと中文文本，한국어 텍스트",
    "Привет, мир! Γειά σου κόσμε. שלום עולם. مرحبا بالعالم",
    "emoji: 🤗🦙🚀👩‍👩‍👧‍👦 🇫🇷",  # byte fallback for pieces not in the vocabulary
    "digits 0123456789 3.14159 1,000,000 2024-01-31",
    "tabs\tand\nnewlines\r\n\n",
    "line one\nline two\n\nline four",
    "\n hi",
    "trailing space ",
    "trailing  ",
    "control \x00\x01\x07\x1b byte \x7f and \u00a0nbsp",
    "zero\u200bwidth \ufeffbom \U0010ffff \ue000",
    "ﬁ ligature, Å vs Å, ½ ∑ Ω ≠ ∞",  # no normalization: the ligature and both Å forms stay as they are
    "multiple     spaces\t\ttabs",
    "x" * 60,
    "<s> and </s> are literal text here",
    "a<s>b</s>c",
    "[INST] <<SYS>>\nYou are helpful.\n<</SYS>>\n\nHi [/INST]",
    "URL: https://example.com/a?b=c&d=e#f",
    "ALL CAPS AND MiXeD CaSe",
    "It's a dog's life; they're 'quoted' \"double\" “curly” ‘single’ — dash – en",
    "end with newline\n",
    "\t",
    "\n",
    "word\n\n\n\nword",
    "",
]

# Whitespace runs: Llama 2's SentencePiece ids (BOS first), with their pieces for reading.
WHITESPACE_RUNS = {
    " x": ([1, 29871, 921], ["<s>", "▁", "▁x"]),
    "a  b": ([1, 263, 29871, 289], ["<s>", "▁a", "▁", "▁b"]),
    "   three": ([1, 1678, 2211], ["<s>", "▁▁▁", "▁three"]),
    "  leading spaces": ([1, 259, 8236, 8162], ["<s>", "▁▁", "▁leading", "▁spaces"]),
    " ": ([1, 259], ["<s>", "▁▁"]),
    "  ": ([1, 1678], ["<s>", "▁▁▁"]),
    "    def f(x):\n        return x  # c\n": (
        [1, 268, 822, 285, 29898, 29916, 1125, 13, 4706, 736, 921, 29871, 396, 274, 13],
        [
            "<s>",
            "▁▁▁▁",
            "▁def",
            "▁f",
            "(",
            "x",
            "):",
            "<0x0A>",
            "▁▁▁▁▁▁▁",
            "▁return",
            "▁x",
            "▁",
            "▁#",
            "▁c",
            "<0x0A>",
        ],
    ),
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return SentencePieceTokenizer(LLAMA2_TOKENIZER)


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the reference) is in the [test] extras"
    )
    pytest.importorskip(
        "google.protobuf", reason="protobuf (in the [test] extras) converts tokenizer.model"
    )
    folder = tmp_path_factory.mktemp("llama2_tokenizer")
    os.symlink(LLAMA2_TOKENIZER, folder / "tokenizer.model")
    return transformers.LlamaTokenizer.from_pretrained(folder, add_bos_token=True, legacy=False)


def test_special_ids_and_vocab(tok: Tokenizer) -> None:
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 32000)
    assert (tok.piece(0), tok.piece(1), tok.piece(2)) == ("<unk>", "<s>", "</s>")


def test_known_ids(tok: Tokenizer) -> None:
    # Published examples: shared/data/SOURCES.md and transformers' LlamaTokenizer docstring.
    assert tok.encode("Hello world", bos=True) == [1, 15043, 3186]
    assert tok.encode("Hello world", bos=False) == [15043, 3186]
    assert tok.encode("Hello this is a test") == [1, 15043, 445, 338, 263, 1243]
    assert tok.encode("Hello world", bos=True, eos=True) == [1, 15043, 3186, 2]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    expected = hf_tok.encode(text, split_special_tokens=True)
    assert expected[:1] == [1]
    assert tok.encode(text, bos=True) == expected
    assert tok.decode(expected) == hf_tok.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("text", list(WHITESPACE_RUNS))
def test_whitespace_runs_follow_sentencepiece(tok: Tokenizer, text: str) -> None:
    ids, pieces = WHITESPACE_RUNS[text]
    got = tok.encode(text, bos=True)
    assert got == ids
    assert [tok.piece(i) for i in got] == pieces
    assert "".join(pieces[1:]) == "▁" + text.replace(" ", "▁").replace("\n", "<0x0A>")


@pytest.mark.parametrize("text", TEXTS + list(WHITESPACE_RUNS))
def test_decode_round_trip(tok: Tokenizer, text: str) -> None:
    """No normalization and byte fallback: every string comes back exactly (BOS/EOS decode to nothing)."""
    assert tok.decode(tok.encode(text, bos=False)) == text
    assert tok.decode(tok.encode(text, bos=True, eos=True)) == text


def test_load_tokenizer_from_a_checkpoint_folder(tmp_path: Path) -> None:
    os.symlink(LLAMA2_TOKENIZER, tmp_path / "tokenizer.model")
    loaded = load_tokenizer(tmp_path)
    assert loaded.serialized() == LLAMA2_TOKENIZER.read_bytes()
    assert loaded.encode("Hello world") == [1, 15043, 3186]
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        CheckpointError, match="has no tokenizer: neither a SentencePiece tokenizer.model nor a "
    ):
        load_tokenizer(tmp_path / "empty")


def test_tok512() -> None:
    """The stories260K tokenizer (SOURCES.md gives this example)."""
    tok = SentencePieceTokenizer(TOK512)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 512)
    assert tok.encode("Once upon a time", bos=True) == [1, 403, 407, 261, 378]


def test_the_model_without_its_dummy_prefix_encodes_text_as_it_follows_a_special_token(
    tok: Tokenizer,
) -> None:
    """The wire-format edit of weights.tokenizer.without_dummy_prefix: the same pieces, no space in front
    ("▁Hello" becomes "Hello"'s own pieces), and the model's other settings kept (byte fallback)."""
    import sentencepiece as spm

    from weights.tokenizer import without_dummy_prefix

    bare = spm.SentencePieceProcessor(
        model_proto=without_dummy_prefix(LLAMA2_TOKENIZER.read_bytes())
    )
    assert bare.vocab_size() == tok.vocab_size
    assert [tok.piece(i) for i in tok.encode("Hello world", bos=False)] == ["▁Hello", "▁world"]
    assert [bare.id_to_piece(i) for i in bare.encode("Hello world")] == ["Hello", "▁world"]
    assert [bare.id_to_piece(i) for i in bare.encode("[INST]")][0] == "["
    assert bare.decode(bare.encode("né 🙂")) == "né 🙂"
