"""The corpus helpers of train.py (weights/corpus.py): story openings and held-out prompts,
on a corpus and a stand-in tokenizer written here."""

from __future__ import annotations

from pathlib import Path

import torch

from weights.corpus import held_out_prompts, story_openings

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- weights/corpus.py
class Words:
    """A stand-in tokenizer: one id per word, BOS 1."""

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([1] if bos else []) + [len(word) + 10 for word in text.split()]


def test_story_openings_and_held_out_prompts(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("a bb ccc dddd<|endoftext|>e ff<|endoftext|>ggg hhhh i jj kk", encoding="utf-8")
    assert story_openings([corpus], Words(), 4) == [[1, 11, 12, 13], [1, 13, 14, 11]]  # the two-word story is short
    prompts = held_out_prompts([corpus], Words(), 2, 3, seed=5)
    assert len(prompts) == 2 and all(len(p) == 3 and p[0] == 1 for p in prompts)
    assert prompts == held_out_prompts([corpus], Words(), 2, 3, seed=5)  # the same prompts for the same seed
    assert sorted(held_out_prompts([corpus], Words(), 9, 3, seed=5)) == sorted(
        [[1, 11, 12], [1, 11, 12], [1, 13, 14]])  # all of them when there are fewer
