"""Block verification (speculative/verify/block.py) proven without sampling, the way Algorithm 1 is in
tests/speculative/verify/test_token.py.

An iteration's law is computed exactly: every drafted block x_1..x_gamma (each x_i ~ q_i, drawn
before anything is judged), weighted by q(x^gamma), then the block rule's P(tau = n | block) and
the distribution of the target's token t at each n (``block_outcomes``). From that:

* exactness: the emitted tokens have the target's distribution to 1e-12 in float64, for
  hypothesis-generated blocks of conditional distributions (zeros, disjoint supports, equal,
  one-hot) and over several iterations of toy n-gram models with temperature, top-k and top-p;
* optimality: E[accepted] under block verification >= under token-wise verification in every
  case, and strictly greater in many (the paper's 11/9 against 10/9 among them);
* greedy: on one-hot p and q, verify_block returns what verify_step and verify_greedy return;
* mutants: the token-wise rule put in the block's place (vllm-ascend #7807) is exact, so only the
  optimality check sees it; wrong block rules (the token-wise residual after the block's
  acceptance, a forward scan, the weights used as stop probabilities) break the exact identity;
* verify_block itself samples what block_outcomes says (a chi-square test on fixed blocks).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import speculative.verify.block as block
import speculative.verify.token as verify
from speculative import speculative_generate
from speculative.sampling import Sampling, warp
from speculative.verify.block import (
    block_outcomes,
    block_residuals,
    block_weights,
    stop_probabilities,
    verify_block,
)
from tests.support.proofs import proof
from tests.support.strategies import max_gap, samplings, toy_table
from tests.support.toy_models import NGramModel, chi_square_pvalue, ref_warp, sequence_distribution

torch.set_num_threads(1)

TOL = 1e-12
Context = tuple[int, ...]
Probs = Callable[[Context], torch.Tensor]
# (p [gamma+1, V], q [gamma, V], drafted [gamma]) -> (P(n accepted) [gamma+1], t's distribution at each n [gamma+1, V])
Outcomes = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------- rules, real and broken
def block_rule(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    law = block_outcomes(p, q, drafted)
    return law.accepted, law.fallback


def scan_backwards(stop: torch.Tensor) -> torch.Tensor:
    """P(tau = n) of line B5 for stop probabilities h_1..h_gamma, written as a loop."""
    gamma = stop.shape[0]
    law = torch.zeros(gamma + 1, dtype=stop.dtype)
    reach = 1.0  # probability that the scan from gamma down reaches position i
    for i in range(gamma, 0, -1):
        law[i] = reach * stop[i - 1]
        reach = reach * (1 - stop[i - 1])
    law[0] = reach
    return law


def tokenwise_rule(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 as a law over n: keep x_1..x_n while each passes min(1, p_i/q_i), then the
    residual norm(max(0, p - q)). Also mutant f: "block verification" computed with this rule."""
    gamma = drafted.shape[0]
    keep = verify.acceptance_probability(p[:gamma], q, drafted)
    # P(the first n are all kept)
    before = torch.cat([torch.ones(1, dtype=p.dtype), keep.cumprod(0)])
    law = before * torch.cat([1 - keep, torch.ones(1, dtype=p.dtype)])
    return law, torch.cat([verify.residual_distribution(p[:gamma], q), p[gamma:]])


def block_with_tokenwise_residual(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Broken: the block's tau, but t from norm(max(0, p - q)) instead of norm(max(0, w_tau p - q))."""
    law, _ = block_rule(p, q, drafted)
    return law, tokenwise_rule(p, q, drafted)[1]


def block_scanned_forwards(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Broken: keep x_i while eta_i < h_i from the front, stop at the first failure (no backward look)."""
    law = block_outcomes(p, q, drafted)
    h = law.stop
    before = torch.cat([torch.ones(1, dtype=p.dtype), h.cumprod(0)])
    return before * torch.cat([1 - h, torch.ones(1, dtype=p.dtype)]), law.fallback


def block_weights_as_stops(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Broken: the backward scan, but stopping at i with probability w_i instead of h_i."""
    law = block_outcomes(p, q, drafted)
    return scan_backwards(block_weights(p, q, drafted)[1:]), law.fallback


# ----------------------------------------------------------------------------- exact laws
def iteration_law(
    target: Probs, draft: Probs, context: Context, gamma: int, rule: Outcomes
) -> tuple[dict[Context, float], float]:
    """Exact law of one iteration after `context`: P(emitted = x_1..x_n, t), and E[n].

    The whole block is drafted first (x_i ~ q_i, conditioned on x_1..x_{i-1}); only then does
    the rule see it, with p_1..p_{gamma+1} and q_1..q_gamma of that block."""
    out: dict[Context, float] = {}
    mean_accepted = 0.0

    def draft_from(block: Context, prob: float) -> None:
        nonlocal mean_accepted
        if len(block) < gamma:
            q = draft(context + block)
            for x, qx in enumerate(q.tolist()):
                if qx > 0:
                    draft_from(block + (x,), prob * qx)
            return
        p = torch.stack([target(context + block[:i]) for i in range(gamma + 1)])
        q = torch.stack([draft(context + block[:i]) for i in range(gamma)]) if gamma else p[:0]
        law, fallback = rule(p, q, torch.tensor(block, dtype=torch.long))
        for n, (pn, row) in enumerate(zip(law.tolist(), fallback.tolist())):
            mean_accepted += prob * pn * n
            for y, py in enumerate(row):
                if pn * py > 0:
                    key = block[:n] + (y,)
                    out[key] = out.get(key, 0.0) + prob * pn * py

    draft_from((), 1.0)
    return out, mean_accepted


def emitted_distribution(
    target: Probs, draft: Probs, prompt: Context, gamma: int, length: int, rule: Outcomes
) -> tuple[dict[Context, float], dict[Context, float]]:
    """Exact P(first `length` emitted tokens) over as many iterations as it takes, and E[n] of the
    iteration started at every context that was reached. An iteration's law depends only on its
    context, so each is computed once."""
    laws: dict[Context, tuple[dict[Context, float], float]] = {}

    def law_at(context: Context) -> dict[Context, float]:
        if context not in laws:
            laws[context] = iteration_law(target, draft, context, gamma, rule)
        return laws[context][0]

    def rest(context: Context, count: int) -> dict[Context, float]:
        out: dict[Context, float] = {}
        for emitted, prob in law_at(context).items():
            tails = (
                {(): 1.0}
                if len(emitted) >= count
                else rest(context + emitted, count - len(emitted))
            )
            for tail, tail_prob in tails.items():
                key = (emitted + tail)[:count]
                out[key] = out.get(key, 0.0) + prob * tail_prob
        return out

    return rest(prompt, length), {context: law[1] for context, law in laws.items()}


def continue_with_target(
    law: dict[Context, float], target: Probs, length: int
) -> dict[Context, float]:
    """P(first `length` tokens) when the target samples whatever follows one iteration's output."""
    out: dict[Context, float] = {}
    for emitted, prob in law.items():
        tails = sequence_distribution(
            lambda ctx: target(ctx).tolist(), emitted, length - len(emitted)
        )
        for tail, tail_prob in tails.items():
            key = (emitted + tail)[:length]
            out[key] = out.get(key, 0.0) + prob * tail_prob
    return out


# ----------------------------------------------------------------------------- one block, any distributions
KINDS = ["any", "equal", "disjoint", "q-one-hot", "p-one-hot", "close", "q-zeros"]


def random_distribution(
    gen: torch.Generator, vocab: int, sharpness: float, holes: float
) -> torch.Tensor:
    """softmax(sharpness * N(0, 1)) with a fraction `holes` of zeros, never all of them."""
    logits = sharpness * torch.randn(vocab, generator=gen, dtype=torch.float64)
    drop = torch.rand(vocab, generator=gen, dtype=torch.float64) < holes
    drop[logits.argmax()] = False
    return torch.softmax(logits.masked_fill(drop, -math.inf), -1)


def pair_of_kind(
    kind: str, gen: torch.Generator, vocab: int, sharpness: float, holes: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) after one prefix, related as `kind` says."""
    p = random_distribution(gen, vocab, sharpness, holes)
    if kind == "equal":
        return p, p.clone()
    if kind == "disjoint":
        order = torch.randperm(vocab, generator=gen)
        cut = 1 + int(torch.randint(vocab - 1, (1,), generator=gen))
        a, b = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
        a[order[:cut]] = p[order[:cut]] + 0.1
        b[order[cut:]] = torch.rand(vocab - cut, generator=gen, dtype=torch.float64) + 0.1
        return a / a.sum(), b / b.sum()
    if kind == "q-one-hot":
        return p, torch.eye(vocab, dtype=torch.float64)[
            int(torch.randint(vocab, (1,), generator=gen))
        ]
    if kind == "p-one-hot":
        return torch.eye(vocab, dtype=torch.float64)[
            int(torch.randint(vocab, (1,), generator=gen))
        ], p
    if kind == "close":
        return p, 0.8 * p + 0.2 * random_distribution(gen, vocab, sharpness, 0.0)
    if kind == "q-zeros":
        return p, random_distribution(gen, vocab, sharpness, 0.7)
    return p, random_distribution(gen, vocab, sharpness, holes)


@st.composite
def blocks(
    draw: st.DrawFn,
) -> tuple[int, int, dict[Context, torch.Tensor], dict[Context, torch.Tensor]]:
    """A target and a draft given as arbitrary conditional distributions after every prefix of
    length <= gamma (the draft's only below gamma): vocab 2..4, gamma 1..3, and for every prefix
    a relation between p and q chosen by hypothesis."""
    vocab, gamma = draw(st.integers(2, 4)), draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    sharpness, holes = (
        draw(st.sampled_from([0.5, 2.0, 5.0])),
        draw(st.sampled_from([0.0, 0.3, 0.6])),
    )
    gen = torch.Generator().manual_seed(seed)
    target: dict[Context, torch.Tensor] = {}
    draft: dict[Context, torch.Tensor] = {}
    for depth in range(gamma + 1):
        for prefix in itertools.product(range(vocab), repeat=depth):
            if depth == gamma:
                target[prefix] = random_distribution(gen, vocab, sharpness, holes)
            else:
                target[prefix], draft[prefix] = pair_of_kind(
                    draw(st.sampled_from(KINDS)), gen, vocab, sharpness, holes
                )
    return vocab, gamma, target, draft


@proof(
    "block verification emits exactly p, and never accepts fewer tokens in expectation than token-wise",
    "exact enumeration, float64, to 1e-12, one iteration then the target",
)
@settings(max_examples=200, derandomize=True, deadline=None)
@given(case=blocks())
def test_one_block_emits_exactly_p_and_never_accepts_less(
    case: tuple[int, int, dict[Context, torch.Tensor], dict[Context, torch.Tensor]],
) -> None:
    """One iteration followed by the target: the first gamma+1 tokens are distributed as p, for
    the block rule and for the token-wise rule alike; and the block rule's E[n] is never lower."""
    vocab, gamma, target, draft = case
    expected = sequence_distribution(lambda ctx: target[ctx].tolist(), (), gamma + 1)
    block_law, block_mean = iteration_law(
        target.__getitem__, draft.__getitem__, (), gamma, block_rule
    )
    token_law, token_mean = iteration_law(
        target.__getitem__, draft.__getitem__, (), gamma, tokenwise_rule
    )
    assert math.isclose(sum(block_law.values()), 1.0, abs_tol=TOL)
    assert max_gap(continue_with_target(block_law, target.__getitem__, gamma + 1), expected) < TOL
    assert max_gap(continue_with_target(token_law, target.__getitem__, gamma + 1), expected) < TOL
    assert block_mean >= token_mean - TOL


# ----------------------------------------------------------------------------- several iterations of toy models
def warped(model: NGramModel, sampling: Sampling) -> Probs:
    cache: dict[Context, torch.Tensor] = {}

    def probs(context: Context) -> torch.Tensor:
        if context not in cache:
            cache[context] = warp(model.next_logits(context), sampling)
        return cache[context]

    return probs


def target_distribution(
    target: NGramModel, prompt: Context, length: int, sampling: Sampling
) -> dict[Context, float]:
    """The target's own autoregressive distribution, with the reference warp."""
    return sequence_distribution(
        lambda ctx: ref_warp(
            target.next_logits(ctx).tolist(), sampling.temperature, sampling.top_k, sampling.top_p
        ),
        prompt,
        length,
    )


@proof(
    "several block-verified iterations emit exactly the target's law",
    "exact enumeration, float64, to 1e-12",
)
@settings(max_examples=120, derandomize=True, deadline=None)
@given(
    vocab=st.integers(2, 4),
    gamma=st.integers(1, 3),
    orders=st.sampled_from([(2, 2), (3, 2), (2, 3), (3, 3)]),
    seed=st.integers(0, 10_000),
    holes=st.sampled_from([0.0, 0.3]),
    relation=st.sampled_from(["other", "same"]),
    sampling=samplings,
)
def test_several_iterations_emit_exactly_the_target_distribution(
    vocab: int,
    gamma: int,
    orders: tuple[int, int],
    seed: int,
    holes: float,
    relation: str,
    sampling: Sampling,
) -> None:
    """Three emitted tokens over as many block-verified iterations as it takes, on toy models,
    warped alike; and at every context reached, E[n] of the block rule >= the token-wise rule's."""
    target = NGramModel(toy_table(vocab, orders[0], seed, holes))
    draft = (
        target if relation == "same" else NGramModel(toy_table(vocab, orders[1], seed + 1, holes))
    )
    p, q = warped(target, sampling), warped(draft, sampling)
    prompt, length = (1 % vocab,), 3
    got, means = emitted_distribution(p, q, prompt, gamma, length, block_rule)
    assert math.isclose(sum(got.values()), 1.0, abs_tol=TOL)
    assert max_gap(got, target_distribution(target, prompt, length, sampling)) < TOL
    for context, mean in means.items():
        assert mean >= iteration_law(p, q, context, gamma, tokenwise_rule)[1] - TOL


@proof(
    "block verification is exact when every token comes from the residual",
    "exact enumeration, float64, to 1e-12",
)
def test_disjoint_supports_several_iterations() -> None:
    """The draft proposes only tokens the target never emits: nothing is kept, t is always p's."""
    neg = -math.inf
    target = NGramModel(torch.tensor([[0.0, 1.0, neg, neg]] * 4, dtype=torch.float64))
    draft = NGramModel(torch.tensor([[neg, neg, 0.5, 0.0]] * 4, dtype=torch.float64))
    p, q = warped(target, Sampling()), warped(draft, Sampling())
    for gamma in (1, 3):
        got, means = emitted_distribution(p, q, (0,), gamma, 3, block_rule)
        assert max_gap(got, target_distribution(target, (0,), 3, Sampling())) < TOL
        assert all(mean == 0 for mean in means.values())


# ----------------------------------------------------------------------------- optimality
def paper_example() -> tuple[Probs, Probs]:
    """Sun et al.'s motivating example: context-free models over {a, b}, M_b = (1/3, 2/3), M_s = (2/3, 1/3)."""
    p = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    return (lambda ctx: p), (lambda ctx: q)


@proof("the paper's worked example: E[accepted] 11/9 against token-wise 10/9", "exact")
def test_the_papers_example_accepts_11_9_against_10_9() -> None:
    target, draft = paper_example()
    assert iteration_law(target, draft, (), 2, tokenwise_rule)[1] == pytest.approx(10 / 9, abs=TOL)
    assert iteration_law(target, draft, (), 2, block_rule)[1] == pytest.approx(11 / 9, abs=TOL)


def optimality_cases() -> list[tuple[str, Probs, Probs, int]]:
    """Fixed toy pairs (three vocabularies, two orders, two temperatures, gamma 1..4)."""
    cases = []
    for seed in range(6):
        for gamma in (1, 2, 3, 4):
            vocab, order = 2 + seed % 3, 2 + seed % 2
            temperature = 1.0 if seed < 3 else 0.7
            sampling = Sampling(temperature=temperature)
            target = NGramModel(toy_table(vocab, order, 100 + seed, 0.0))
            draft = NGramModel(toy_table(vocab, 2, 200 + seed, 0.0))
            cases.append(
                (
                    f"seed={seed} gamma={gamma}",
                    warped(target, sampling),
                    warped(draft, sampling),
                    gamma,
                )
            )
    return cases


@proof(
    "block verification never accepts fewer tokens in expectation, and often more",
    "exact E[n], many cases",
)
def test_block_verification_is_never_worse_and_often_better() -> None:
    """E[n] of the first iteration, exactly: >= the token-wise value in every case, > in many.
    gamma = 1 must tie: with one drafted position the two rules are the same (h_1 = w_1 =
    min(1, p_1/q_1), residual norm(max(0, p_1 - q_1)))."""
    gains = {}
    for name, target, draft, gamma in optimality_cases():
        block = iteration_law(target, draft, (0,), gamma, block_rule)[1]
        token = iteration_law(target, draft, (0,), gamma, tokenwise_rule)[1]
        assert block >= token - TOL, name
        if gamma == 1:
            assert block == pytest.approx(token, abs=TOL), name
        gains[name] = block - token
    strict = [name for name, gain in gains.items() if gain > 1e-6]
    # every gamma >= 2 gains
    assert strict == [name for name in gains if not name.endswith("gamma=1")], gains


@proof("the block rule dominates token-wise prefix by prefix", "exact")
def test_block_weights_dominate_the_tokenwise_product() -> None:
    """P(tau >= i, X^i = x^i) = q(x^i) w_i and token-wise P(n >= i, X^i = x^i) = q(x^i) prod min(1, p_j/q_j):
    the block rule dominates prefix by prefix, not only on average."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        gamma, vocab = (
            int(torch.randint(1, 7, (1,), generator=gen)),
            int(torch.randint(2, 6, (1,), generator=gen)),
        )
        p = torch.softmax(3 * torch.randn(gamma + 1, vocab, generator=gen, dtype=torch.float64), -1)
        q = torch.softmax(3 * torch.randn(gamma, vocab, generator=gen, dtype=torch.float64), -1)
        drafted = torch.multinomial(q, 1, generator=gen).squeeze(-1)
        w = block_weights(p, q, drafted)
        product = torch.cat(
            [
                torch.ones(1, dtype=p.dtype),
                verify.acceptance_probability(p[:gamma], q, drafted).cumprod(0),
            ]
        )
        assert (w >= product - TOL).all()


# ----------------------------------------------------------------------------- mutant f and wrong block rules
def mutant_f_case() -> tuple[Probs, Probs]:
    """x_1 is over-proposed (p/q = 1/2), x_2 after it under-proposed (p/q = 2): the block rule keeps
    both whenever it keeps x_1, the token-wise rule loses x_2 half the time."""
    half, first = (
        torch.tensor([0.5, 0.5], dtype=torch.float64),
        torch.tensor([1.0, 0.0], dtype=torch.float64),
    )
    return (lambda ctx: first if ctx == (0,) else half), (
        lambda ctx: half if ctx == (0,) else first
    )


@proof(
    "block verification done token-wise is exact but accepts less: caught on E[accepted]",
    "exact E[accepted]",
    rejects=("block done token-wise (vllm-ascend #7807)",),
)
def test_mutant_f_tokenwise_rule_is_exact_but_accepts_less() -> None:
    """vllm-ascend #7807, "block verification computed with the token-wise rule": no exactness test
    can see it (the token-wise rule is exact too), so the check is on E[accepted]."""
    target, draft = mutant_f_case()
    expected = sequence_distribution(lambda ctx: target(ctx).tolist(), (), 3)
    block_law, block_mean = iteration_law(target, draft, (), 2, block_rule)
    token_law, token_mean = iteration_law(target, draft, (), 2, tokenwise_rule)
    # invisible to exactness
    assert max_gap(continue_with_target(token_law, target, 3), expected) < TOL
    assert max_gap(continue_with_target(block_law, target, 3), expected) < TOL
    assert block_mean == pytest.approx(1.0, abs=TOL) and token_mean == pytest.approx(0.75, abs=TOL)
    assert block_mean - token_mean > 0.2
    # and on the paper's example, and on a toy pair over several iterations
    paper_target, paper_draft = paper_example()
    assert (
        iteration_law(paper_target, paper_draft, (), 3, block_rule)[1]
        - iteration_law(paper_target, paper_draft, (), 3, tokenwise_rule)[1]
    ) > 0.05


@proof(
    "the block enumeration can fail",
    "exact",
    rejects=(
        "token-wise residual in the block rule",
        "scan forwards",
        "weights used as stop probabilities",
    ),
)
@pytest.mark.parametrize(
    "rule", [block_with_tokenwise_residual, block_scanned_forwards, block_weights_as_stops]
)
def test_exact_enumeration_catches_wrong_block_rules(rule: Outcomes) -> None:
    """Each breaks the identity on the same toy pair: the residual mix-up by 0.015 (it matters only
    where a block stops with w_tau < 1 and p_{tau+1} - q_{tau+1} > 0), the other two by about 0.05."""
    sampling = Sampling()
    target = NGramModel(toy_table(3, 2, 26, 0.0))
    draft = NGramModel(toy_table(3, 2, 27, 0.0))
    p, q = warped(target, sampling), warped(draft, sampling)
    expected = target_distribution(target, (0,), 3, sampling)
    assert max_gap(emitted_distribution(p, q, (0,), 3, 3, block_rule)[0], expected) < TOL
    assert max_gap(emitted_distribution(p, q, (0,), 3, 3, rule)[0], expected) > 1e-3


# ----------------------------------------------------------------------------- the pieces against plain references
def test_weights_match_the_recursion_written_as_a_loop() -> None:
    """Line B1 by the paper's recursion, in Python floats, including ratios of 0 and saturation at 1."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(200):
        gamma, vocab = (
            int(torch.randint(0, 7, (1,), generator=gen)),
            int(torch.randint(2, 5, (1,), generator=gen)),
        )
        p = torch.rand(gamma + 1, vocab, generator=gen, dtype=torch.float64)
        p = p.masked_fill(torch.rand(p.shape, generator=gen) < 0.2, 0.0)
        p[:, 0] += 0.01
        p = p / p.sum(-1, keepdim=True)
        q = torch.softmax(2 * torch.randn(gamma, vocab, generator=gen, dtype=torch.float64), -1)
        drafted = (
            torch.multinomial(q, 1, generator=gen).squeeze(-1)
            if gamma
            else torch.zeros(0, dtype=torch.long)
        )
        w, expected = block_weights(p, q, drafted), [1.0]
        for i, x in enumerate(drafted.tolist()):
            expected.append(min(1.0, expected[-1] * p[i, x].item() / q[i, x].item()))
        assert torch.allclose(w, torch.tensor(expected, dtype=torch.float64), atol=TOL, rtol=1e-12)
        mass, fallback = block_residuals(p, q, w)
        stop = stop_probabilities(w, mass)
        assert stop.shape == (gamma,) and fallback.shape == (gamma + 1, vocab)
        assert torch.allclose(
            block_outcomes(p, q, drafted).accepted, scan_backwards(stop), atol=TOL, rtol=0
        )


def test_hand_worked_block() -> None:
    """p_1 = (1/2, 1/2), q_1 = (1, 0); after x_1 = 0: p_2 = (1, 0), q_2 = (1/2, 1/2); p_3 uniform."""
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    kept = block_outcomes(p, q, torch.tensor([0, 0]))
    # w = (1, 1/2, 1); m_0 = sum max(0, p_1 - q_1) = 1/2, m_1 = sum max(0, p_2 / 2 - q_2) = 0; h = (0, 1)
    assert torch.allclose(
        block_weights(p, q, torch.tensor([0, 0])), torch.tensor([1, 0.5, 1], dtype=torch.float64)
    )
    assert torch.allclose(kept.stop, torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert torch.allclose(kept.accepted, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))
    lost = block_outcomes(p, q, torch.tensor([0, 1]))  # p_2(1) = 0: w_2 = 0
    # w = (1, 1/2, 0), h_1 = m_1 / (m_1 + 1/2) = 0, h_2 = 0: nothing is kept, t ~ norm(max(0, p_1 - q_1)) = (0, 1)
    assert torch.allclose(lost.accepted, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.allclose(lost.fallback[0], torch.tensor([0.0, 1.0], dtype=torch.float64))


# ----------------------------------------------------------------------------- verify_block itself
@proof(
    "at temperature 0 block verification is greedy token-wise verification", "exact, ties included"
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_verify_block_is_verify_step_and_verify_greedy_on_one_hot_distributions(
    dtype: torch.dtype,
) -> None:
    """Temperature 0: one-hot p and q, ties included (integer logits); block verification then
    keeps the leading matches and emits the target's argmax, whatever eta is."""
    gen = torch.Generator().manual_seed(0)
    greedy = Sampling(temperature=0)
    for case in range(200):
        gamma, vocab = case % 6, 2 + case % 5
        target_logits = torch.randint(0, 3, (gamma + 1, vocab), generator=gen).to(dtype)
        draft_logits = torch.randint(0, 3, (gamma, vocab), generator=gen).to(dtype)
        agree = torch.rand(gamma, generator=gen) < 0.7  # long accepted runs occur
        draft_logits[agree] = target_logits[:gamma][agree]
        p, q = warp(target_logits, greedy), warp(draft_logits, greedy)
        drafted = draft_logits.argmax(-1)
        got = verify_block(p, q, drafted, torch.Generator().manual_seed(case)).read()
        step = verify.verify_step(p, q, drafted, torch.Generator().manual_seed(case)).read()
        quick = verify.verify_greedy(target_logits.argmax(-1), drafted).read()
        assert (got.tokens, got.accepted, got.overlap) == (step.tokens, step.accepted, step.overlap)
        assert (got.tokens, got.accepted, got.overlap) == (
            quick.tokens,
            quick.accepted,
            quick.overlap,
        )
        law = block_outcomes(p, q, drafted)
        assert law.accepted.tolist() == [float(n == got.accepted) for n in range(gamma + 1)]


def fixed_block(
    seed: int, gamma: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(gamma + 1, vocab, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(2 * torch.randn(gamma, vocab, generator=gen, dtype=torch.float64), -1)
    p[0, vocab - 1] = 0.0  # a token the target never emits first
    p = p / p.sum(-1, keepdim=True)
    drafted = torch.multinomial(q, 1, generator=gen).squeeze(-1)
    return p, q, drafted


def outcome_probabilities(
    rule: Outcomes, p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor
) -> dict[Context, float]:
    """P(verification emits these tokens) for a fixed drafted block, under `rule`."""
    law, fallback = rule(p, q, drafted)
    xs = tuple(drafted.tolist())
    out: dict[Context, float] = {}
    for n, (pn, row) in enumerate(zip(law.tolist(), fallback.tolist())):
        for y, py in enumerate(row):
            if pn * py > 0:
                out[xs[:n] + (y,)] = out.get(xs[:n] + (y,), 0.0) + pn * py
    return out


@proof(
    "verify_block samples its own exact law",
    "chi-square, p > 1e-3",
    rejects=("the token-wise law where the rules differ",),
)
@pytest.mark.parametrize("seed, gamma, rules_differ", [(3, 3, True), (8, 2, False), (11, 0, False)])
def test_verify_block_samples_the_law_of_block_outcomes(
    seed: int, gamma: int, rules_differ: bool
) -> None:
    """The sampler (eta < h, the last pass, t from the kept row) against its own exact law; where
    the two rules differ the same counts reject the token-wise law, so the test can see a mix-up."""
    p, q, drafted = fixed_block(seed, gamma, 3)
    gen = torch.Generator().manual_seed(seed)
    counts = Counter(tuple(verify_block(p, q, drafted, gen).read().tokens) for _ in range(4000))
    block = outcome_probabilities(block_rule, p, q, drafted)
    assert chi_square_pvalue(counts, block) > 1e-3
    token = outcome_probabilities(tokenwise_rule, p, q, drafted)
    assert (max_gap(token, block) > 0.05) == rules_differ
    if rules_differ:
        assert chi_square_pvalue(counts, token) < 1e-6


@proof(
    "block verification never keeps a token of target probability 0, even at eta = 0",
    "exact: eta forced to 0",
    rejects=("eta <= h (SGLang #35771's comparison)",),
)
def test_verify_block_never_keeps_a_token_the_target_rules_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """eta = 0 exactly (torch.rand can return it): a drafted token with p = 0 has w = 0 and h = 0
    from there on, and the strict eta < h keeps none of it."""
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [0.3, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.6, 0.2, 0.2], [0.2, 0.3, 0.5]], dtype=torch.float64)
    monkeypatch.setattr(
        torch, "rand", lambda *shape, **kwargs: torch.zeros(*shape, dtype=kwargs.get("dtype"))
    )
    got = verify_block(p, q, torch.tensor([0, 1]), torch.Generator()).read()
    assert got.accepted == 0 and got.tokens[0] != 0


def test_gamma_zero_samples_p_1() -> None:
    p = torch.tensor([[0.1, 0.0, 0.9]], dtype=torch.float64)
    empty_q, nothing = p[:0], torch.zeros(0, dtype=torch.long)
    law = block_outcomes(p, empty_q, nothing)
    assert law.accepted.tolist() == [1.0] and torch.equal(law.fallback, p)
    gen = torch.Generator().manual_seed(0)
    counts = Counter(
        tuple(verify_block(p, empty_q, nothing, gen).read().tokens) for _ in range(500)
    )
    assert set(counts) <= {(0,), (2,)} and counts[(2,)] > 400
    assert verify_block(p, empty_q, nothing, gen).read().overlap == []


# ----------------------------------------------------------------------------- through the loop
def _toy_first_tokens_pvalue(verify_rule: str, runs: int = 2000) -> float:
    """Chi-square of the loop's first 3 tokens (gamma 3, temperature 0.5, a bigram pair over 3
    tokens) against the target's exact distribution."""
    target = NGramModel.random(3, 2, seed=10, scale=1.0)
    draft = NGramModel.random(3, 2, seed=1010, scale=1.0)
    sampling = Sampling(temperature=0.5)
    counts = Counter(
        tuple(
            speculative_generate(
                target, draft, [0], 3, gamma=3, temperature=0.5, seed=seed, verify=verify_rule
            ).tokens
        )
        for seed in range(runs)
    )
    expected = sequence_distribution(
        lambda ctx: ref_warp(target.next_logits(ctx).tolist(), sampling.temperature), [0], 3
    )
    return chi_square_pvalue(counts, expected)


@proof("the engine with block verification follows the target's law", "chi-square, p > 1e-3")
def test_the_loop_with_block_verification_has_the_target_distribution() -> None:
    assert _toy_first_tokens_pvalue("block") > 1e-3


@proof(
    "the engine's block test has power",
    "chi-square, p > 1e-3 rejected",
    rejects=("stop with probability w_i instead of h_i",),
)
def test_the_loop_catches_a_block_rule_that_stops_with_the_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopping at i with probability w_i instead of h_i (a plausible misreading of line B3)."""
    monkeypatch.setattr(block, "stop_probabilities", lambda weights, mass: weights[1:])
    assert _toy_first_tokens_pvalue("block") < 1e-3


@proof("the engine with block verification at temperature 0 is greedy token-wise", "exact identity")
def test_block_verification_in_the_loop_is_greedy_token_wise_at_temperature_0() -> None:
    target, draft = NGramModel.random(5, 2, seed=3), NGramModel.random(5, 2, seed=4)
    for gamma in (1, 3, 6):
        token = speculative_generate(target, draft, [1, 2], 30, gamma=gamma, temperature=0)
        blocked = speculative_generate(
            target, draft, [1, 2], 30, gamma=gamma, temperature=0, verify="block"
        )
        assert (
            blocked.tokens == token.tokens
            and blocked.stats.gamma_history == token.stats.gamma_history
        )


def test_block_verification_accepts_more_in_the_loop() -> None:
    """Same pair, same seeds: block verification keeps more drafted tokens in total (E[tau] >= E[n]
    per block, strictly on this pair)."""
    target, draft = (
        NGramModel.random(6, 2, seed=21, scale=2.0),
        NGramModel.random(6, 2, seed=22, scale=2.0),
    )
    totals = {}
    for rule in ("token", "block"):
        runs = [
            speculative_generate(target, draft, [0], 40, gamma=4, seed=seed, verify=rule)
            for seed in range(200)
        ]
        totals[rule] = sum(r.stats.new_tokens for r in runs) / sum(
            r.stats.target_calls for r in runs
        )
    assert totals["block"] > totals["token"]


def test_an_unknown_verification_rule_is_refused() -> None:
    target, draft = NGramModel.random(3, 2, seed=1), NGramModel.random(3, 2, seed=2)
    with pytest.raises(ValueError, match="verify must be one of 'token', 'block'"):
        speculative_generate(target, draft, [0], 3, verify="tree")
