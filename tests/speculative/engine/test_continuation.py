"""A row that goes on from a finished one (``Engine.add``'s ``continues``, a conversation's next turn):
the target reads only what its KV cache does not hold, each drafter keeps what it can (the protocol's
``resumed`` hook), and the tokens are those of a fresh row with the same prompt.

Float64 toys for every drafter kind, greedy and sampled with a seed, so that the positions read in
other calls than a fresh row's do not move a near-tie (the numerics policy, docs/algorithm.md); the
shipped tiny pair in float32, greedy and sampled, for the default drafter, prompt lookup and the
shipped feature head. A continuation that cannot be trusted (the earlier row cancelled, another row
in between, a feature drafter without the hook) reads the prompt from 0, with the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from speculative import Engine, FeatureDrafter, ModelDrafter, PromptLookupDrafter
from speculative.draft.suffix import SuffixDrafter
from speculative.engine.rows import Row
from speculative.proofs import cases
from tests.support.paths import DRAFT, TARGET
from tests.support.toy_models import random_llama
from weights import load_pair

torch.set_num_threads(1)
CONTEXT = 96
FIRST = [1, 2, 3, 4, 5]

DRAFTERS: dict[str, Callable[[Any], Any]] = {
    "model": cases.model_drafter,
    "parallel": cases.parallel_drafter,
    "feature": cases.feature_drafter,
    "eagle3": cases.eagle3_drafter,
    "peagle": cases.peagle_drafter,
    "hybrid": cases.hybrid_drafter,
    "hybrid-model": cases.hybrid_model_drafter,
    "lookup": lambda target: PromptLookupDrafter(),
    "suffix": lambda target: SuffixDrafter(),
    "none": lambda target: None,
}
GROWS_TREES = ["model", "parallel", "feature", "eagle3", "peagle"]
needs_pair = pytest.mark.skipif(
    not (TARGET / "config.json").is_file() or not (DRAFT / "config.json").is_file(),
    reason="the shipped pair weights/tiny-target + weights/tiny-draft is absent",
)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return random_llama(vocab=16, dim=16, max_seq_len=CONTEXT, seed=0, dtype=torch.float64)


def engine_of(target: Any, kind: str, temperature: float, tree: Any = None) -> Engine:
    return Engine(
        target,
        DRAFTERS[kind](target),
        gamma=None if tree else 3,
        temperature=temperature,
        tree=tree,
        cache_len=CONTEXT,
    )


def fresh(
    target: Any, kind: str, prompt: list[int], seed: int, temperature: float, tree: Any = None
) -> Row:
    engine = engine_of(target, kind, temperature, tree)
    row = engine.add(prompt, 12, seed=seed)
    engine.run()
    return row


@contextmanager
def positions_read(*models: torch.nn.Module) -> Iterator[list[int]]:
    """The positions (columns) of every call of ``models`` inside the block, one entry a call."""
    widths: list[int] = []
    hooks = [
        model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
        for model in models
    ]
    try:
        yield widths
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_a_continued_row_is_the_fresh_row(target: Any, kind: str, temperature: float) -> None:
    """Three turns in one engine: the second's prompt is the first's whole sequence and more (the
    cache ends one token before it: the last token was never read), the third's parts from the
    second's sequence before its end. Each has the tokens, and the draft lengths, of a fresh row
    with its prompt and seed; the target skipped what the two sequences share."""
    engine = engine_of(target, kind, temperature)
    first = engine.add(FIRST, 12, seed=1)
    engine.run()
    second_prompt = first.ids + [7, 8, 9]
    second = engine.add(second_prompt, 12, seed=2, continues=first)
    engine.run()
    third_prompt = second.ids[:-5] + [3, 3]
    third = engine.add(third_prompt, 12, seed=3, continues=second)
    engine.run()
    assert first.cached == 0
    assert second.cached == len(first.ids) - 1  # all that the target read of the first
    assert third.cached == len(second.ids) - 5  # up to where the prompts part
    for row, prompt, seed in ((second, second_prompt, 2), (third, third_prompt, 3)):
        alone = fresh(target, kind, prompt, seed, temperature)
        assert row.result().tokens == alone.result().tokens
        assert row.stats.gamma_history == alone.stats.gamma_history
        assert row.continues is None  # not kept: a conversation's rows would hold every earlier one


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("kind", GROWS_TREES)
def test_a_continued_row_grows_the_same_trees(target: Any, kind: str, temperature: float) -> None:
    tree = (2, 1)
    engine = engine_of(target, kind, temperature, tree)
    first = engine.add(FIRST, 12, seed=1)
    engine.run()
    prompt = first.ids + [7, 8]
    second = engine.add(prompt, 12, seed=2, continues=first)
    engine.run()
    assert second.cached == len(first.ids) - 1
    assert (
        second.result().tokens == fresh(target, kind, prompt, 2, temperature, tree).result().tokens
    )


@pytest.mark.parametrize("kind", ["model", "feature", "lookup", "none"])
def test_the_target_reads_only_what_its_cache_lacks(target: Any, kind: str) -> None:
    """Counted at the target's calls: the continued row feeds ``cached`` fewer positions than the
    fresh row, and a draft model's own calls fewer too."""
    engine, alone = engine_of(target, kind, 0.9), engine_of(target, kind, 0.9)
    first = engine.add(FIRST, 12, seed=1)
    engine.run()
    prompt = first.ids + [7, 8, 9]
    drafts = [e.drafter.model for e in (engine, alone) if isinstance(e.drafter, ModelDrafter)]
    with positions_read(target) as continued, positions_read(*drafts[:1]) as continued_drafts:
        second = engine.add(prompt, 12, seed=2, continues=first)
        engine.run()
    with positions_read(target) as read, positions_read(*drafts[1:]) as drafted:
        row = alone.add(prompt, 12, seed=2)
        alone.run()
    assert second.result().tokens == row.result().tokens
    assert second.cached == len(first.ids) - 1 > 0
    assert len(continued) == len(read) > 0  # as many calls, the first one narrower
    assert sum(read) - sum(continued) == second.cached
    if kind == "model":
        # what its own cache held of the first row: up to the tokens the two rows share
        assert 0 < sum(drafted) - sum(continued_drafts) <= second.cached


@pytest.mark.parametrize("kind", ["model", "feature"])
def test_a_cancelled_previous_row_is_read_from_zero(target: Any, kind: str) -> None:
    engine = engine_of(target, kind, 0.9)
    first = engine.add(FIRST, 30, seed=1)
    engine.step()
    engine.step()
    engine.cancel(first)
    engine.run()
    assert first.stats.stop_reason == "cancelled"
    prompt = first.ids + [7]
    second = engine.add(prompt, 12, seed=2, continues=first)
    engine.run()
    assert second.cached == 0
    assert second.result().tokens == fresh(target, kind, prompt, 2, 0.9).result().tokens


def test_a_row_in_between_breaks_the_continuation(target: Any) -> None:
    """The caches hold the last row that ran: a row that continues an earlier one reads from 0."""
    engine = engine_of(target, "model", 0.9)
    first = engine.add(FIRST, 12, seed=1)
    engine.run()
    engine.add([9, 9, 9], 4, seed=5)
    engine.run()
    prompt = first.ids + [7]
    second = engine.add(prompt, 12, seed=2, continues=first)
    engine.run()
    assert second.cached == 0
    assert second.result().tokens == fresh(target, "model", prompt, 2, 0.9).result().tokens


def test_a_feature_drafter_without_the_hook_has_the_prompt_read_from_zero(target: Any) -> None:
    """It needs the target's features of every position it reads, and would not keep its own."""

    class Forgetful(FeatureDrafter):
        resumed = None

    engine = Engine(
        target,
        Forgetful(cases.toy_head(target), target),
        gamma=3,
        temperature=0.9,
        cache_len=CONTEXT,
    )
    first = engine.add(FIRST, 12, seed=1)
    engine.run()
    prompt = first.ids + [7]
    second = engine.add(prompt, 12, seed=2, continues=first)
    engine.run()
    assert second.cached == 0
    assert second.result().tokens == fresh(target, "feature", prompt, 2, 0.9).result().tokens


def test_echo_reads_the_whole_prompt(target: Any) -> None:
    engine = engine_of(target, "model", 0.0)
    first = engine.add(FIRST, 6)
    engine.run()
    second = engine.add(first.ids + [7], 6, continues=first, echo=True)
    engine.run()
    assert second.cached == 0 and len(second.prompt_record) == len(second.prompt)


def test_continuation_is_for_an_engine_of_one_row(target: Any) -> None:
    engine = Engine(target, None, max_rows=2)
    first = engine.add(FIRST, 4)
    with pytest.raises(ValueError, match="one row"):
        engine.add(FIRST, 4, continues=first)
    with pytest.raises(ValueError, match="a Row"):
        Engine(target, None).add(FIRST, 4, continues=[1, 2])


# ----------------------------------------------------------------------------- the shipped pair
@needs_pair
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("draft", ["tiny-draft", "lookup", "tiny-eagle", None])
def test_the_shipped_pair_continues_as_it_starts(draft: str | None, temperature: float) -> None:
    """A story's second part in the same engine: the tokens of a fresh row on its prompt (float32:
    equal on these prompts; a near-tie could part them, as the numerics policy says)."""
    pair = load_pair("tiny-target", draft, prepare_models=False)
    tokenizer = pair.tokenizer

    def engine() -> Engine:
        return Engine(pair.target, pair.draft, gamma=4, temperature=temperature, cache_len=512)

    story = engine()
    first = story.add(
        tokenizer.encode("Once upon a time, there was a little girl named Lily.", bos=True),
        40,
        seed=3,
        eos_id=pair.stop_ids,
    )
    story.run()
    prompt = first.ids + tokenizer.encode(" Then she went to the park and", bos=False)
    second = story.add(prompt, 40, seed=4, eos_id=pair.stop_ids, continues=first)
    story.run()
    alone = engine()
    row = alone.add(prompt, 40, seed=4, eos_id=pair.stop_ids)
    alone.run()
    assert second.cached == len(first.ids) - 1
    assert second.result().tokens == row.result().tokens
