"""Prompt lookup (n-gram) drafting: propose what followed the last time the sequence's
suffix occurred (Saxena 2023, "prompt lookup decoding"; the same idea as LLMA, Yang et al.
2023, "Inference with Reference").

Summaries, edits, code and retold stories copy long runs from their input. When the last
n tokens of the sequence (prompt plus output) also stand earlier in it, the tokens that
followed them there are a guess that costs no forward at all. The longest suffix that
matches is tried first (n = max_ngram down to min_ngram), and of its occurrences the most
recent one. Without a match nothing is proposed, and the iteration is a plain target step.

The drafter is deterministic: q is one-hot on each proposed token, so Algorithm 1 accepts
x with probability p(x) and otherwise samples from p with x removed (speculative.draft).

The occurrences are kept in one dictionary per n-gram length, n-gram -> the latest start
with at least one token after it, updated only for the positions added since the last
call: a proposal costs O(new tokens), not a scan of the sequence. Every row has its own
index (:class:`NgramIndex`): rows share nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from speculative.draft.protocol import Draft, copied_chains
from speculative.draft.registry import DrafterKind, register_drafter
from speculative.sampling import Sampling


class NgramIndex:
    """The n-gram occurrences of one sequence, kept up to date as it grows."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)
        }
        self.seen: list[int] = []  # the ids indexed so far (a prefix of every later sequence)

    def update(self, ids: list[int]) -> None:
        """Index every n-gram that has a token after it: starts i with i + n < len(ids)."""
        if ids[: len(self.seen)] != self.seen:  # another sequence than the one indexed: start over
            self.__init__(self.max_ngram, self.min_ngram)
        old = len(self.seen)
        for n, table in self.index.items():
            for i in range(max(0, old - n), len(ids) - n):
                table[tuple(ids[i : i + n])] = i
        self.seen = list(ids)

    def lookup(self, ids: list[int], gamma: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching suffix."""
        self.update(ids)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            start = self.index[n].get(tuple(ids[len(ids) - n :]))
            if start is not None:
                return ids[start + n : start + n + gamma]
        return []


class PromptLookupDrafter:
    """Propose up to gamma tokens that followed the longest earlier match of each row's suffix."""

    reads_features = False
    vocab_size = None  # it proposes ids taken from the sequence, which the engine has checked
    max_seq_len = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must not exceed max_ngram ({max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.rows: list[NgramIndex] = []

    def start(self, max_rows: int = 0, cache_len: int = 0, target: Any = None) -> None:
        self.rows = []

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: list[Sampling],
        generators: list[torch.Generator],
        device: torch.device,
    ) -> Draft:
        found = [
            row.lookup(row_ids, g) if g else [] for row, row_ids, g in zip(self.rows, ids, gammas)
        ]
        return copied_chains(found, device)

    def commit(
        self,
        lengths: list[int],
        hidden: torch.Tensor | None = None,
        hidden_starts: list[int] | None = None,
    ) -> None:
        pass  # stateless beyond the indexes, which only grow with the sequences

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        self.rows = [self.rows[r] for r in rows] + [
            NgramIndex(self.max_ngram, self.min_ngram) for _ in range(new)
        ]


register_drafter(
    DrafterKind(
        "lookup",
        "prompt lookup: n-grams copied from the sequence, no model at all",
        build=lambda network, target: PromptLookupDrafter(),
        toy="speculative.draft.lookup:PromptLookupDrafter",
    )
)
