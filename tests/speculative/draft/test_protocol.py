"""The drafter interface (speculative/draft/protocol.py, speculative/draft/model.py): a plain model
and ModelDrafter around it are the same run, token for token; anything else is refused with a
clear error; a drafter may propose fewer tokens than gamma, or none, and the output stays exact.
"""

from __future__ import annotations

import pytest
import torch

from speculative import (
    Draft,
    FeatureDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    as_drafter,
    speculative_generate,
)
from tests.support.proofs import proof
from tests.support.toy_models import NGramModel, random_head, random_llama, reference_greedy_toy


# ----------------------------------------------------------------------------- interface
def test_a_plain_model_and_its_model_drafter_are_the_same_run() -> None:
    target, draft = NGramModel.random(5, 2, seed=1), NGramModel.random(5, 2, seed=2)
    for temperature in (0.0, 0.8):
        plain = speculative_generate(
            target, draft, [1, 2], 30, gamma=3, temperature=temperature, seed=4
        )
        wrapped = speculative_generate(
            target, ModelDrafter(draft), [1, 2], 30, gamma=3, temperature=temperature, seed=4
        )
        assert plain.tokens == wrapped.tokens
        assert plain.stats.gamma_history == wrapped.stats.gamma_history


def test_as_drafter() -> None:
    model = NGramModel.random(3, 2)
    lookup = PromptLookupDrafter()
    assert as_drafter(lookup) is lookup
    assert isinstance(as_drafter(model), ModelDrafter) and as_drafter(model).model is model
    with pytest.raises(TypeError, match="draft must be a model"):
        as_drafter("tiny-draft")


def test_a_drafter_for_another_vocabulary_is_refused() -> None:
    target = random_llama(vocab=8)
    head = random_head(random_llama(vocab=9))
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(target, FeatureDrafter(head, random_llama(vocab=9)), [1], 4)


@proof("a drafter that proposes fewer tokens, or none, stays exact", "exact identity, greedy")
def test_a_drafter_may_propose_fewer_tokens_or_none() -> None:
    """A drafter that proposes nothing turns every iteration into a plain target step; one
    that proposes a single token gets it verified like any block."""

    class Fixed:
        reads_features, vocab_size, max_seq_len = False, None, None

        def __init__(self, block: list[int]) -> None:
            self.block = block

        def start(self, max_rows, cache_len, target=None):
            pass

        def propose(self, ids, gammas, sampling, generators, device):
            return Draft(
                torch.tensor([self.block[:g] for g in gammas], dtype=torch.long).view(
                    len(gammas), -1
                ),
                [len(self.block[:g]) for g in gammas],
            )

        def commit(self, lengths, hidden=None, hidden_starts=None):
            pass

        def keep_rows(self, rows, new=0):
            pass

    target = NGramModel.random(4, 2, seed=3)
    greedy = speculative_generate(target, Fixed([]), [0], 10, gamma=4, temperature=0)
    assert greedy.stats.target_calls == 10 and greedy.stats.drafted_tokens == 0
    assert greedy.tokens == reference_greedy_toy(target, [0], 10)
    one = speculative_generate(target, Fixed([2]), [0], 10, gamma=4, temperature=0)
    assert one.tokens == greedy.tokens and set(one.stats.gamma_history) <= {0, 1}
