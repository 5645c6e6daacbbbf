"""Token-wise verification (speculative/verify/token.py) proven without sampling: Algorithm 1 emits
tokens with exactly the target's distribution.

Everything here is computed, not sampled, in float64, from the implementation's own
``acceptance_probability``, ``residual_distribution`` and ``warp``:

* one verification step, for arbitrary p and q (zeros, disjoint supports, p = q, near one-hot);
* several steps of the whole algorithm on toy n-gram models, by enumerating every drafted
  continuation and every accept/reject branch, against the target's own autoregressive
  distribution computed with the plain-Python reference warp (temperature, top-k, top-p);
* the same, with the verifier the loop calls (verify_step) run once per branch of its
  randomness (speculative.proofs.exact), so that a slip inside it (the residual, the bonus row, the
  threshold) shows;
* r = 0 exactly against a token the target rules out (the strict comparison).

Each identity is also shown to fail for a deliberately broken acceptance rule or residual. (The
cost model's formulas and gamma="auto" are tested in tests/speculative/engine/test_gamma.py.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import speculative.verify.token as verify
from speculative.proofs.exact import verifier_distribution
from speculative.sampling import Sampling, warp
from tests.support.mutation import mutated
from tests.support.proofs import proof
from tests.support.strategies import distribution, distribution_pairs, max_gap, samplings, toy_table
from tests.support.toy_models import NGramModel, target_distribution

torch.set_num_threads(1)

TOL = 1e-12
Acceptance = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
Residual = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------- one step
def one_step_distribution(
    p: torch.Tensor,
    q: torch.Tensor,
    acceptance: Acceptance = verify.acceptance_probability,
    residual: Residual = verify.residual_distribution,
) -> torch.Tensor:
    """P(emitted token = x) for one drafted position: x ~ q is kept with probability
    acceptance(x); otherwise a token is drawn from residual(p, q)."""
    vocab = p.shape[-1]
    kept = torch.stack([q[x] * acceptance(p, q, x) for x in range(vocab)])
    rejected = 1 - kept.sum()
    return kept + rejected * residual(p, q)


@proof(
    "token-wise verification emits exactly p at one position, for any p and q",
    "exact enumeration, float64, to 1e-12, 300 hypothesis pairs (zeros, disjoint supports, p = q, near one-hot)",
)
@settings(max_examples=300, derandomize=True, deadline=None)
@given(pair=distribution_pairs())
def test_one_step_emits_exactly_p(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    p, q = pair
    got = one_step_distribution(p, q)
    assert torch.allclose(got, p, atol=TOL, rtol=0), (p, q, got)


def test_one_step_special_cases() -> None:
    p = distribution([1, 2, 3, 0])
    # p == q: everything is accepted, the residual has no mass and falls back to p
    assert torch.equal(verify.residual_distribution(p, p), p)
    assert torch.equal(
        torch.stack([verify.acceptance_probability(p, p, x) for x in range(4)]),
        torch.tensor([1.0, 1, 1, 1], dtype=torch.float64),
    )
    # q(x) = 0: the value is finite (the draft never proposes x)
    q = distribution([0, 1, 1, 1])
    assert verify.acceptance_probability(p, q, 0).item() == 1.0
    # p(x) = 0: never accepted
    assert verify.acceptance_probability(p, q, 3).item() == 0.0
    # worked by hand: p = (1/6, 2/6, 3/6, 0), q = (0, 1/3, 1/3, 1/3)
    assert verify.acceptance_probability(p, q, 1).item() == pytest.approx(1.0)
    assert verify.acceptance_probability(p, q, 2).item() == pytest.approx(1.0)
    # max(0, p - q) = (1/6, 0, 1/6, 0) -> (1/2, 0, 1/2, 0)
    assert torch.allclose(
        verify.residual_distribution(p, q), distribution([1, 0, 1, 0]), atol=TOL, rtol=0
    )
    # beta = sum min(p, q) = 0 + 1/3 + 1/3 + 0
    assert verify.expected_acceptance(p, q).item() == pytest.approx(2 / 3, abs=TOL)
    # disjoint supports: nothing accepted, the residual is p
    a, b = distribution([1, 1, 0, 0]), distribution([0, 0, 1, 1])
    assert verify.acceptance_probability(a, b, 2).item() == 0.0
    assert torch.allclose(verify.residual_distribution(a, b), a, atol=TOL, rtol=0)


def test_acceptance_is_vectorised_over_positions() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 7, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(5, 7, generator=gen, dtype=torch.float64), -1)
    tokens = torch.randint(0, 7, (5,), generator=gen)
    batched = verify.acceptance_probability(p, q, tokens)
    single = torch.stack(
        [verify.acceptance_probability(p[i], q[i], int(tokens[i])) for i in range(5)]
    )
    expected = torch.minimum(
        torch.ones(5, dtype=torch.float64), p[range(5), tokens] / q[range(5), tokens]
    )
    assert torch.equal(batched, single) and torch.allclose(batched, expected, atol=TOL, rtol=0)
    residual = verify.residual_distribution(p, q)
    assert torch.allclose(
        residual, torch.stack([verify.residual_distribution(p[i], q[i]) for i in range(5)])
    )


def inverted_acceptance(p: torch.Tensor, q: torch.Tensor, token: int) -> torch.Tensor:
    return verify.acceptance_probability(q, p, token)  # min(1, q/p): the ratio upside down


def residual_is_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p


def residual_unnormalised(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p - q).clamp(min=0)


@proof(
    "the one-position identity can fail",
    "exact, the same sum on broken rules",
    rejects=("ratio inverted (min(1, q/p))", "residual = p", "residual not normalised"),
)
@pytest.mark.parametrize(
    "acceptance, residual",
    [
        (inverted_acceptance, verify.residual_distribution),
        (verify.acceptance_probability, residual_is_p),
        (verify.acceptance_probability, residual_unnormalised),
    ],
)
def test_one_step_identity_catches_broken_rules(acceptance: Acceptance, residual: Residual) -> None:
    p, q = distribution([1, 2, 3, 4]), distribution([4, 1, 1, 2])
    assert not torch.allclose(
        one_step_distribution(p, q, acceptance, residual), p, atol=1e-3, rtol=0
    )


def shifted_greedy(target_choice: torch.Tensor, drafted: torch.Tensor) -> verify.Verdict:
    """Broken on purpose: x_i compared with the target's choice one position later."""
    return verify.verify_greedy(torch.cat([target_choice[1:], target_choice[-1:]]), drafted)


@proof(
    "at temperature 0, verify_greedy is verify_step on one-hot p and q, ties included",
    "exact, 300 random cases with integer logits",
    rejects=("x_i compared with the target's choice one position later",),
)
@pytest.mark.parametrize("broken", [False, True])
def test_verify_greedy_is_verify_step_on_one_hot_distributions(broken: bool) -> None:
    """At temperature 0 the loop calls verify_greedy instead of verify_step on one-hot p and
    q: both must give the same tokens, count and overlaps, ties included (integer logits)."""
    check = shifted_greedy if broken else verify.verify_greedy
    gen = torch.Generator().manual_seed(0)
    greedy, differences = Sampling(temperature=0), 0
    for case in range(300):
        gamma, vocab = 1 + case % 6, 2 + case % 5
        target_logits = torch.randint(0, 3, (gamma + 1, vocab), generator=gen).double()
        draft_logits = torch.randint(0, 3, (gamma, vocab), generator=gen).double()
        # a draft that often agrees with the target, so that long accepted runs occur
        agree = torch.rand(gamma, generator=gen) < 0.7
        draft_logits[agree] = target_logits[:gamma][agree]
        p, q = warp(target_logits, greedy), warp(draft_logits, greedy)
        drafted = draft_logits.argmax(-1)
        expected = verify.verify_step(p, q, drafted, torch.Generator().manual_seed(case)).read()
        got = check(target_logits.argmax(-1), drafted).read()
        differences += (got.tokens, got.accepted, got.overlap) != (
            expected.tokens,
            expected.accepted,
            expected.overlap,
        )
    assert (differences > 30) if broken else (differences == 0)


# ----------------------------------------------------------------------------- several steps
def speculative_distribution(
    target: NGramModel,
    draft: NGramModel,
    prompt: tuple[int, ...],
    gamma: int,
    length: int,
    sampling: Sampling,
    acceptance: Acceptance = verify.acceptance_probability,
    residual: Residual = verify.residual_distribution,
) -> dict[tuple[int, ...], float]:
    """Exact P(first `length` emitted tokens) of Algorithm 1 with a fixed gamma: every drafted
    token, every accept/reject outcome and every residual or bonus token is a branch."""
    out: dict[tuple[int, ...], float] = {}
    cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def probs(model: NGramModel, name: str, context: tuple[int, ...]) -> torch.Tensor:
        if (name, context) not in cache:
            cache[name, context] = warp(model.next_logits(context), sampling)
        return cache[name, context]

    def emit(context: tuple[int, ...], prob: float) -> bool:
        """Record the path if `length` tokens are out; True when done."""
        if len(context) - len(prompt) < length:
            return False
        key = context[len(prompt) : len(prompt) + length]
        out[key] = out.get(key, 0.0) + prob
        return True

    def iteration(context: tuple[int, ...], prob: float) -> None:
        if not emit(context, prob):
            position(context, 0, prob)

    def position(context: tuple[int, ...], i: int, prob: float) -> None:
        """i drafted tokens of this iteration were accepted so far; context includes them."""
        if i > 0 and emit(context, prob):
            return
        p = probs(target, "p", context)
        if i == gamma:  # all accepted: the bonus token from p_{gamma+1}
            for y in range(len(p)):
                if p[y] > 0:
                    iteration(context + (y,), prob * p[y].item())
            return
        q = probs(draft, "q", context)  # q_{i+1}, conditioned on the drafted prefix
        reject = 1.0
        for x in range(len(q)):
            if q[x] > 0:
                keep = q[x].item() * acceptance(p, q, x).item()
                reject -= keep
                if keep > 0:
                    position(context + (x,), i + 1, prob * keep)
        if reject > 1e-15:
            r = residual(p, q)
            for y in range(len(r)):
                if r[y] > 0:
                    iteration(context + (y,), prob * reject * r[y].item())

    iteration(prompt, 1.0)
    return out


@proof(
    "several iterations of Algorithm 1 emit exactly the target's law (temperature, top-k, top-p)",
    "exact enumeration, float64, to 1e-12, toy n-gram models, every drafted chain and accept/reject branch",
)
@settings(max_examples=150, derandomize=True, deadline=None)
@given(
    vocab=st.integers(2, 4),
    gamma=st.integers(1, 3),
    orders=st.sampled_from([(2, 2), (3, 2), (2, 3), (3, 3)]),
    seed=st.integers(0, 10_000),
    holes=st.sampled_from([0.0, 0.3]),
    relation=st.sampled_from(["other", "same"]),
    sampling=samplings,
)
def test_several_steps_emit_exactly_the_target_distribution(
    vocab: int,
    gamma: int,
    orders: tuple[int, int],
    seed: int,
    holes: float,
    relation: str,
    sampling: Sampling,
) -> None:
    target = NGramModel(toy_table(vocab, orders[0], seed, holes))
    draft = (
        target if relation == "same" else NGramModel(toy_table(vocab, orders[1], seed + 1, holes))
    )
    prompt, length = (1 % vocab,), 3
    got = speculative_distribution(target, draft, prompt, gamma, length, sampling)
    expected = target_distribution(target, prompt, length, sampling)
    assert math.isclose(sum(got.values()), 1.0, abs_tol=TOL)
    assert max_gap(got, expected) < TOL


@proof(
    "exact when the draft only proposes tokens the target never emits",
    "exact enumeration, float64, to 1e-12",
)
def test_disjoint_supports_several_steps() -> None:
    """The draft proposes only tokens the target never emits: every token comes from the residual."""
    neg = -math.inf
    target = NGramModel(torch.tensor([[0.0, 1.0, neg, neg]] * 4, dtype=torch.float64))
    draft = NGramModel(torch.tensor([[neg, neg, 0.5, 0.0]] * 4, dtype=torch.float64))
    for gamma in (1, 3):
        got = speculative_distribution(target, draft, (0,), gamma, 3, Sampling())
        assert max_gap(got, target_distribution(target, (0,), 3, Sampling())) < TOL


@proof("the several-step identity can fail", "exact", rejects=("ratio inverted", "residual = p"))
@pytest.mark.parametrize(
    "acceptance, residual",
    [
        (inverted_acceptance, verify.residual_distribution),
        (verify.acceptance_probability, residual_is_p),
    ],
)
def test_several_steps_catch_broken_rules(acceptance: Acceptance, residual: Residual) -> None:
    target = NGramModel(toy_table(3, 2, 5, 0.0))
    draft = NGramModel(toy_table(3, 2, 6, 0.0))
    got = speculative_distribution(target, draft, (0,), 2, 3, Sampling(), acceptance, residual)
    assert max_gap(got, target_distribution(target, (0,), 3, Sampling())) > 1e-3


@proof(
    "drafting from one q and judging with another is caught",
    "exact",
    rejects=("q judged untempered (transformers #47932 / vLLM #10198)",),
)
def test_several_steps_catch_a_warp_applied_to_one_model_only() -> None:
    """Warping q with another temperature than p is itself fine (any q works), as long as
    the token is drawn from the q used in the ratio. Drafting from one q and judging with
    another is the bug: emulate it by judging with the untempered draft distribution."""
    target = NGramModel(toy_table(3, 2, 7, 0.0))
    draft = NGramModel(toy_table(3, 2, 8, 0.0))
    sampling = Sampling(temperature=0.5)

    def untempered(q: torch.Tensor) -> torch.Tensor:
        raw = q**sampling.temperature  # softmax(l / T) ** T is proportional to softmax(l)
        return raw / raw.sum()

    def acceptance(p: torch.Tensor, q: torch.Tensor, token: int) -> torch.Tensor:
        return verify.acceptance_probability(p, untempered(q), token)

    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return verify.residual_distribution(p, untempered(q))

    got = speculative_distribution(target, draft, (0,), 2, 3, sampling, acceptance, residual)
    assert max_gap(got, target_distribution(target, (0,), 3, sampling)) > 1e-3


# ----------------------------------------------------------------------------- r = 0
def forced_uniforms_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.rand returns exactly 0 (it can: it draws from [0, 1))."""
    monkeypatch.setattr(
        torch, "rand", lambda *shape, **kwargs: torch.zeros(*shape, dtype=kwargs.get("dtype"))
    )


@proof(
    "a token of target probability 0 is never accepted, even at r = 0 (strict r < p/q)",
    "exact: the uniforms forced to 0",
    rejects=("r <= p/q (SGLang #35771)",),
)
def test_verify_step_never_keeps_a_token_the_target_rules_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """r = 0 against a drafted token of target probability 0: the strict r < p/q rejects it and
    the residual gives another token. SGLang #35771 compared with <=, which accepts it: the one
    mutant that every other test lets through, since r = 0 has probability 0 under sampling."""
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.6, 0.2, 0.2]], dtype=torch.float64)
    drafted = torch.tensor([0])
    forced_uniforms_zero(monkeypatch)
    got = verify.verify_step(p, q, drafted, torch.Generator()).read()
    assert got.accepted == 0 and got.tokens[0] != 0
    lenient = mutated(verify, ("accepted = r < ratio", "accepted = r <= ratio"))
    broken = lenient.verify_step(p, q, drafted, torch.Generator()).read()
    assert broken.accepted == 1 and broken.tokens[0] == 0


# ----------------------------------------------------------------------------- the verifier itself, enumerated
# verifier_distribution (speculative.proofs.exact) runs verify_step itself once per branch of its randomness:
# every uniform below or above the threshold it is compared with, every token its sampler can return.


@proof(
    "the verifier the engine calls (verify_step itself, run once per branch of its randomness) emits exactly "
    "the target's law",
    "exact enumeration, float64, to 1e-12, hypothesis: vocab 2-3, gamma 1-2, zeros in p and q",
)
@settings(max_examples=12, derandomize=True, deadline=None)
@given(
    vocab=st.integers(2, 3),
    gamma=st.integers(1, 2),
    seed=st.integers(0, 10_000),
    holes=st.sampled_from([0.0, 0.3]),
    sampling=samplings,
)
def test_the_loops_verifier_emits_exactly_the_target_distribution(
    vocab: int, gamma: int, seed: int, holes: float, sampling: Sampling
) -> None:
    target, draft = (
        NGramModel(toy_table(vocab, 2, seed, holes)),
        NGramModel(toy_table(vocab, 2, seed + 1, holes)),
    )
    got = verifier_distribution(target, draft, (0,), gamma, 3, sampling)
    assert max_gap(got, target_distribution(target, (0,), 3, sampling)) < TOL


@proof(
    "a wiring slip inside verify_step is caught",
    "exact enumeration of the mutated function",
    rejects=(
        "the residual against a one-hot q",
        "the bonus drawn from p_gamma",
        "the ratio inverted (q/p)",
    ),
)
@pytest.mark.parametrize(
    "slip",
    [
        (
            "residual_distribution(p[:gamma], q)",  # the residual against a one-hot q (xLLM #2175's kind of slip)
            "residual_distribution(p[:gamma], torch.nn.functional.one_hot(drafted, q.shape[-1]).to(q.dtype))",
        ),
        ("p[gamma:]])", "p[gamma - 1:gamma]])"),  # the bonus drawn from p_g, not p_{g+1}
        (
            "ratio = acceptance_probability(p[:gamma], q, drafted)",  # the ratio inverted: q/p
            "ratio = acceptance_probability(q, p[:gamma], drafted)",
        ),
    ],
)
def test_the_enumeration_of_the_verifier_catches_wiring_slips(slip: tuple[str, str]) -> None:
    """Slips inside verify_step that a reference built from acceptance_probability and
    residual_distribution could not see: the enumeration of the function itself does."""
    broken = mutated(verify, slip).verify_step
    target, draft = NGramModel(toy_table(3, 2, 5, 0.0)), NGramModel(toy_table(3, 2, 6, 0.0))
    got = verifier_distribution(target, draft, (0,), 2, 3, Sampling(), broken)
    assert max_gap(got, target_distribution(target, (0,), 3, Sampling())) > 1e-3
