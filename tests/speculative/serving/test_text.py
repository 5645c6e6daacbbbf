"""The text helpers beside the tokenizer (speculative/serving/text.py), on the shipped tokenizer:
the chat template by hand, and streaming that hands out exactly the text of the whole sequence,
never half a character."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative.serving.text import (
    LLAMA2_CHAT,
    NoChatTemplateError,
    StopStrings,
    TextStream,
    continuation_text,
    encode_prompt,
)
from weights import load_tokenizer
from weights.registry import WEIGHTS_DIR


@pytest.fixture(scope="module")
def tokenizer():
    if not (WEIGHTS_DIR / "tiny-target" / "tokenizer.model").is_file():
        pytest.skip("the shipped tokenizer is absent")
    return load_tokenizer("tiny-target")


def test_the_llama2_chat_format_by_hand(tokenizer, monkeypatch) -> None:
    """The shipped target is a base model (no template): a chat is refused in one line. Given Llama-2's
    format, as a Llama-2 chat model without a template is, the prompt is Meta's."""
    with pytest.raises(NoChatTemplateError, match="tiny-target has no chat template") as error:
        encode_prompt(tokenizer, "Hi.", chat=True)
    assert "\n" not in str(error.value)
    monkeypatch.setattr(tokenizer, "chat", LLAMA2_CHAT)
    assert encode_prompt(tokenizer, "Tell me a story.") == tokenizer.encode(
        "Tell me a story.", bos=True
    )
    assert encode_prompt(tokenizer, " Hi. ", chat=True) == tokenizer.encode(
        "[INST] Hi. [/INST]", bos=True
    )
    with_system = encode_prompt(tokenizer, "Hi.", chat=True, system=" Be brief. ")
    assert with_system == tokenizer.encode(
        "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi. [/INST]", bos=True
    )


def test_a_text_stream_hands_out_the_whole_text_and_never_half_a_character(tokenizer) -> None:
    prompt = tokenizer.encode("Once upon a time")
    new = tokenizer.encode(" the café said 🙂 and Ünal smiled.", bos=False)
    # byte-fallback pieces are in there
    assert any(tokenizer.piece(t).startswith("<0x") for t in new)
    stream = TextStream(tokenizer, prompt)
    pieces = [stream.add(token) for token in new]
    assert "" in pieces  # a character's first bytes wait for the rest
    assert not any("\ufffd" in piece for piece in pieces)
    expected = tokenizer.decode(prompt + new)[len(tokenizer.decode(prompt)) :]
    assert (
        "".join(pieces) + stream.finish() == expected == continuation_text(tokenizer, prompt, new)
    )
    assert stream.finish() == ""  # nothing twice


def test_finish_hands_out_what_never_completed(tokenizer) -> None:
    prompt = tokenizer.encode("Once upon a time")
    first_byte = tokenizer.sp.piece_to_id("<0xC3>")  # the first of the two bytes of "é"
    stream = TextStream(tokenizer, prompt)
    assert stream.add(first_byte) == ""
    rest = stream.finish()
    assert rest and rest == tokenizer.decode(prompt + [first_byte])[len(tokenizer.decode(prompt)) :]


@settings(max_examples=60, derandomize=True, deadline=None)
@given(new=st.lists(st.integers(3, 2047), min_size=1, max_size=40), prompt_len=st.integers(0, 6))
def test_any_tokens_stream_to_the_whole_text(tokenizer, new: list[int], prompt_len: int) -> None:
    """Random pieces (byte-fallback ones, word starts, digits) after a prompt of any length: the
    pieces handed out and finish add up to the text of the whole sequence after the prompt's."""
    prompt = tokenizer.encode("Once upon a time, there was a dog")[:prompt_len]
    stream = TextStream(tokenizer, prompt)
    pieces = [stream.add(token) for token in new]
    expected = tokenizer.decode(prompt + new)[len(tokenizer.decode(prompt)) :]
    assert "".join(pieces) + stream.finish() == expected


def test_each_token_decodes_a_window_not_the_whole_sequence(tokenizer) -> None:
    """Decoding the whole sequence at every token made a stream O(length^2) on the event loop: the
    window a token decodes stays a few tokens long however long the text grows."""
    decoded: list[int] = []

    class Counting:
        def decode(self, ids):
            decoded.append(len(ids))
            return tokenizer.decode(ids)

    text = " ".join(["the little dog ran to the park and played with a ball"] * 60)
    ids = tokenizer.encode(text, bos=False)
    stream = TextStream(Counting(), tokenizer.encode("Once", bos=True))
    out = "".join(stream.add(t) for t in ids) + stream.finish()
    assert out == tokenizer.decode(tokenizer.encode("Once", bos=True) + ids)[len("Once") :]
    assert len(ids) > 600 and max(decoded) <= 12


def naive_first_stop(text: str, stops: list[str], start: int) -> int | None:
    found = [at for stop in stops if (at := text.find(stop, start)) >= 0]
    return min(found) if found else None


def naive_held(text: str, stops: list[str]) -> int:
    return max(
        (k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0
    )


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    text=st.text("abc", max_size=40),
    stops=st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=4),
    cuts=st.lists(st.integers(1, 6), max_size=20),
)
def test_stop_strings_are_found_as_a_search_of_the_text_would_find_them(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    """Fed in chunks, the automata report the earliest start of a stop completed in each chunk and
    hold back as much as could begin one: what searching the whole text and comparing every
    prefix of every stop (the quadratic way this replaced) says."""
    matcher, seen = StopStrings(stops), ""
    chunks, at = [], 0
    for cut in cuts + [len(text)]:
        chunks.append(text[at : at + cut])
        at += cut
    for chunk in chunks:
        if not chunk:
            continue
        found = matcher.feed(chunk, len(seen))
        longest = max(map(len, stops))
        expected = naive_first_stop(seen + chunk, stops, max(0, len(seen) - longest + 1))
        assert found == expected, (seen, chunk, stops)
        if found is not None:
            return
        seen += chunk
        assert matcher.held == naive_held(seen, stops)
