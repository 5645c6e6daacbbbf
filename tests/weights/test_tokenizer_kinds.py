"""One tokenizer interface for both kinds (weights/tokenizer.py): the same vocabulary read from a
SentencePiece tokenizer.model and from the tokenizer.json transformers converts it to has one
fingerprint, so a draft and a target speculate together whichever file each ships; another
vocabulary of the same size, or another kind's vocabulary, is refused in one line."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from speculative import PairMismatchError, check_pair
from tests.support.checkpoints import LLAMA2_TOKENIZER, llama31_tokenizer_json
from tests.support.paths import TARGET, needs_shared
from weights import JsonTokenizer, SentencePieceTokenizer, load_tokenizer


def pair(vocab: int) -> tuple[SimpleNamespace, SimpleNamespace]:
    return SimpleNamespace(config=SimpleNamespace(vocab_size=vocab)), SimpleNamespace(
        config=SimpleNamespace(vocab_size=vocab)
    )


@needs_shared
def test_a_sentencepiece_model_and_its_tokenizer_json_are_one_vocabulary(tmp_path: Path) -> None:
    transformers = pytest.importorskip(
        "transformers", reason="transformers converts tokenizer.model"
    )
    os.symlink(LLAMA2_TOKENIZER, tmp_path / "tokenizer.model")
    converted = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    out = tmp_path / "json"
    converted.save_pretrained(str(out))
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.model").is_file()
    sentencepiece, from_json = load_tokenizer(tmp_path), load_tokenizer(out)
    assert (sentencepiece.kind, from_json.kind) == ("sentencepiece", "tokenizer.json")
    assert sentencepiece.fingerprint() == from_json.fingerprint()
    check_pair(*pair(32000), sentencepiece, from_json)
    assert (
        from_json.encode("Hello world", bos=False)
        == sentencepiece.encode("Hello world", bos=False)
        == [15043, 3186]
    )
    # the BOS that each adds: the converted file's post-processor adds none, as transformers' tokenizer of it
    assert (
        from_json.encode("Hello world")
        == transformers.AutoTokenizer.from_pretrained(str(out))("Hello world")["input_ids"]
        == [15043, 3186]
    )
    assert sentencepiece.encode("Hello world") == [
        1,
        15043,
        3186,
    ]  # Meta's reference: BOS, then the text


@needs_shared
def test_another_vocabulary_is_refused_in_one_line() -> None:
    llama2 = SentencePieceTokenizer(LLAMA2_TOKENIZER)
    shipped = load_tokenizer(TARGET)
    llama3 = JsonTokenizer(
        llama31_tokenizer_json(), {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    )
    for a, b in ((llama2, llama3), (shipped, llama2), (llama3, shipped)):
        with pytest.raises(PairMismatchError) as error:
            check_pair(*pair(32000), a, b)
        assert "\n" not in str(error.value)
    assert (
        llama3.fingerprint()
        == JsonTokenizer(
            llama31_tokenizer_json(), {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
        ).fingerprint()
    )


def test_a_tokenizer_json_that_does_not_parse_is_one_line(tmp_path: Path) -> None:
    from weights import CheckpointError

    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(
        CheckpointError, match="not a tokenizer.json that the tokenizers library reads"
    ) as error:
        load_tokenizer(tmp_path)
    assert "\n" not in str(error.value)
    (tmp_path / "tokenizer.json").write_text(llama31_tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<|no such token|>"}')
    with pytest.raises(
        CheckpointError,
        match="bos_token '<\\|no such token\\|>' of tokenizer_config.json is not in",
    ):
        load_tokenizer(tmp_path)
