"""The corpus helpers of train.py (weights/corpus.py): story openings and held-out prompts,
on a corpus and a stand-in tokenizer written here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weights.corpus import chat_prompts, chat_requests, held_out_prompts, story_openings

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- weights/corpus.py
class Words:
    """A stand-in tokenizer: one id per word, BOS 1."""

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([1] if bos else []) + [len(word) + 10 for word in text.split()]


def test_story_openings_and_held_out_prompts(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(
        "a bb ccc dddd<|endoftext|>e ff<|endoftext|>ggg hhhh i jj kk", encoding="utf-8"
    )
    assert story_openings([corpus], Words(), 4) == [
        [1, 11, 12, 13],
        [1, 13, 14, 11],
    ]  # the two-word story is short
    prompts = held_out_prompts([corpus], Words(), 2, 3, seed=5)
    assert len(prompts) == 2 and all(len(p) == 3 and p[0] == 1 for p in prompts)
    # the same prompts for the same seed
    assert prompts == held_out_prompts([corpus], Words(), 2, 3, seed=5)
    # all of them when there are fewer
    assert sorted(held_out_prompts([corpus], Words(), 9, 3, seed=5)) == sorted(
        [[1, 11, 12], [1, 11, 12], [1, 13, 14]]
    )


def test_chat_requests_are_about_the_documents_and_the_same_for_a_seed(tmp_path: Path) -> None:
    text = tmp_path / "stories.txt"
    text.write_text(
        "<|endoftext|>".join(
            [
                "Tom had a red kite. The kite flew over the hill. Tom laughed and ran after it until the sun went down.",
                "Mia found a shell on the beach. She gave the shell to her mother, who kept it on the window for years.",
                "tiny doc",
            ]
        ),
        encoding="utf-8",
    )
    requests = chat_requests([text], 60, seed=3)
    assert requests == chat_requests([text], 60, seed=3) and requests != chat_requests(
        [text], 60, seed=4
    )
    subjects = {
        "the kite",
        "the hill",
        "the sun",
        "the shell",
        "the beach",
        "the window",
    }  # "a"/"the" + noun
    for request in requests:
        body = request.split("\n\n", 1)[1] if "\n\n" in request else request
        assert "tiny doc" not in request  # documents under 80 characters are not asked about
        assert body in text.read_text() or any(subject in request for subject in subjects), request
    passages = [
        r.split("\n\n", 1)[1] for r in requests if "\n\n" in r and not r.startswith("Continue")
    ]
    assert passages and all(p.endswith(".") and p[0].isupper() for p in passages)  # whole sentences
    assert len({r.split("\n\n")[0] for r in requests}) >= 8  # many kinds of task


def test_chat_prompts_are_one_user_turn_in_the_template_and_a_base_model_is_refused(
    tmp_path: Path,
) -> None:
    text = tmp_path / "stories.txt"
    text.write_text(
        "Tom had a red kite. The kite flew over the hill and far away, and Tom ran after it.",
        "utf-8",
    )

    class Turns:  # a template that writes "role: text" lines, then the assistant's turn
        def encode(self, tokenizer: object, messages: list) -> list[int]:
            return [ord(c) for role, content in messages for c in f"{role}: {content}\n"] + [
                ord(c) for c in "bot:"
            ]

    class WithChat:
        name, chat = "a chat model", Turns()

    class Base:
        name, chat = "tiny-target", None

    (request,) = chat_requests([text], 1, seed=0)
    assert chat_prompts([text], WithChat(), 1, seed=0) == [
        [ord(c) for c in f"user: {request}\nbot:"]
    ]
    with pytest.raises(ValueError, match="tiny-target has no chat template"):
        chat_prompts([text], Base(), 1, seed=0)
