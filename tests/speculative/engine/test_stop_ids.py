"""Several end-of-sequence ids (Llama-3.1-Instruct's config lists three: the end of the text, of a
tool call and of a turn; stopping at the first alone runs past the answer, a bug of many runtimes:
vLLM #4180, llama.cpp #6772, llama-cpp-python #1360). A row stops at whichever it emits first, even
in the middle of an accepted block, and its stats name the id that ended it."""

from __future__ import annotations

import pytest
import torch

from speculative import autoregressive_generate, speculative_generate, speculative_generate_batch
from speculative.engine.engine import Engine
from speculative.engine.generation import conversations
from tests.support.toy_models import NGramModel, random_llama


def chain_table(vocab: int) -> torch.Tensor:
    """Bigram logits: after token i, token (i + 1) % vocab, all but surely (e^-30 for any other)."""
    table = torch.zeros(vocab, vocab, dtype=torch.float64)
    for i in range(vocab):
        table[i, (i + 1) % vocab] = 30.0
    return table


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_any_stop_id_ends_the_row_inside_an_accepted_block(temperature: float) -> None:
    # 0 -> 1 -> 2 -> ... certainly
    target, draft = (
        NGramModel(chain_table(8)),
        NGramModel(chain_table(8)),
    )
    seen: list[list[int]] = []
    out = speculative_generate(
        target,
        draft,
        [0],
        20,
        gamma=6,
        temperature=temperature,
        eos_id=[6, 3, 5],
        seed=0,
        callback=lambda ids, flags: seen.append(ids),
    )
    assert out.tokens == [
        1,
        2,
        3,
    ]  # 3 is the first of the three to come, and 4.. were accepted after it
    assert seen == [[1, 2, 3]]
    assert (out.stats.stop_reason, out.stats.stop_token) == ("eos", 3)
    alone = autoregressive_generate(target, [4], 20, temperature=temperature, eos_id=(3, 6), seed=0)
    assert alone.tokens == [5, 6] and (alone.stats.stop_reason, alone.stats.stop_token) == (
        "eos",
        6,
    )


def test_a_single_id_a_set_and_none() -> None:
    target = NGramModel(chain_table(8))
    assert speculative_generate(
        target, NGramModel(chain_table(8)), [0], 20, gamma=2, temperature=0, eos_id=frozenset({2})
    ).tokens == [1, 2]
    capped = speculative_generate(
        target, NGramModel(chain_table(8)), [0], 5, gamma=2, temperature=0, eos_id=None
    )
    assert capped.tokens == [1, 2, 3, 4, 5]
    assert (capped.stats.stop_reason, capped.stats.stop_token) == ("max_new_tokens", None)


def test_rows_of_a_batch_stop_at_their_own_first_stop_id() -> None:
    target = NGramModel(chain_table(8))
    out = speculative_generate_batch(
        target,
        NGramModel(chain_table(8)),
        [[0], [3], [6]],
        6,
        gamma=3,
        temperature=0,
        batch_size=1,  # the toys hold one row at a time
        eos_id=[2, 5],
    )
    assert [row.tokens for row in out.results] == [[1, 2], [4, 5], [7, 0, 1, 2]]
    assert [row.stats.stop_token for row in out.results] == [2, 5, 2]


@pytest.mark.parametrize("bad", [-1, "2", [1, "x"], [True], 2.5])
def test_bad_stop_ids_are_refused_in_one_line(bad: object) -> None:
    engine = Engine(NGramModel(chain_table(8)), None)
    with pytest.raises(ValueError, match="eos_id must be a token id") as error:
        engine.add([0], 4, eos_id=bad)
    assert "\n" not in str(error.value)


def test_conversations_answer_to_the_stop_id_and_in_pieces_as_whole() -> None:
    """engine.generation.conversations: each prompt, then the target's answer up to and with a stop id;
    the first batch greedy, the next at temperature 1; made in pieces (first=...), wherever they
    start, it gives the whole list's answers."""
    target = random_llama(vocab=9, dim=16, seed=3, std=1.0, dtype=torch.float64)
    prompts = [[i % 9, (i * 5) % 9] for i in range(8)]
    whole = conversations(target, prompts, 6, stop_ids=(0,), seed=7, rows=4)
    assert [item[:2] for item in whole] == prompts
    for item in whole:
        answer = item[2:]
        assert (
            1 <= len(answer) <= 6 and (answer[-1] == 0 or len(answer) == 6) and 0 not in answer[:-1]
        )
    greedy = [
        autoregressive_generate(target, p, 6, temperature=0, eos_id=0).tokens for p in prompts[:4]
    ]
    assert [item[2:] for item in whole[:4]] == greedy
    sampled = [
        autoregressive_generate(target, p, 6, temperature=1.0, eos_id=0, seed=7 + 4 + i).tokens
        for i, p in enumerate(prompts[4:])
    ]
    assert [item[2:] for item in whole[4:]] == sampled
    assert conversations(target, prompts[4:], 6, (0,), 7, first=4, rows=4) == whole[4:]
    # Pieces that cut a group (an earlier run asked for 2, or 6): the groups stay the whole list's.
    assert conversations(target, prompts[2:6], 6, (0,), 7, first=2, rows=4) == whole[2:6]
    assert conversations(target, prompts[6:], 6, (0,), 7, first=6, rows=4) == whole[6:]
