"""Tokenizer.token_bytes: the bytes each token stands for, whatever the tokenizer's kind.

The oracle is the text itself: the bytes of a text's tokens, joined, must be the text's UTF-8 bytes
(after SentencePiece's dummy-prefix space), including characters that byte-level BPE or byte
fallback split over several tokens; and a token that decodes alone to whole characters must be
what the tokenizers library decodes it to. Serving's log-probabilities report these
(speculative/serving/streaming.py: token_text)."""

from __future__ import annotations

import lzma

import pytest

from tests.support.checkpoints import DATA, LLAMA2_TOKENIZER, llama31_tokenizer_json
from weights import load_tokenizer
from weights.tokenizer import JsonTokenizer, SentencePieceTokenizer

TEXTS = ["The capital of France is Paris.", "naïve café, 🙂 and 日本語\n\ttabs", "  two spaces"]


def smollm2() -> JsonTokenizer:
    text = lzma.decompress((DATA / "smollm2-135m-instruct" / "tokenizer.json.xz").read_bytes())
    return JsonTokenizer(text.decode(), {"eos_token": "<|im_end|>"})


def llama31() -> JsonTokenizer:
    return JsonTokenizer(llama31_tokenizer_json(), {"bos_token": "<|begin_of_text|>"})


@pytest.mark.parametrize("make", [smollm2, llama31], ids=["smollm2", "llama-3.1"])
def test_byte_level_tokens_join_to_the_text(make) -> None:
    tokenizer = make()
    for text in TEXTS:
        ids = tokenizer.encode(text, bos=False)
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode(), text
        for i in ids:  # a token of whole characters decodes alone as the library decodes it
            alone = tokenizer.backend.decode([i])
            if "\ufffd" not in alone:
                assert tokenizer.token_bytes(i) == alone.encode()
    capital = tokenizer.encode(" capital", bos=False)
    assert [tokenizer.token_bytes(i) for i in capital] == [b" capital"]
    assert tokenizer.piece(capital[0]) == "Ġcapital"  # what the server used to report


def test_special_tokens_are_their_own_text() -> None:
    tokenizer = smollm2()
    assert tokenizer.token_bytes(tokenizer.eos_id) == b"<|im_end|>"


def test_sentencepiece_tokens_join_to_the_text() -> None:
    tokenizer = load_tokenizer("tiny-target")
    assert isinstance(tokenizer, SentencePieceTokenizer)
    text = "The capital of France is Paris."
    ids = tokenizer.encode(text, bos=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == (" " + text).encode()
    assert tokenizer.token_bytes(tokenizer.bos_id) == b"<s>"


@pytest.mark.skipif(not LLAMA2_TOKENIZER.is_file(), reason="../shared/data is absent")
def test_byte_fallback_pieces_are_their_bytes() -> None:
    """Llama-2's SentencePiece model spells characters outside its vocabulary as byte pieces
    (<0xF0><0x9F>...): each is its one byte, and they join to the character."""
    tokenizer = SentencePieceTokenizer(LLAMA2_TOKENIZER)
    text = "smile 🙂 日本語"
    ids = tokenizer.encode(text, bos=False)
    assert any(tokenizer.piece(i).startswith("<0x") for i in ids)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == (" " + text).encode()
