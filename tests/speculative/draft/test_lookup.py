"""Prompt lookup (speculative/draft/lookup.py), and Algorithm 1's exactness with a deterministic
drafter.

* Its incremental index against a brute-force scan written here, and by hand.
* Exact enumeration with a deterministic drafter: q is one-hot on the drafted token, and
  the emitted distribution equals the target's to 1e-12 in float64 -- with the real
  prompt-lookup proposals, blocks shorter than gamma and empty blocks included; broken
  rules are caught by the same enumeration.
* Chi-square end to end (a toy bigram target), with the variants of tests/support/statistical.py
  that apply to it (temperature-on-p-only is no bug for a one-hot q, and bonus-from-draft needs
  a draft model's distribution).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative import PromptLookupDrafter, speculative_generate
from speculative.draft.lookup import NgramIndex
from speculative.sampling import Sampling, warp
from tests.support.proofs import proof
from tests.support.statistical import (
    BUGS,
    NOT_BUGS,
    P_VALUE,
    Setting,
    sample_counts,
    window_distribution,
)
from tests.support.strategies import max_gap, samplings, toy_table
from tests.support.toy_models import (
    NGramModel,
    chi_square_pvalue,
    ref_warp,
    reference_greedy_toy,
    target_distribution,
)

verify = importlib.import_module("speculative.verify.token")

TOL = 1e-12


# ----------------------------------------------------------------------------- prompt lookup
def brute_force_lookup(ids: list[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Scan every earlier occurrence of every suffix, longest first, latest first."""
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        suffix = ids[len(ids) - n :]
        for start in range(len(ids) - n - 1, -1, -1):  # a match needs a token after it
            if ids[start : start + n] == suffix:
                return ids[start + n : start + n + gamma]
    return []


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    gamma=st.integers(1, 6),
    ngrams=st.sampled_from([(3, 1), (2, 2), (4, 2), (1, 1)]),
    split=st.integers(1, 40),
)
def test_lookup_matches_a_brute_force_scan(
    ids: list[int], gamma: int, ngrams: tuple[int, int], split: int
) -> None:
    """Also when the sequence grows between calls (the index is updated incrementally)."""
    drafter = NgramIndex(*ngrams)
    first = ids[: min(split, len(ids))]
    assert drafter.lookup(first, gamma) == brute_force_lookup(first, gamma, *ngrams)
    assert drafter.lookup(ids, gamma) == brute_force_lookup(ids, gamma, *ngrams)


@proof(
    "prompt lookup copies after the latest occurrence",
    "exact, by hand",
    rejects=("lookup's first occurrence (behaviour, not exactness)",),
)
def test_lookup_by_hand() -> None:
    drafter = NgramIndex(max_ngram=3, min_ngram=1)
    assert drafter.lookup([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]  # "5 6 7" followed by 8 9 5
    assert drafter.lookup([1, 2, 3, 4], 3) == []  # no suffix occurred before
    assert drafter.lookup([1, 2, 9, 1, 2, 8, 1, 2], 2) == [8, 1]  # the latest occurrence
    assert drafter.lookup([4, 4], 5) == [4]  # overlapping with the suffix itself
    assert NgramIndex(max_ngram=2, min_ngram=2).lookup([3, 1, 2, 3], 2) == []  # 1-grams not allowed


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_ngram": 0}, "max_ngram"),
        ({"min_ngram": 0}, "min_ngram"),
        ({"max_ngram": 2, "min_ngram": 3}, "exceed"),
        ({"max_ngram": 2.5}, "max_ngram"),
        ({"min_ngram": True}, "min_ngram"),
    ],
)
def test_lookup_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PromptLookupDrafter(**kwargs)


def test_lookup_copies_a_repeated_text_and_stays_exact_greedy() -> None:
    """A target that cycles through 0..5 is copied perfectly once one cycle is in the prompt."""
    table = torch.full((6, 6), -5.0, dtype=torch.float64)
    for a in range(6):
        table[a, (a + 1) % 6] = 5.0
    target = NGramModel(table)
    out = speculative_generate(
        target, PromptLookupDrafter(), [0, 1, 2, 3, 4, 5, 0], 24, gamma=4, temperature=0
    )
    assert out.tokens == reference_greedy_toy(target, [0, 1, 2, 3, 4, 5, 0], 24)
    assert out.stats.accepted_draft_tokens == out.stats.drafted_tokens > 0
    assert out.stats.draft_calls == 0 and out.stats.tokens_per_target_call > 4


# ----------------------------------------------------------------------------- exact, deterministic drafter
def lookup_distribution(
    target: NGramModel,
    prompt: tuple[int, ...],
    gamma: int,
    length: int,
    sampling: Sampling,
    acceptance=verify.acceptance_probability,
    residual=verify.residual_distribution,
) -> dict[tuple[int, ...], float]:
    """Exact P(first `length` emitted tokens) of Algorithm 1 with prompt lookup as the drafter:
    each iteration's block is the real drafter's proposal for the sequence so far (possibly
    shorter than gamma, or empty), q_i is one-hot on x_i, and every accept/reject outcome
    and every residual or bonus token is a branch."""
    out: dict[tuple[int, ...], float] = {}

    def p_of(context: tuple[int, ...]) -> torch.Tensor:
        return warp(target.next_logits(context), sampling)

    def emit(context: tuple[int, ...], prob: float) -> bool:
        if len(context) - len(prompt) < length:
            return False
        key = context[len(prompt) : len(prompt) + length]
        out[key] = out.get(key, 0.0) + prob
        return True

    def iteration(context: tuple[int, ...], prob: float) -> None:
        if emit(context, prob):
            return
        block = NgramIndex().lookup(list(context), gamma)
        position(context, block, 0, prob)

    def position(context: tuple[int, ...], block: list[int], i: int, prob: float) -> None:
        if i > 0 and emit(context, prob):
            return
        p = p_of(context)
        if i == len(block):  # all accepted (or nothing proposed): the token comes from p
            for y in range(len(p)):
                if p[y] > 0:
                    iteration(context + (y,), prob * p[y].item())
            return
        x = block[i]
        q = torch.zeros_like(p)
        q[x] = 1.0
        keep = acceptance(p, q, x).item()
        if keep > 0:
            position(context + (x,), block, i + 1, prob * keep)
        if 1 - keep > 1e-15:
            r = residual(p, q)
            for y in range(len(r)):
                if r[y] > 0:
                    iteration(context + (y,), prob * (1 - keep) * r[y].item())

    iteration(prompt, 1.0)
    return out


@proof("prompt lookup emits exactly the target's law", "exact enumeration, float64, to 1e-12")
@settings(max_examples=120, derandomize=True, deadline=None)
@given(
    vocab=st.integers(2, 4),
    gamma=st.integers(1, 3),
    order=st.sampled_from([2, 3]),
    seed=st.integers(0, 10_000),
    holes=st.sampled_from([0.0, 0.3]),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=5),
    sampling=samplings,
)
def test_lookup_emits_exactly_the_target_distribution(
    vocab: int,
    gamma: int,
    order: int,
    seed: int,
    holes: float,
    prompt: list[int],
    sampling: Sampling,
) -> None:
    target = NGramModel(toy_table(vocab, order, seed, holes))
    prompt = tuple(t % vocab for t in prompt)
    got = lookup_distribution(target, prompt, gamma, 3, sampling)
    assert math.isclose(sum(got.values()), 1.0, abs_tol=TOL)
    assert max_gap(got, target_distribution(target, prompt, 3, sampling)) < TOL


def always_accept(p: torch.Tensor, q: torch.Tensor, token: int) -> torch.Tensor:
    """The lookup's tokens taken as right: acceptance 1 wherever the target allows them."""
    return (p[token] > 0).to(p.dtype)


@proof(
    "the lookup enumeration can fail",
    "exact",
    rejects=("residual from p", "always accept", "ratio inverted"),
)
@pytest.mark.parametrize(
    "name, acceptance, residual",
    [
        ("residual-from-p", verify.acceptance_probability, lambda p, q: p),
        ("always-accept", always_accept, verify.residual_distribution),
        (
            "inverted-ratio",
            lambda p, q, x: verify.acceptance_probability(q, p, x),
            verify.residual_distribution,
        ),
    ],
)
def test_lookup_enumeration_catches_broken_rules(name: str, acceptance, residual) -> None:
    target = NGramModel(toy_table(3, 2, 5, 0.0))
    prompt = (0, 1, 2, 0, 1)  # lookup proposes from the first iteration on
    got = lookup_distribution(target, prompt, 2, 3, Sampling(), acceptance, residual)
    assert max_gap(got, target_distribution(target, prompt, 3, Sampling())) > 1e-3, name


# ----------------------------------------------------------------------------- chi-square, lookup
LOOKUP_RUNS = 2000
LOOKUP_PROMPT = [0, 1, 2, 0, 1]
LOOKUP_SAMPLING = Sampling(temperature=0.7)
LOOKUP_BUGS = [
    "inverted-ratio",
    "residual-from-p",
    "q-of-next-position",
]  # the others need a draft model's q


@pytest.fixture(scope="module")
def lookup_toy() -> dict:
    target = NGramModel.random(3, 2, seed=10, scale=1.0)
    s = LOOKUP_SAMPLING

    def next_probs(ctx: tuple[int, ...]) -> list[float]:
        return ref_warp(target.next_logits(ctx).tolist(), s.temperature, s.top_k, s.top_p)

    return {"target": target, "next_probs": next_probs}


@proof(
    "the engine with prompt lookup follows the target's law",
    "chi-square, p > 1e-3, 2000 seeded runs",
    rejects=("ratio inverted", "residual from p", "q of the next position"),
)
@pytest.mark.parametrize(
    "variant", ["correct", "gamma-auto", "ratio-without-min", "no-bonus-token"] + LOOKUP_BUGS
)
def test_lookup_first_tokens_have_the_target_distribution(
    lookup_toy: dict, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    patch = BUGS.get(variant) or NOT_BUGS[variant]
    if patch is not None:
        patch(monkeypatch, Setting(LOOKUP_SAMPLING, draft_after=lambda drafted: None))
    gamma = "auto" if variant == "gamma-auto" else 2
    s = LOOKUP_SAMPLING
    drafted = 0

    def generate(seed: int) -> list[int]:
        nonlocal drafted
        out = speculative_generate(
            lookup_toy["target"],
            PromptLookupDrafter(),
            LOOKUP_PROMPT,
            3,
            gamma=gamma,
            temperature=s.temperature,
            seed=seed,
            verify="token",  # the bugs catalogued are of the token-wise rule
        )
        drafted += out.stats.drafted_tokens
        return out.tokens

    counts = sample_counts(generate, LOOKUP_RUNS, 0, 3)
    assert drafted >= LOOKUP_RUNS  # the lookup did propose
    p_value = chi_square_pvalue(
        counts, window_distribution(lookup_toy["next_probs"], LOOKUP_PROMPT, 0, 3)
    )
    if variant in BUGS:
        assert p_value < P_VALUE, f"the test did not catch {variant} (p = {p_value:.3g})"
    else:
        assert p_value > P_VALUE, f"{variant} rejected (p = {p_value:.3g})"
