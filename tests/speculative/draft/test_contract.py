"""The drafter protocol is the whole contract (speculative/draft/protocol.py): a drafter with the four
calls and nothing else (no attribute at all) goes through every path of the engine, which takes the
declared defaults for what it lacks; and the checker proves it exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from speculative import autoregressive_generate, speculative_generate, speculative_generate_batch
from speculative.draft.protocol import DEFAULTS, Draft, Drafter, drafted, draw_rows, trait
from speculative.engine.engine import Engine
from speculative.proofs import main as prove
from tests.support.toy_models import random_llama

VOCAB = 16


class Minimal:
    """The four calls, no attribute: every token from one fixed uneven law over the vocabulary."""

    def start(self, max_rows: int, cache_len: int, target: Any) -> None:
        self.logits = 2 * torch.sin(
            1.7 * torch.arange(target.config.vocab_size, dtype=target.dtype)
        )

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: Any,
        generators: Any,
        device: torch.device,
    ) -> Draft:
        tokens, probs = [], []
        for step in range(max(gammas)):
            drawing = [g if step < gamma else None for g, gamma in zip(generators, gammas)]
            tokens.append(draw_rows(self.logits.expand(len(ids), -1), samplings, drawing, probs))
        return drafted(tokens, probs, gammas, 0, device)

    def commit(self, lengths: list[int], hidden: Any = None, hidden_starts: Any = None) -> None:
        pass

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        pass


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return random_llama(
        vocab=VOCAB,
        dim=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        hidden_dim=32,
        max_seq_len=64,
        seed=1,
    )


def test_the_protocol_declares_every_attribute_the_engine_reads() -> None:
    declared = set(Drafter.__annotations__)
    assert declared == set(DEFAULTS)
    assert {name: trait(Minimal(), name) for name in DEFAULTS} == DEFAULTS


def test_a_drafter_with_the_four_calls_alone_goes_through_every_engine_path(
    target: torch.nn.Module,
) -> None:
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    alone = [autoregressive_generate(target, p, 12, temperature=0).tokens for p in prompts]
    assert (
        speculative_generate(target, Minimal(), prompts[0], 12, gamma=3, temperature=0).tokens
        == alone[0]
    )
    auto = Engine(target, Minimal(), gamma="auto")
    # the declared default, not "always the largest"
    assert auto.gamma_policy.switch is not None and auto.gamma_policy.switch.parallel is False
    assert (
        speculative_generate(target, Minimal(), prompts[0], 12, gamma="auto", temperature=0).tokens
        == alone[0]
    )
    batch = speculative_generate_batch(
        target, Minimal(), prompts, 12, gamma=2, temperature=0, batch_size=3
    )
    assert [row.tokens for row in batch.results] == alone
    for verify in ("token", "block"):
        sampled = speculative_generate(
            target, Minimal(), prompts[1], 12, gamma=3, temperature=1.0, seed=0, verify=verify
        )
        assert len(sampled.tokens) == 12 and sampled.stats.drafted_tokens > 0
    engine = Engine(target, Minimal(), gamma=2, temperature=0)
    row = engine.add(prompts[2], 6, logprobs=2, echo=True)
    engine.run()
    assert len(row.logprob_record) == 6 and len(row.prompt_record) == len(prompts[2])
    with pytest.raises(ValueError, match="cannot build token trees"):
        speculative_generate(target, Minimal(), prompts[0], 4, tree=(2, 1))


def test_the_checker_proves_it_exact(capsys: pytest.CaptureFixture[str]) -> None:
    assert prove([f"{__name__}:Minimal", "--quick"]) == 0, capsys.readouterr().out
    assert "PASS: all" in capsys.readouterr().out
