"""The hybrid proposer (speculative/draft/hybrid.py): its choice by hand, its records, its merged
draft, and the exactness of the engine with it.

* The expected accepted lengths and the choice, computed by hand.
* The records after commits: the copier's scale and the model's acceptance, by hand.
* The merged q of a batch whose rows drafted with different drafters: the model's rows keep its
  q, the copied rows are one-hot.
* Exactness: the checker (exact law by enumeration, greedy identity; chi-square in the full run)
  around a feature head and around a draft model, with both drafters drafting on the toy (counted);
  greedy identity through the library and the command line on the shipped pair.
* An exactness mutant (the model's q dropped, so its sampled tokens are reported one-hot) that the
  checker rejects.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json

import pytest
import torch

import generate
from speculative import speculative_generate
from speculative.draft.suffix import Calibration, Continuation, SuffixDrafter
from speculative.proofs import check
from speculative.proofs.cases import feature_drafter, hybrid_drafter, hybrid_model_drafter
from speculative.proofs.toys import random_llama
from tests.support.cli import TARGET, needs_pair
from tests.support.mutation import mutated
from tests.support.statistical import P_VALUE, sample_counts, window_distribution
from tests.support.toy_models import chi_square_pvalue, reference_greedy
from weights.load import load_pair, named_draft, read_named_pair, split_hybrid

hybrid = importlib.import_module("speculative.draft.hybrid")


# ----------------------------------------------------------------------------- by hand
def chain(frequencies: list[float]) -> Continuation:
    """A copied chain with these frequencies (its tokens do not matter to the choice)."""
    return Continuation(list(range(len(frequencies))), list(frequencies), match=1)


def test_the_estimates_by_hand() -> None:
    assert chain([]).expected == 0.0
    assert chain([0.5, 0.5]).expected == pytest.approx(0.5 + 0.25)
    assert chain([1.0, 0.5, 0.2]).expected == pytest.approx(1.0 + 0.5 + 0.1)
    assert hybrid.model_estimate(0.5, 4) == pytest.approx(0.5 + 0.25 + 0.125 + 0.0625)
    assert hybrid.model_estimate(1.0, 3) == pytest.approx(3.0)


def test_the_choice_by_hand() -> None:
    drafter = hybrid.HybridDrafter(SuffixDrafter(), object(), model_gamma=4)
    fresh = hybrid.RowRecord()  # the model's prior: 0.5 a position, 0.9375 for four positions
    assert drafter.choose(fresh, chain([1.0, 1.0]), gamma=16)[0] == "copier"  # 2 against 0.9375
    assert drafter.choose(fresh, chain([0.5, 0.5]), gamma=16)[0] == "model"  # 0.75 against 0.9375
    assert drafter.choose(fresh, chain([]), gamma=16)[0] == "model"  # no match: nothing to copy
    assert drafter.choose(fresh, chain([1.0, 1.0]), gamma=0)[0] == "none"
    # at gamma 1 the model drafts one token (0.5 expected): one sure copied token wins
    assert drafter.choose(fresh, chain([0.6]), gamma=1)[0] == "copier"
    # a copier that came out worse than its estimates is scaled down: (0 + 1) / (9 + 1)
    doubted = hybrid.RowRecord(copier=Calibration(accepted=0.0, estimated=9.0))
    assert doubted.copier_scale == pytest.approx(0.1)
    assert (
        drafter.choose(doubted, chain([1.0, 1.0, 1.0]), gamma=16)[0] == "model"
    )  # 0.3 against 0.9375


class Quiet:
    """A model drafter that is only told things (the records are the hybrid's own)."""

    def start(self, max_rows, cache_len, target=None) -> None: ...

    def commit(self, lengths, hidden=None, hidden_starts=None) -> None: ...

    def keep_rows(self, rows, new=0) -> None: ...


def test_commit_records_what_each_drafter_got() -> None:
    drafter = hybrid.HybridDrafter(SuffixDrafter(), Quiet())
    drafter.start(2, 64)
    drafter.keep_rows([], new=2)
    drafter.pending = [
        hybrid.Pending("copier", length=10, drafted=5, estimate=3.0),
        hybrid.Pending("model", length=20, drafted=4, estimate=0.0),
    ]
    drafter.copier.rows[0].update(list(range(10)))
    drafter.copier.rows[1].update(list(range(20)))
    # row 0 kept 2 of 5 copied tokens (+ the target's own), row 1 all 4 of the model's (+ 1)
    drafter.commit([13, 25])
    copier_row, model_row = drafter.records
    assert (copier_row.copier.accepted, copier_row.copier.estimated) == (2.0, 3.0)
    assert copier_row.copier_scale == pytest.approx(3 / 4)
    prior = hybrid.MODEL_PRIOR * hybrid.PRIOR_WEIGHT
    assert model_row.model_accepted == pytest.approx(prior + 4)
    assert model_row.model_verified == pytest.approx(hybrid.PRIOR_WEIGHT + 4)
    # a model draft rejected at its second token: two positions verified, one kept
    drafter.pending = [
        hybrid.Pending("none", 13, 0, 0.0),
        hybrid.Pending("model", length=25, drafted=4, estimate=0.0),
    ]
    drafter.commit([14, 27])
    assert model_row.model_accepted == pytest.approx(prior + 5)
    assert model_row.model_verified == pytest.approx(hybrid.PRIOR_WEIGHT + 6)


def test_a_mixed_batch_keeps_the_models_q_and_one_hot_copies(module=hybrid) -> None:
    drafter = module.HybridDrafter(SuffixDrafter(), object())
    q_model = torch.softmax(torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)), -1)
    modelled = hybrid.Draft(torch.tensor([[0, 0, 0], [4, 5, 6]]), [0, 3], q_model, calls=3)
    draft = drafter.merged([[1, 2], [4, 5, 6]], ["copier", "model"], modelled, torch.device("cpu"))
    assert draft.tokens.tolist() == [[1, 2, 0], [4, 5, 6]] and draft.lengths == [2, 3]
    assert draft.calls == 3
    assert torch.equal(draft.q[1], q_model[1])
    expected = torch.zeros(2, 7)
    expected[0, 1] = expected[1, 2] = 1.0
    assert torch.equal(draft.q[0, :2], expected)
    # greedy: the model reports no q, nor does the merged draft (one-hot everywhere)
    greedy = hybrid.Draft(modelled.tokens, [0, 3], None, calls=3)
    merged = drafter.merged([[1, 2], [4, 5, 6]], ["copier", "model"], greedy, torch.device("cpu"))
    assert merged.q is None


# ----------------------------------------------------------------------------- exactness
def counting(drafter: hybrid.HybridDrafter, counts: dict[str, int]) -> hybrid.HybridDrafter:
    """The drafter, counting which of its drafters each proposal came from."""
    original = drafter.propose

    def propose(*args, **kwargs):
        draft = original(*args, **kwargs)
        for pending in drafter.pending:
            counts[pending.source] = counts.get(pending.source, 0) + 1
        return draft

    drafter.propose = propose
    return drafter


@pytest.mark.parametrize("build", [hybrid_drafter, hybrid_model_drafter])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_output_is_the_target_alone_with_both_drafting(build, seed: int) -> None:
    target = random_llama(vocab=4, max_seq_len=64, seed=seed, dtype=torch.float64)
    prompt = [seed % 4, 1, 2, 1, 2, 3, 1, 2]
    counts: dict[str, int] = {}
    out = speculative_generate(
        target, counting(build(target), counts), prompt, 40, gamma=6, temperature=0
    )
    assert out.tokens == reference_greedy(target, prompt, 40)
    assert counts.get("copier", 0) > 0 and counts.get("model", 0) > 0, counts


@pytest.mark.parametrize("build", [hybrid_drafter, hybrid_model_drafter])
def test_the_checker_passes_it(build) -> None:
    """python -m speculative.prove speculative.proofs.cases:hybrid_drafter, quick: the exact law by
    enumeration through the engine on small random targets, and greedy identity."""
    report = check(build, quick=True, properties=["exact", "greedy"])
    assert report.ok, [result.line() for result in report.results]


# The chi-square end to end: a toy Llama target of three ids at T = 0.7, the first three tokens of
# seeded runs against the target's exact law (enumerated). The first iteration reads the prompt
# (the head has no feature yet, so the copier or a plain step); from the second on both draft. The
# prompt holds every pair of ids once (a de Bruijn sequence), so every id was followed by each id
# equally often, and every pair was followed by one id: the copier's chains are 1/3 after one id and
# sure after two. With a confident prior (0.95 a position, three positions: 2.71 expected) the model
# drafts until the copier has a match of three.
RUNS = 2000
PROMPT = [0, 0, 1, 0, 2, 1, 1, 2, 2, 0]
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def toy() -> dict:
    target = random_llama(vocab=3, max_seq_len=32, seed=3, std=0.5, dtype=torch.float64)

    @torch.no_grad()
    def next_probs(ctx: tuple[int, ...]) -> list[float]:
        logits = target(torch.tensor([list(ctx)]))[0, -1]
        return torch.softmax(logits / TEMPERATURE, -1).tolist()

    return {"target": target, "law": window_distribution(next_probs, PROMPT, 0, 3)}


def chi_square(toy: dict, module) -> float:
    """The p-value of the first 3 tokens of RUNS seeded runs against the target's law, with both
    of the hybrid's drafters counted as drafting."""
    counts: dict[str, int] = {}

    def run(seed: int) -> list[int]:
        drafter = module.HybridDrafter(
            SuffixDrafter(), feature_drafter(toy["target"]), model_gamma=3, model_prior=0.95
        )
        out = speculative_generate(
            toy["target"],
            counting(drafter, counts),
            PROMPT,
            3,
            gamma=3,
            temperature=TEMPERATURE,
            seed=seed,
            verify="token",
        )
        return out.tokens

    sampled = sample_counts(run, RUNS, 0, 3)
    assert counts.get("copier", 0) > RUNS // 10 and counts.get("model", 0) > RUNS // 10, counts
    return chi_square_pvalue(sampled, toy["law"])


def test_the_first_tokens_have_the_target_distribution(toy: dict) -> None:
    p_value = chi_square(toy, hybrid)
    assert p_value > P_VALUE, f"the hybrid rejected (p = {p_value:.3g})"


def test_the_models_q_dropped_stays_exact() -> None:
    """Not a bug, and why: a token reported one-hot is accepted with probability p(x) and
    otherwise replaced from p with x removed, which gives p whatever chose x, as long as the
    choice did not look at the target's draws. So a hybrid that dropped the model's q would lose
    acceptance, never exactness: the chi-square keeps it (the exact hybrid's one is above)."""
    mutant = mutated(hybrid, ("if modelled is None or modelled.q is None:", "if True:"))
    report = check(
        lambda t: mutant.HybridDrafter(SuffixDrafter(), feature_drafter(t), 2, 0.95),
        quick=True,
        properties=["exact"],
    )
    assert report.ok


def test_a_copied_row_without_its_one_hot_q_is_caught() -> None:
    """A mixed batch whose copied rows kept a zero q would have their tokens accepted always
    (min(1, p / 0)): the merged draft's check by hand rejects it."""
    mutant = mutated(
        hybrid,
        (
            "                q[b, torch.arange(len(chain), device=device), tokens[b, : len(chain)]] = 1.0",
            "                pass",
        ),
    )
    with pytest.raises(AssertionError):
        test_a_mixed_batch_keeps_the_models_q_and_one_hot_copies(mutant)


# ----------------------------------------------------------------------------- by name
def test_the_names() -> None:
    assert split_hybrid("suffix+tiny-eagle") == ("suffix", "tiny-eagle")
    assert split_hybrid("tiny-eagle") == (None, "tiny-eagle")
    assert split_hybrid("lookup+tiny-eagle") == (None, "lookup+tiny-eagle")
    assert named_draft("tiny-target", "hybrid") == "suffix+tiny-draft"
    named = read_named_pair("tiny-target", "hybrid", 4, gamma_given=False)
    assert named.gamma == 16 and named.spec.copier == "suffix" and named.spec.kind == "model"
    assert read_named_pair("tiny-target", "suffix+tiny-eagle", 5).gamma == 5


@needs_pair
@pytest.mark.parametrize("draft", ["suffix+tiny-eagle", "suffix+tiny-draft"])
def test_a_loaded_hybrid_is_the_target_alone_greedy(draft: str) -> None:
    pair = load_pair("tiny-target", draft, dtype=torch.float64)
    assert isinstance(pair.draft, hybrid.HybridDrafter)
    alone = load_pair("tiny-target", None, dtype=torch.float64)
    prompt = pair.tokenizer.encode("Once upon a time there was a cat. Once upon a time")
    counts: dict[str, int] = {}
    out = speculative_generate(
        pair.target, counting(pair.draft, counts), prompt, 48, gamma=16, temperature=0
    )
    base = speculative_generate(alone.target, None, prompt, 48, temperature=0)
    assert out.tokens == base.tokens
    assert counts.get("copier", 0) > 0 and counts.get("model", 0) > 0, counts


@needs_pair
def test_the_command_line_greedy_is_the_target_alone() -> None:
    def run(*argv: str) -> dict:
        buffer = io.StringIO()
        common = ["--target", str(TARGET), "--max-new-tokens", "32", "--dtype", "float64"]
        with contextlib.redirect_stdout(buffer):
            assert generate.main([*common, "--json", *argv]) == 0
        return json.loads(buffer.getvalue())

    alone = run("--no-draft")["tokens"]
    doc = run("--draft", "hybrid")
    assert doc["tokens"] == alone
    assert doc["settings"]["draft"] == "suffix+tiny-draft"
