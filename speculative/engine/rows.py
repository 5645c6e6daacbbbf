"""A request while the engine holds it (:class:`Row`), what its tokens are cut at (its end ids), and the
failure that is its own alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speculative.engine.stats import GenerationResult, SpeculativeStats
from speculative.sampling import Sampling

Callback = Callable[[list[int], list[bool]], None]
# a token's log p and the top (id, log p), p the target's at T = 1 (speculative/engine/logprobs.py)
Logprob = tuple[float, list[tuple[int, float]]]


class RowFailedError(RuntimeError):
    """What a row's own part of an iteration raised (its callback: a server's handler of its
    tokens): that row fails alone, the others go on."""


@dataclass(eq=False)  # a row is itself: two rows are never equal
class Row:
    """One request while the engine holds it, and what it produced."""

    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]  # emitting any of these ends the row (end of text, end of turn, ...)
    callback: Callback | None
    sampling: Sampling  # its own temperature, top-k and top-p
    generator: torch.Generator
    stats: SpeculativeStats
    ids: list[int]  # prompt + output, on the host
    joined: Any = None  # the clock's mark when it entered the batch
    target_next: int = 0  # the target's first cache slot not holding a token of the row
    owed: int = 0  # tokens emitted but still on the device (the target alone, see Engine.flush)
    gamma: int | None = None  # pinned: drafted per iteration whatever the engine's policy (0: none)
    error: Exception | None = (
        None  # it failed alone (its logits were not finite, its callback raised)
    )
    cancelled: bool = False  # stopped from outside (Engine.cancel)
    done: bool = False
    logprobs: int | None = (
        None  # record each emitted token's log-probability and this many top ones (None: not)
    )
    # per emitted token: (its log p, [(id, log p) of the top ones]), p the target's own at temperature 1
    logprob_record: list[Logprob] = field(default_factory=list)
    echo: bool = False  # also record the prompt's tokens (from the call that reads the prompt)
    # per prompt token; None for the first
    prompt_record: list[Logprob | None] = field(default_factory=list)
    # what the drafter keeps across requests for it (Engine.add's memory: a serve.py partition)
    memory: Any = None
    # the finished row whose sequence this one's prompt goes on from (Engine.add's continues), until it joins
    continues: Row | None = None
    # the first tokens of its prompt that the target's cache held when it joined (read again: 0)
    cached: int = 0

    @property
    def length(self) -> int:
        return len(self.ids) + self.owed

    @property
    def produced(self) -> int:
        return self.length - len(self.prompt)

    def result(self) -> GenerationResult[SpeculativeStats]:
        return GenerationResult(tokens=self.ids[len(self.prompt) :], stats=self.stats)


def cut_at_eos(tokens: list[int], stop_ids: frozenset[int]) -> list[int]:
    """Nothing after an emitted end-of-sequence id, even in the middle of an accepted block."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens
