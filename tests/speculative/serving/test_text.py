"""The text helpers beside the tokenizer (speculative/serving/text.py), on the shipped tokenizer:
the chat template by hand, and streaming that hands out exactly the text of the whole sequence,
never half a character."""

from __future__ import annotations

import pytest

from speculative.serving.text import TextStream, continuation_text, encode_prompt
from weights import load_tokenizer
from weights.registry import WEIGHTS_DIR


@pytest.fixture(scope="module")
def tokenizer():
    if not (WEIGHTS_DIR / "tiny-target" / "tokenizer.model").is_file():
        pytest.skip("the shipped tokenizer is absent")
    return load_tokenizer("tiny-target")


def test_the_chat_template_by_hand(tokenizer) -> None:
    assert encode_prompt(tokenizer, "Tell me a story.") == tokenizer.encode("Tell me a story.", bos=True)
    assert encode_prompt(tokenizer, " Hi. ", chat=True) == tokenizer.encode("[INST] Hi. [/INST]", bos=True)
    with_system = encode_prompt(tokenizer, "Hi.", chat=True, system=" Be brief. ")
    assert with_system == tokenizer.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi. [/INST]", bos=True)


def test_a_text_stream_hands_out_the_whole_text_and_never_half_a_character(tokenizer) -> None:
    prompt = tokenizer.encode("Once upon a time")
    new = tokenizer.encode(" the café said 🙂 and Ünal smiled.", bos=False)
    assert any(tokenizer.piece(t).startswith("<0x") for t in new)  # byte-fallback pieces are in there
    stream = TextStream(tokenizer, prompt)
    pieces = [stream.add(token) for token in new]
    assert "" in pieces  # a character's first bytes wait for the rest
    assert not any("\ufffd" in piece for piece in pieces)
    expected = tokenizer.decode(prompt + new)[len(tokenizer.decode(prompt)):]
    assert "".join(pieces) + stream.finish() == expected == continuation_text(tokenizer, prompt, new)
    assert stream.finish() == ""  # nothing twice


def test_finish_hands_out_what_never_completed(tokenizer) -> None:
    prompt = tokenizer.encode("Once upon a time")
    first_byte = tokenizer.sp.piece_to_id("<0xC3>")  # the first of the two bytes of "é"
    stream = TextStream(tokenizer, prompt)
    assert stream.add(first_byte) == ""
    rest = stream.finish()
    assert rest and rest == tokenizer.decode(prompt + [first_byte])[len(tokenizer.decode(prompt)):]
