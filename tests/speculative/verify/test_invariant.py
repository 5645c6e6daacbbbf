"""Drafter-invariant verification (speculative/verify/invariant.py, Daliri, Musco & Suresh 2024):
the target's token at each position is its Gumbel-max sample with noise keyed by (seed, position),
a drafted token is kept when it is that token.

* invariance: for a seed, speculative decoding under the rule emits the target alone's tokens
  (the engine with nothing drafted, which samples with the same keyed noise), token for token, for
  a close draft model, an unrelated one and prompt lookup, gamma 1, 2, 4 and "auto", warped
  sampling, and a row of a batch against the row alone; float64 toys, so no near-tie can flip a
  token (docs/algorithm.md, numerics policy);
* the mutants: noise keyed by the iteration instead of the position, or drawn from the row's random
  stream (which the drafter consumes too), break that identity; the rule emitting the drafted token
  at a mismatch, or the draft's sample there, breaks the exact law;
* the law: the exact law of several iterations on toy n-gram tables (every drafted chain, every
  keyed draw enumerated as a draw from its law, speculative.proofs.branching) is the target's to
  1e-12; the real engine with its real noise passes a chi-square test against the target's law, and
  noise keyed by the offset within an iteration (the same noise at every iteration) fails it;
* the noise: a pure function of (seed, position), whose Gumbel-max token has the law it is given
  and never a token of probability 0;
* acceptance: a close draft has drafted tokens accepted (about sum_x p(x) q(x) of them).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest
import torch

import speculative.engine.engine as engine_module
from speculative import speculative_generate, speculative_generate_batch
from speculative.draft.lookup import PromptLookupDrafter
from speculative.engine.engine import Engine
from speculative.proofs.branching import Branching
from speculative.proofs.cases import VERIFIER_CASES, TableCase
from speculative.proofs.exact import verifier_distribution
from speculative.proofs.properties import target_law
from speculative.sampling import KeyedNoise, Sampling, noise_key, sample_keyed
from speculative.verify import RULES
from speculative.verify.invariant import first_mismatch, verify_invariant
from speculative.verify.registry import keyed
from speculative.verify.token import expected_acceptance
from speculative.verify.verdict import Verdict
from tests.support.proofs import proof
from tests.support.toy_models import (
    chi_square_pvalue,
    llama_next_logits,
    noisy_copy,
    random_llama,
    reference_greedy,
    target_distribution,
)

torch.set_num_threads(1)

VOCAB = 16
PROMPT = [1, 2, 1]
NEW = 20
SEEDS = range(4)


def toy(seed: int, vocab: int = VOCAB, std: float = 0.6) -> torch.nn.Module:
    return random_llama(
        vocab=vocab, dim=16, n_layers=1, max_seq_len=64, seed=seed, std=std, dtype=torch.float64
    )


@pytest.fixture(scope="module")
def pair() -> dict[str, torch.nn.Module]:
    """A float64 toy target, a close draft (a noisy copy), an unrelated one (other weights)."""
    target = toy(3)
    return {"target": target, "close": noisy_copy(target, std=0.05, seed=1), "unrelated": toy(99)}


DRAFTERS: dict[str, Callable[[dict], object]] = {
    "close draft": lambda pair: pair["close"],
    "unrelated draft": lambda pair: pair["unrelated"],
    "lookup": lambda pair: PromptLookupDrafter(),
}
SAMPLINGS = {
    "temperature 1": Sampling(),
    "temperature 0.8, top-k 6, top-p 0.9": Sampling(temperature=0.8, top_k=6, top_p=0.9),
}


def alone(
    target: torch.nn.Module,
    prompt: list[int],
    seed: int,
    sampling: Sampling = SAMPLINGS["temperature 1"],
    new: int = NEW,
) -> list[int]:
    """The target alone under the rule: the engine with nothing drafted, its plain steps drawn with
    the rule's keyed noise."""
    engine = Engine(
        target,
        None,
        verify="invariant",
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
    )
    row = engine.add(prompt, new, seed=seed)
    engine.run()
    return row.result().tokens


def mismatches(pair: dict, sampling: Sampling, seeds=SEEDS) -> list[str]:
    """Every (drafter, gamma, seed) whose speculative tokens are not the target alone's."""
    target = pair["target"]
    found = []
    for seed in seeds:
        expected = alone(target, PROMPT, seed, sampling)
        for (name, make), gamma in itertools.product(DRAFTERS.items(), (1, 2, 4, "auto")):
            out = speculative_generate(
                target,
                make(pair),
                PROMPT,
                NEW,
                gamma=gamma,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                seed=seed,
                verify="invariant",
            )
            if out.tokens != expected:
                found.append(f"{name}, gamma {gamma}, seed {seed}: {out.tokens} != {expected}")
    return found


# ----------------------------------------------------------------------------- invariance
@proof(
    "for a seed, drafter-invariant verification emits the target alone's tokens, whatever the drafter and gamma",
    "token identity, float64 toy LLaMA, 3 drafters x gamma 1, 2, 4, auto x 4 seeds x 2 samplings",
    rejects=("noise keyed by the iteration", "noise from the row's random stream"),
)
@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_speculative_is_the_target_alone_token_for_token(pair: dict, sampling: Sampling) -> None:
    assert mismatches(pair, sampling) == []


@proof(
    "a row of a batch under drafter-invariant verification emits the tokens of the row alone and of the target alone",
    "token identity, float64 toy LLaMA, 3 rows of other prompts and lengths, 3 seeds",
)
def test_a_row_of_a_batch_is_the_target_alone(pair: dict) -> None:
    prompts = [[1, 2, 1], [3], [4, 5, 6, 7, 4]]
    for seed in range(3):
        batch = speculative_generate_batch(
            pair["target"], pair["close"], prompts, NEW, gamma=3, seed=seed, verify="invariant"
        )
        for i, (prompt, result) in enumerate(zip(prompts, batch.results)):
            assert result.tokens == alone(pair["target"], prompt, seed + i), (seed, i)


def test_a_seed_repeats_and_another_seed_differs(pair: dict) -> None:
    """The identity is not that of a constant: the output moves with the seed, and is not what
    another rule samples for that seed."""
    runs = {seed: tuple(alone(pair["target"], PROMPT, seed)) for seed in range(4)}
    assert len(set(runs.values())) == 4
    again = speculative_generate(pair["target"], pair["close"], PROMPT, NEW, seed=0, verify="block")
    assert tuple(again.tokens) != runs[0]


# ----------------------------------------------------------------------------- mutants of the key
def by_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Noise keyed by (seed, the row's iteration, offset within it): each draw is fresh, so the law
    stays the target's, but the target alone's k-th token and the k-th iteration's tokens share no noise."""
    iterations: Counter = Counter()

    def noise(seed: int, start: int) -> KeyedNoise:
        iterations[seed] += 1
        return KeyedNoise(seed, 1000 * iterations[seed])

    monkeypatch.setattr(engine_module, "KeyedNoise", noise)


def from_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Noise from the row's own random stream, which the drafter draws from too: what the target
    draws at a position depends on how many numbers were drawn before it."""
    real = engine_module.Engine.verify

    def verify(self, rows, draft, logits):
        streams = iter([row.generator for row in rows])
        monkeypatch.setattr(engine_module, "KeyedNoise", lambda seed, start: next(streams))
        return real(self, rows, draft, logits)

    monkeypatch.setattr(engine_module.Engine, "verify", verify)


@pytest.mark.parametrize("mutant", [by_iteration, from_the_stream], ids=["iteration", "stream"])
def test_noise_keyed_otherwise_breaks_the_identity(
    pair: dict, mutant: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    mutant(monkeypatch)
    assert mismatches(pair, Sampling(), seeds=range(2))


# ----------------------------------------------------------------------------- the law
def emits_the_draft_at_a_mismatch(p, q, drafted, noise) -> Verdict:
    """Mutant: at the first mismatch the drafted token is emitted instead of the target's."""
    own = sample_keyed(p, noise)
    gamma = drafted.shape[0]
    padded = torch.cat([drafted, own[gamma:]])  # [gamma+1]: x_1..x_gamma, y_{gamma+1}

    def finish(xs, ys, zs, overlap):
        out = first_mismatch(xs, ys, overlap)
        out.tokens[-1] = zs[out.accepted]
        return out

    return Verdict([drafted, own, padded, expected_acceptance(p[:gamma], q)], finish)


def the_drafts_sample_at_a_mismatch(p, q, drafted, noise) -> Verdict:
    """Mutant: the token after the accepted ones drawn from q (the draft's law) where there is a q."""
    gamma = drafted.shape[0]
    own = sample_keyed(p, noise)
    theirs = torch.cat([sample_keyed(q, noise), own[gamma:]]) if gamma else own
    return Verdict(
        [drafted, own, theirs, expected_acceptance(p[:gamma], q)],
        lambda xs, ys, zs, overlap: first_mismatch(xs, zs, overlap),
    )


def law_gap(rule: Callable, case: TableCase) -> float:
    target, draft = case.models()
    with Branching() as branching:
        got = verifier_distribution(
            target, draft, (0,), case.gamma, case.length, case.sampling, rule, branching
        )
    expected = target_distribution(target, (0,), case.length, case.sampling)
    return max(abs(got.get(k, 0.0) - expected.get(k, 0.0)) for k in set(got) | set(expected))


@proof(
    "several drafter-invariant iterations emit exactly the target's law",
    "exact enumeration, float64, to 1e-12, the checker's 7 table cases (zeros, temperature, top-k, top-p, greedy)",
    rejects=("the drafted token emitted at a mismatch", "the draft's sample emitted at a mismatch"),
)
def test_several_iterations_have_exactly_the_target_law() -> None:
    for case in VERIFIER_CASES:
        assert law_gap(verify_invariant, case) < 1e-12, case


@pytest.mark.parametrize("mutant", [emits_the_draft_at_a_mismatch, the_drafts_sample_at_a_mismatch])
def test_the_exact_law_rejects_wrong_rules(mutant: Callable) -> None:
    sampled = [case for case in VERIFIER_CASES if not case.sampling.greedy]
    assert any(law_gap(mutant, case) > 1e-3 for case in sampled)  # stops at the first it fails


def engine_counts(target, draft, runs: int, length: int, sampling: Sampling) -> Counter:
    counts: Counter = Counter()
    for seed in range(runs):
        out = speculative_generate(
            target,
            draft,
            [1, 5, 1],
            length,
            gamma=2,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            seed=seed,
            verify="invariant",
        )
        counts[tuple(out.tokens)] += 1
    return counts


def by_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Noise keyed by the offset within the iteration alone: the same noise at every iteration."""
    monkeypatch.setattr(engine_module, "KeyedNoise", lambda seed, start: KeyedNoise(seed, 0))


@proof(
    "the engine's drafter-invariant tokens, with their real keyed Gumbel noise, follow the target's law",
    "chi-square, p > 1e-3, 1500 seeds, first 3 tokens of a vocabulary of 8, temperature 0.8, top-k 5",
    rejects=("noise keyed by the offset within the iteration",),
)
@pytest.mark.parametrize("mutant", [None, by_offset], ids=["real", "offset-keyed"])
def test_the_engine_follows_the_target_law(
    mutant: Callable | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = toy(23, vocab=8)
    draft = noisy_copy(target, std=0.3, seed=7)
    sampling = Sampling(temperature=0.8, top_k=5)
    if mutant is not None:
        mutant(monkeypatch)
    counts = engine_counts(target, draft, 1500, 3, sampling)
    expected = target_law(llama_next_logits(target), (1, 5, 1), 3, sampling)
    p_value = chi_square_pvalue(counts, expected)
    if mutant is None:
        assert p_value > 1e-3
    else:
        assert p_value < 1e-3


# ----------------------------------------------------------------------------- the noise
def test_the_noise_is_a_function_of_seed_and_position_alone() -> None:
    first = KeyedNoise(3, 5).gumbel(3, 10)  # positions 5, 6, 7
    assert torch.equal(first[1:], KeyedNoise(3, 6).gumbel(2, 10))
    assert not torch.equal(first[0], KeyedNoise(4, 5).gumbel(1, 10)[0])
    assert len({noise_key(s, t) for s in range(50) for t in range(50)}) == 2500
    assert torch.isfinite(first).all()


def test_a_keyed_draw_has_its_law_and_never_a_ruled_out_token() -> None:
    """Over 4000 (seed, position) keys, argmax(log p + G) follows p (chi-square), never a token of
    probability 0, and the same key and law give the same token."""
    p = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0], dtype=torch.float64)
    tokens = [
        int(sample_keyed(p[None], KeyedNoise(seed, position))[0])
        for seed in range(40)
        for position in range(100)
    ]
    counts = Counter((t,) for t in tokens)
    assert chi_square_pvalue(counts, {(x,): float(v) for x, v in enumerate(p)}) > 1e-3
    assert int(sample_keyed(p[None], KeyedNoise(7, 9))[0]) == tokens[7 * 100 + 9]
    one_hot = torch.zeros(1, 6, dtype=torch.float64)
    one_hot[0, 4] = 1
    assert all(int(sample_keyed(one_hot, KeyedNoise(s, 0))[0]) == 4 for s in range(20))


def test_the_rule_is_registered_keyed_and_greedy() -> None:
    assert RULES["invariant"].verify is verify_invariant and RULES["invariant"].greedy
    assert keyed("invariant") and keyed(verify_invariant)
    assert not keyed("token") and not keyed("block")


def test_greedy_is_the_target_greedy(pair: dict) -> None:
    expected = reference_greedy(pair["target"], PROMPT, NEW)
    for gamma in (1, 4):
        out = speculative_generate(
            pair["target"],
            pair["unrelated"],
            PROMPT,
            NEW,
            gamma=gamma,
            temperature=0,
            seed=0,
            verify="invariant",
        )
        assert out.tokens == expected
    assert alone(pair["target"], PROMPT, 0, Sampling(temperature=0)) == expected


# ----------------------------------------------------------------------------- acceptance
def test_a_close_draft_is_accepted(pair: dict) -> None:
    """A draft close to the target has its tokens accepted (the unrelated one far less): the rule
    is not the target alone with the drafts thrown away."""
    accepted = {}
    for name in ("close", "unrelated"):
        total = drafted = 0
        for seed in range(6):
            stats = speculative_generate(
                pair["target"], pair[name], PROMPT, NEW, gamma=2, seed=seed, verify="invariant"
            ).stats
            total += stats.accepted_draft_tokens
            drafted += stats.drafted_tokens
        accepted[name] = total / drafted
    assert accepted["close"] > 0.15 and accepted["close"] > accepted["unrelated"]
