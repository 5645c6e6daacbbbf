"""Token-tree verification (speculative/verify/tree.py) emits exactly the target's distribution.

Exact, in float64, computed from the implementation's own rule (``tree.node_rules``, which
calls ``child_acceptance``, ``child_distribution`` and ``reject_child``):

* one node, arbitrary p and q, every mode, 1-3 children: the token chosen at the node (an
  accepted child's or the target's own) has law p;
* several iterations of tree decoding on toy n-gram models (vocabulary <= 4, depth <= 3,
  branching <= 3, every mode, warped distributions, zeros and disjoint supports): every
  drafted child, accept/reject branch and fallback or bonus token is a branch, and the
  first 2-3 emitted tokens have the target's autoregressive distribution;
* whole drafted trees through ``tree.tree_rules`` (one iteration, finished by the target's
  own sampling), which also checks how rows are placed, the bonus row included.

Sampled: ``verify_tree``'s real walk against the exact law of its outcome (chi-square).
Then greedy, the chain (= verify_step), argument checks, and the mutants a-g: each is a
published kind of bug, injected by replacing one function, and each must be rejected.
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

import speculative.verify.token as verify
import speculative.verify.tree as tree
from speculative.sampling import Sampling, warp
from speculative.verify.token_tree import MODES, TokenTree, branching_parents
from speculative.verify.tree import verify_tree, verify_tree_greedy
from tests.support.proofs import proof
from tests.support.strategies import distribution, distribution_pairs, max_gap, samplings, toy_table
from tests.support.toy_models import NGramModel, chi_square_pvalue, ref_warp, sequence_distribution

torch.set_num_threads(1)

TOL = 1e-12
Law = list[
    tuple[tuple[int, ...], float]
]  # drafted children (in the order tried) and their probability
Dist = dict[tuple[int, ...], float]

# the real functions, kept before any monkeypatching so that mutants can call them
REAL_REJECT_CHILD = tree.reject_child
REAL_NODE_RULES = tree.node_rules
REAL_TREE_RULES = tree.tree_rules


# ----------------------------------------------------------------------------- drafting laws and one node
def children_law(q: list[float], b: int, mode: str) -> Law:
    """Every way a node's b children can be drafted from q, with its probability.

    "iid": ordered b-tuples of tokens of q > 0, probability prod q. "without_replacement":
    ordered draws of distinct tokens, each renormalised over what is left; fewer than b
    when q's support runs out. "deterministic": the b most likely tokens of q (lower id
    first on ties), zero-probability ones included."""
    if b == 0:
        return [((), 1.0)]
    support = [x for x, w in enumerate(q) if w > 0]
    if mode == "iid":
        return [
            (kids, math.prod(q[x] for x in kids)) for kids in itertools.product(support, repeat=b)
        ]
    if mode == "without_replacement":
        out: Law = []

        def draw(chosen: tuple[int, ...], weight: float) -> None:
            left = [x for x in support if x not in chosen]
            if len(chosen) == b or not left:
                out.append((chosen, weight))
                return
            mass = math.fsum(q[x] for x in left)
            for x in left:
                draw(chosen + (x,), weight * q[x] / mass)

        draw((), 1.0)
        return out
    return [(tuple(sorted(range(len(q)), key=lambda x: (-q[x], x))[:b]), 1.0)]


def node_outcome(
    p: torch.Tensor, q: torch.Tensor | None, mode: str, law: Law
) -> tuple[list[float], list[float]]:
    """(move, stop) at one node: move[x] = P(the walk accepts a child of token x), stop[y] =
    P(every child is rejected and the target's token is y), over the drafting law and the
    rule's accept/reject branches. All drafted tuples go through one node_rules call."""
    vocab, m = p.shape[-1], len(law)
    law = sorted(law, key=lambda entry: -len(entry[0]))  # node_rules wants the widest first
    k = len(law[0][0])
    children = torch.tensor(
        [list(kids) + [0] * (k - len(kids)) for kids, _ in law], dtype=torch.long
    ).view(m, k)
    q_rows = None if mode == "deterministic" else q.expand(m, vocab)
    rules = tree.node_rules(
        p.expand(m, vocab), q_rows, children, [len(kids) for kids, _ in law], mode
    )
    move, stop = [0.0] * vocab, [0.0] * vocab
    for (kids, weight), ratios, fallback in zip(
        law, rules.ratios.tolist(), rules.fallback.tolist()
    ):
        reach = weight
        for x, a in zip(kids, ratios):
            move[x] += reach * a
            reach *= 1 - a
        for y in range(vocab):
            stop[y] += reach * fallback[y]
    return move, stop


def node_gap(
    p: torch.Tensor, q: torch.Tensor, mode: str, b: int, draft_q: torch.Tensor | None = None
) -> float:
    """max_x |P(token chosen at the node = x) - p(x)|, children drawn from draft_q (default q)."""
    law = children_law((q if draft_q is None else draft_q).tolist(), b, mode)
    move, stop = node_outcome(p, q, mode, law)
    return max(abs(a + s - t) for a, s, t in zip(move, stop, p.tolist()))


@proof(
    "one tree node (any number of children, every mode) emits exactly p",
    "exact enumeration, float64, to 1e-12",
)
@settings(max_examples=300, derandomize=True, deadline=None)
@given(pair=distribution_pairs(), mode=st.sampled_from(MODES), b=st.integers(1, 3), data=st.data())
def test_one_node_emits_exactly_p(
    pair: tuple[torch.Tensor, torch.Tensor], mode: str, b: int, data: st.DataObject
) -> None:
    p, q = pair
    if mode == "deterministic":  # any fixed children, repeats and zero-probability tokens included
        kids = tuple(data.draw(st.lists(st.integers(0, p.shape[0] - 1), min_size=b, max_size=b)))
        move, stop = node_outcome(p, None, mode, [(kids, 1.0)])
    else:
        move, stop = node_outcome(p, q, mode, children_law(q.tolist(), b, mode))
    got = torch.tensor(move, dtype=torch.float64) + torch.tensor(stop, dtype=torch.float64)
    assert torch.allclose(got, p, atol=TOL, rtol=0), (p, q, mode, b, got)
    # a token p rules out is never accepted
    assert all(m == 0 for m, t in zip(move, p.tolist()) if t == 0)


# ----------------------------------------------------------------------------- several iterations
def toy_pair(
    vocab: int, orders: tuple[int, int], seed: int, holes: float, relation: str
) -> tuple[NGramModel, NGramModel]:
    target = NGramModel(toy_table(vocab, orders[0], seed, holes))
    if relation == "same":
        return target, target
    draft_table = toy_table(vocab, orders[1], seed + 1, holes)
    # the target only emits tokens < cut, the draft only proposes tokens >= cut
    if relation == "disjoint":
        cut = max(1, vocab // 2)
        target_table = toy_table(vocab, orders[0], seed, 0.0)
        target_table[..., cut:] = -math.inf
        draft_table = toy_table(vocab, orders[1], seed + 1, 0.0)
        draft_table[..., :cut] = -math.inf
        return NGramModel(target_table), NGramModel(draft_table)
    return target, NGramModel(draft_table)


def tree_decoding_distribution(
    target: NGramModel,
    draft: NGramModel,
    prompt: tuple[int, ...],
    branching: tuple[int, ...],
    mode: str,
    length: int,
    sampling: Sampling,
    judge: Sampling | None = None,
) -> Dist:
    """Exact P(first `length` emitted tokens) of tree speculative decoding with a static shape.

    The output only depends on the nodes the walk visits, and each node's children are
    drafted from the draft's q after the node's path, independently of everything else, so
    the unvisited subtrees are summed out: from (context, depth) the law of the rest is
    sum_x move[x] * law(context + x, depth + 1) + sum_y stop[y] * law(context + y, 0),
    with (move, stop) from node_outcome (the real rule) and memoised.
    `judge`: warp the draft's logits with these settings for verification instead of the
    ones its children were drawn with (mutant e)."""
    cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def probs(
        model: NGramModel, name: str, context: tuple[int, ...], how: Sampling
    ) -> torch.Tensor:
        if (name, context) not in cache:
            cache[name, context] = warp(model.next_logits(context), how)
        return cache[name, context]

    memo: dict[tuple[tuple[int, ...], int], Dist] = {}

    def law(context: tuple[int, ...], depth: int) -> Dist:
        if len(context) - len(prompt) >= length:
            return {context[len(prompt) : len(prompt) + length]: 1.0}
        if (context, depth) not in memo:
            b = branching[depth] if depth < len(branching) else 0
            p = probs(target, "p", context, sampling)
            q = probs(draft, "q", context, sampling)
            q_judged = q if judge is None else probs(draft, "judge", context, judge)
            move, stop = node_outcome(p, q_judged, mode, children_law(q.tolist(), b, mode))
            branches = [
                (w, context + (x,), depth + 1) for x, w in enumerate(move)
            ]  # a child accepted
            branches += [
                (w, context + (y,), 0) for y, w in enumerate(stop)
            ]  # the target's token: next iteration
            out: Dist = {}
            for w, nxt, d in branches:
                if w > 0:
                    for key, value in law(nxt, d).items():
                        out[key] = out.get(key, 0.0) + w * value
            memo[context, depth] = out
        return memo[context, depth]

    return law(prompt, 0)


def reference_next(
    target: NGramModel, sampling: Sampling
) -> Callable[[tuple[int, ...]], list[float]]:
    """The target's next-token distribution with the plain-Python reference warp."""
    return lambda ctx: ref_warp(
        target.next_logits(ctx).tolist(), sampling.temperature, sampling.top_k, sampling.top_p
    )


@proof(
    "tree decoding emits exactly the target's law, in every mode",
    "exact enumeration, float64, to 1e-12, whole decodings on toy models",
)
@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=100, derandomize=True, deadline=None)
@given(
    vocab=st.integers(2, 4),
    branching=st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple),
    orders=st.sampled_from([(2, 2), (3, 2), (2, 3)]),
    seed=st.integers(0, 10_000),
    holes=st.sampled_from([0.0, 0.3]),
    relation=st.sampled_from(["other", "other", "same", "disjoint"]),
    sampling=samplings,
    length=st.integers(2, 3),
)
def test_tree_decoding_emits_exactly_the_target_distribution(
    mode: str,
    vocab: int,
    branching: tuple[int, ...],
    orders: tuple[int, int],
    seed: int,
    holes: float,
    relation: str,
    sampling: Sampling,
    length: int,
) -> None:
    target, draft = toy_pair(vocab, orders, seed, holes, relation)
    prompt = (1 % vocab,)
    got = tree_decoding_distribution(target, draft, prompt, branching, mode, length, sampling)
    expected = sequence_distribution(reference_next(target, sampling), prompt, length)
    assert math.isclose(sum(got.values()), 1.0, abs_tol=TOL)
    assert max_gap(got, expected) < TOL


# ----------------------------------------------------------------------------- whole trees, through tree_rules
def drafted_trees(
    target_p: Callable,
    draft_q: Callable,
    prompt: tuple[int, ...],
    branching: tuple[int, ...],
    mode: str,
):
    """Every drafted tree of a static shape, breadth-first, with its probability: rows are
    expanded in order and their children appended, so parents always come first."""

    def expand(
        tokens: list[int],
        parents: list[int],
        contexts: list[tuple[int, ...]],
        depths: list[int],
        row: int,
        weight_: float,
    ):
        if row == len(contexts):
            p = torch.stack([target_p(c) for c in contexts])
            q = torch.stack([draft_q(c) for c in contexts])
            yield (
                TokenTree(
                    torch.tensor(tokens, dtype=torch.long),
                    parents,
                    mode,
                    None if mode == "deterministic" else q,
                ),
                p,
                weight_,
            )
            return
        b = branching[depths[row]] if depths[row] < len(branching) else 0
        for kids, w in children_law(draft_q(contexts[row]).tolist(), b, mode):
            yield from expand(
                tokens + list(kids),
                parents + [row - 1] * len(kids),
                contexts + [contexts[row] + (x,) for x in kids],
                depths + [depths[row] + 1] * len(kids),
                row + 1,
                weight_ * w,
            )

    yield from expand([], [], [prompt], [0], 0, 1.0)


def walk_law(
    token_tree: TokenTree, ratios: list[float], stop: list[list[float]]
) -> dict[tuple[tuple[int, ...], int], float]:
    """Exact law of the walk's outcome (accepted path, target token) given the per-node
    acceptance probabilities and per-row stop distributions: children tried in order,
    the first that passes is taken, and the token is drawn where the walk stops."""
    out: dict[tuple[tuple[int, ...], int], float] = {}
    by_row = token_tree.children_by_row()

    def go(row: int, prob: float, path: tuple[int, ...]) -> None:
        for c in by_row[row]:
            if ratios[c] > 0:
                go(c + 1, prob * ratios[c], path + (c,))
            prob *= 1 - ratios[c]
        for y, f in enumerate(stop[row]):
            if f > 0 and prob > 0:
                out[path, y] = out.get((path, y), 0.0) + prob * f

    go(0, 1.0, ())
    return out


def one_iteration_distribution(
    target: NGramModel,
    draft: NGramModel,
    prompt: tuple[int, ...],
    branching: tuple[int, ...],
    mode: str,
    sampling: Sampling,
) -> Dist:
    """Exact law of one tree iteration's tokens, through tree_rules on every drafted tree,
    each outcome then finished by the target's own sampling to len(branching) + 1 tokens:
    if the iteration is exact, that is the target's law of those tokens."""
    length = len(branching) + 1
    ref = reference_next(target, sampling)
    cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def probs(model: NGramModel, name: str, context: tuple[int, ...]) -> torch.Tensor:
        if (name, context) not in cache:
            cache[name, context] = warp(model.next_logits(context), sampling)
        return cache[name, context]

    emitted: Dist = {}
    for token_tree, p, w in drafted_trees(
        lambda c: probs(target, "p", c), lambda c: probs(draft, "q", c), prompt, branching, mode
    ):
        rules = tree.tree_rules(p, token_tree)
        tokens = token_tree.tokens.tolist()
        for (path, y), prob in walk_law(
            token_tree, rules.ratios.tolist(), rules.stop.tolist()
        ).items():
            key = tuple(tokens[c] for c in path) + (y,)
            emitted[key] = emitted.get(key, 0.0) + w * prob
    out: Dist = {}
    for head, prob in emitted.items():
        for tail, more in sequence_distribution(ref, prompt + head, length - len(head)).items():
            out[head + tail] = out.get(head + tail, 0.0) + prob * more
    return out


@proof(
    "one iteration over whole trees of several shapes is exact",
    "exact enumeration, float64, to 1e-12",
)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("branching", [(2, 2), (3, 1), (1, 2, 1)])
@pytest.mark.parametrize(
    "sampling", [Sampling(), Sampling(temperature=0.8, top_k=2)], ids=["T1", "top-k2"]
)
def test_whole_trees_one_iteration_exact(
    mode: str, branching: tuple[int, ...], sampling: Sampling
) -> None:
    target, draft = toy_pair(3, (2, 2), 11, 0.0, "other")
    got = one_iteration_distribution(target, draft, (0,), branching, mode, sampling)
    expected = sequence_distribution(reference_next(target, sampling), (0,), len(branching) + 1)
    assert max_gap(got, expected) < TOL


# ----------------------------------------------------------------------------- the real walk, sampled
# Branching (2, 2) over 4 tokens. The rows with children were picked so that, in every mode,
# each of their children is accepted and all are rejected with probability >= 0.15, zeros in
# p and q included; the leaves' rows differ from their parents' (a bonus drawn from the wrong
# row shows), and their q rows are zeros: they must never be read.
FIXED_P = [
    [0.2, 0.35, 0.1, 0.35],
    [0.45, 0.35, 0.2, 0.0],
    [0.55, 0.05, 0.2, 0.2],
    [0.7, 0.1, 0.1, 0.1],
    [0.1, 0.7, 0.1, 0.1],
    [0.1, 0.1, 0.7, 0.1],
    [0.25, 0.25, 0.0, 0.5],
]
FIXED_Q = [[0.45, 0.3, 0.0, 0.25], [0.2, 0.3, 0.4, 0.1], [0.0, 0.3, 0.55, 0.15]] + [[0.0] * 4] * 4
FIXED_TOKENS = [0, 1, 2, 1, 2, 3]  # the root's children, then node 0's, then node 1's


def fixed_case(mode: str) -> tuple[TokenTree, torch.Tensor]:
    p = torch.tensor(FIXED_P, dtype=torch.float64)
    q = torch.tensor(FIXED_Q, dtype=torch.float64)
    return TokenTree.from_branching(torch.tensor(FIXED_TOKENS), (2, 2), mode, q), p


def expected_outcomes(
    token_tree: TokenTree, p: torch.Tensor
) -> dict[tuple[tuple[int, ...], int], float]:
    """The exact outcome law from node_rules applied row by row, independently of tree_rules'
    batching and row placement."""
    n = token_tree.num_nodes
    tokens = token_tree.tokens
    ratios, stop = [0.0] * n, p.tolist()
    for row, kids in enumerate(token_tree.children_by_row()):
        if kids:
            q = None if token_tree.mode == "deterministic" else token_tree.q[row : row + 1]
            rules = tree.node_rules(
                p[row : row + 1], q, tokens[kids].view(1, -1), [len(kids)], token_tree.mode
            )
            for c, a in zip(kids, rules.ratios[0].tolist()):
                ratios[c] = a
            stop[row] = rules.fallback[0].tolist()
    return walk_law(token_tree, ratios, stop)


def sampled_outcomes(token_tree: TokenTree, p: torch.Tensor, draws: int, seed: int) -> Counter:
    gen = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    node_tokens = token_tree.tokens.tolist()
    for _ in range(draws):
        out = verify_tree(p, token_tree, gen).read()
        assert out.accepted == len(out.path) == len(out.tokens) - 1
        assert out.tokens[:-1] == [node_tokens[c] for c in out.path]
        # a root-to-node chain
        assert out.path == (token_tree.path_to(out.path[-1]) if out.path else [])
        counts[tuple(out.path), out.tokens[-1]] += 1
    return counts


@proof("verify_tree's sampled walk follows the exact law", "chi-square, p > 1e-3")
@pytest.mark.parametrize("mode", MODES)
def test_verify_tree_walk_matches_the_exact_law(mode: str) -> None:
    token_tree, p = fixed_case(mode)
    expected = expected_outcomes(token_tree, p)
    assert math.isclose(sum(expected.values()), 1.0, abs_tol=TOL)
    # a walk with many likely outcomes, not a few
    assert sum(v > 0.01 for v in expected.values()) >= 10
    counts = sampled_outcomes(token_tree, p, 3000, seed=1)
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_verify_tree_in_float32_leaves_its_inputs_alone() -> None:
    """The loop's dtype: float32 p, q in another dtype (cast to p's), and p, q, tokens unchanged."""
    for mode in MODES:
        token_tree, p64 = fixed_case(mode)
        p = p64.float()
        before = (p.clone(), token_tree.q.clone(), token_tree.tokens.clone())
        gen = torch.Generator().manual_seed(0)
        for _ in range(50):
            out = verify_tree(p, token_tree, gen).read()
            # the loop reads tokens, accepted, overlap as from verify_step
            assert isinstance(out, verify.Verification)
            # a token the target allows
            assert p[out.path[-1] + 1 if out.path else 0, out.tokens[-1]] > 0
        assert all(torch.equal(a, b) for a, b in zip(before, (p, token_tree.q, token_tree.tokens)))


# ----------------------------------------------------------------------------- greedy
def random_parents(n: int, gen: torch.Generator, max_children: int | None = None) -> list[int]:
    parents: list[int] = []
    for j in range(n):
        options = [
            c for c in range(-1, j) if max_children is None or parents.count(c) < max_children
        ]
        parents.append(options[int(torch.randint(0, len(options), (1,), generator=gen))])
    return parents


def shifted_greedy(target_choice: torch.Tensor, token_tree: TokenTree) -> verify.Verdict:
    """Broken on purpose: every row compared with the next row's choice."""
    return verify_tree_greedy(torch.cat([target_choice[1:], target_choice[-1:]]), token_tree)


@proof(
    "at temperature 0 the greedy walk is verify_tree on one-hot p and q",
    "exact, ties included",
    rejects=("the greedy walk broken on purpose",),
)
@pytest.mark.parametrize("broken", [False, True])
def test_verify_tree_greedy_is_verify_tree_on_one_hot_distributions(broken: bool) -> None:
    """Integer logits, so ties occur; p and q one-hot by warp at temperature 0. Random
    children come from the one-hot q (all equal to its argmax); "without_replacement" can
    then have only one child per node."""
    check = shifted_greedy if broken else verify_tree_greedy
    gen = torch.Generator().manual_seed(0)
    greedy, differences = Sampling(temperature=0), 0
    for case in range(240):
        mode, vocab, n = MODES[case % 3], 2 + case % 4, 1 + case % 9
        parents = random_parents(n, gen, max_children=1 if mode == "without_replacement" else None)
        target_logits = torch.randint(0, 3, (n + 1, vocab), generator=gen).double()
        draft_logits = torch.randint(0, 3, (n + 1, vocab), generator=gen).double()
        # a draft that often agrees, so that paths get long
        agree = torch.rand(n + 1, generator=gen) < 0.7
        draft_logits[agree] = target_logits[agree]
        p, q = warp(target_logits, greedy), warp(draft_logits, greedy)
        if mode == "deterministic":  # any children: top choices, repeats, anything
            tokens = torch.randint(0, vocab, (n,), generator=gen)
            for j, parent in enumerate(parents):
                if torch.rand(1, generator=gen) < 0.5:
                    tokens[j] = target_logits[parent + 1].argmax()
        else:
            tokens = torch.tensor(
                [int(q[parent + 1].argmax()) for parent in parents], dtype=torch.long
            )
        token_tree = TokenTree(tokens, parents, mode, q)
        expected = verify_tree(p, token_tree, torch.Generator().manual_seed(case)).read()
        got = check(target_logits.argmax(-1), token_tree).read()
        differences += got != expected
    assert (differences > 30) if broken else (differences == 0)


# ----------------------------------------------------------------------------- a chain is Algorithm 1
def chain_case(
    gamma: int, vocab: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.softmax(1.5 * torch.randn(gamma + 1, vocab, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(1.5 * torch.randn(gamma, vocab, generator=gen, dtype=torch.float64), -1)
    holes = torch.rand(gamma + 1, vocab, generator=gen) < 0.25
    holes[:, 0] = False
    p = p.masked_fill(holes, 0.0)
    p = p / p.sum(-1, keepdim=True)
    drafted = torch.multinomial(q, 1, generator=gen).view(-1)
    return p, q, drafted


def chain_tree(q: torch.Tensor, drafted: torch.Tensor) -> TokenTree:
    """Branching 1 everywhere, mode iid; q's row gamma (the leaf's) is never read."""
    return TokenTree.from_branching(
        drafted, (1,) * drafted.shape[0], "iid", torch.cat([q, torch.zeros_like(q[:1])])
    )


@proof("a tree that is a chain is verify_step, draw for draw", "exact coupling")
def test_chain_is_verify_step_draw_for_draw() -> None:
    """A coupling: verify_tree on a chain draws its uniforms and its candidate tokens in the
    same order and shapes as verify_step, so with the same seed the outcomes are identical,
    not only equal in law."""
    gen = torch.Generator().manual_seed(0)
    for case in range(200):
        gamma, vocab = 1 + case % 5, 2 + case % 4
        p, q, drafted = chain_case(gamma, vocab, gen)
        expected = verify.verify_step(p, q, drafted, torch.Generator().manual_seed(case)).read()
        got = verify_tree(p, chain_tree(q, drafted), torch.Generator().manual_seed(case)).read()
        assert (got.tokens, got.accepted) == (expected.tokens, expected.accepted)
        assert got.path == list(range(got.accepted))
        verified = min(got.accepted + 1, gamma)  # the positions SpeculativeStats.record reads
        assert got.overlap == expected.overlap[:verified]


@proof("a chain-shaped tree has verify_step's outcome law", "exact enumeration, float64, to 1e-12")
def test_chain_has_verify_steps_outcome_law() -> None:
    gen = torch.Generator().manual_seed(1)
    for case in range(30):
        gamma, vocab = 1 + case % 4, 2 + case % 3
        p, q, drafted = chain_case(gamma, vocab, gen)
        a = verify.acceptance_probability(p[:gamma], q, drafted).tolist()
        fallback = torch.cat([verify.residual_distribution(p[:gamma], q), p[gamma:]]).tolist()
        expected: dict[tuple[tuple[int, ...], int], float] = {}
        for n in range(gamma + 1):  # n accepted, then the target's token from fallback[n]
            reach = math.prod(a[:n]) * (1 - a[n] if n < gamma else 1.0)
            for y, f in enumerate(fallback[n]):
                if reach * f > 0:
                    expected[tuple(range(n)), y] = reach * f
        token_tree = chain_tree(q, drafted)
        rules = tree.tree_rules(p, token_tree)
        got = walk_law(token_tree, rules.ratios.tolist(), rules.stop.tolist())
        assert (
            max(abs(got.get(k, 0.0) - expected.get(k, 0.0)) for k in set(got) | set(expected)) < TOL
        )


# ----------------------------------------------------------------------------- the tree itself, and bad input
def test_tree_helpers() -> None:
    t = TokenTree.from_branching(torch.arange(10), (2, 2, 1), "deterministic")
    assert t.parents == [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5]
    assert t.depths() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert t.children() == [0, 1] and t.children(1) == [4, 5] and t.children(9) == []
    assert t.children_by_row()[0] == [0, 1] and t.children_by_row()[3] == [6]
    assert t.path_to(8) == [1, 4, 8] and t.path_to(0) == [0]
    mask = t.ancestor_mask()
    assert mask[8].nonzero().view(-1).tolist() == [1, 4, 8]
    assert mask.sum().item() == 2 * 1 + 4 * 2 + 4 * 3
    assert len(branching_parents((3, 2, 1, 1))) == 21
    assert branching_parents(()) == []
    empty = TokenTree.from_branching(torch.zeros(0, dtype=torch.long), (), "deterministic")
    p = distribution([0, 1, 0]).view(1, 3)
    assert verify_tree(p, empty, torch.Generator().manual_seed(0)).read().tokens == [1]
    assert verify_tree_greedy(torch.tensor([2]), empty).read().tokens == [2]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: TokenTree(torch.tensor([1, 2]), [-1, 1], "deterministic"), "parent must be"),
        (lambda: TokenTree(torch.tensor([1, 2]), [-1, -2], "deterministic"), "parent must be"),
        (lambda: TokenTree(torch.tensor([1, 2]), [-1], "deterministic"), "2 tokens but 1 parents"),
        (lambda: TokenTree(torch.tensor([1.0]), [-1], "deterministic"), "LongTensor"),
        (lambda: TokenTree(torch.tensor([[1]]), [-1], "deterministic"), "LongTensor"),
        (lambda: TokenTree(torch.tensor([1]), [-1], "top-k"), "mode must be one of"),
        (lambda: TokenTree(torch.tensor([1]), [-1], "iid"), "needs q"),
        (
            lambda: TokenTree(torch.tensor([1]), [-1], "iid", torch.ones(1, 3)),
            r"\[N\+1, V\] = \[2, V\]",
        ),
        (lambda: TokenTree(torch.tensor([1]), [0.5], "deterministic"), "not an integer"),
        (lambda: TokenTree.from_branching(torch.arange(3), (2, 0)), "integers >= 1"),
        (lambda: TokenTree.from_branching(torch.arange(3), (True,)), "integers >= 1"),
        (lambda: TokenTree.from_branching(torch.arange(3), "21"), "sequence of integers"),
        (lambda: TokenTree.from_branching(torch.arange(3), (2, 2)), "has 6 nodes, got 3 tokens"),
        (
            lambda: TokenTree.from_branching(torch.arange(3), (3,), "deterministic").path_to(3),
            "not in a tree",
        ),
    ],
)
def test_bad_trees_are_refused(make: Callable, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_verification_inputs_are_refused() -> None:
    q = torch.full((3, 4), 0.25, dtype=torch.float64)
    t = TokenTree.from_branching(torch.tensor([1, 1]), (2,), "without_replacement", q)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=r"p must be \[N\+1, V\]"):
        verify_tree(q[:2], t, gen).read()
    with pytest.raises(ValueError, match="tokens per row"):
        verify_tree(torch.full((3, 5), 0.2, dtype=torch.float64), t, gen).read()
    with pytest.raises(ValueError, match="uniforms"):
        verify_tree(q, t, gen, uniforms=torch.zeros(3)).read()
    with pytest.raises(ValueError, match="same token"):
        verify_tree(q, t, gen).read()  # two siblings drawn without replacement cannot be equal
    with pytest.raises(ValueError, match="target_choice"):
        verify_tree_greedy(torch.tensor([0, 1]), t).read()


# ----------------------------------------------------------------------------- mutants
def residual_not_updated(p_cur, q_child, token, mode):
    """a. every sibling judged against the same p; the fallback is p too."""
    return p_cur, REAL_REJECT_CHILD(p_cur, q_child, token, mode)[1]


def siblings_judged_against_p(p, q, children, widths, mode):
    """a'. siblings judged against the untouched p, only the final fallback the residual
    after all of them (a multi-draft loop that forgot to hand the residual on)."""
    real = REAL_NODE_RULES(p, q, children, widths, mode)
    base = q if q is not None else torch.zeros_like(p)
    ratios = real.ratios.clone()
    for k in range(ratios.shape[1]):
        live = sum(1 for w in widths if w > k)
        token = children[:live, k]
        ratios[:live, k] = tree.child_acceptance(
            p[:live], tree.child_distribution(base[:live], token, mode), token
        )
    return tree.NodeRules(ratios=ratios, fallback=real.fallback, overlap=real.overlap)


def q_not_updated(p_cur, q_child, token, mode):
    """b. siblings drawn without replacement, judged as if drawn i.i.d."""
    return REAL_REJECT_CHILD(p_cur, q_child, token, "iid")


def q_not_renormalised(p_cur, q_child, token, mode):
    """b'. the rejected token removed from q, the rest not renormalised."""
    return verify.residual_distribution(p_cur, q_child), q_child.scatter(
        -1, token.unsqueeze(-1), 0.0
    )


def residual_at_drafted_token_only(p_cur, q_child, token, mode):
    """c. xLLM #2175: the residual subtracts q only at the drafted token, max(0, p - q(x) e_x)."""
    at_token = q_child * torch.nn.functional.one_hot(token, q_child.shape[-1]).to(q_child.dtype)
    return verify.residual_distribution(p_cur, at_token), REAL_REJECT_CHILD(
        p_cur, q_child, token, mode
    )[1]


def bonus_from_parent(p, token_tree):
    """g. at an accepted leaf the bonus token drawn from the parent's row of p."""
    rules = REAL_TREE_RULES(p, token_tree)
    rules.stop = rules.stop.clone()
    by_row = token_tree.children_by_row()
    for j, parent in enumerate(token_tree.parents):
        if not by_row[j + 1]:
            rules.stop[j + 1] = p[parent + 1]
    return rules


NODE_P, NODE_Q = distribution([1, 2, 3, 4, 0.5]), distribution([4, 1, 1, 2, 3])


@proof(
    "the tree identities can fail",
    "exact",
    rejects=(
        "siblings tested against the original p (xLLM #2175)",
        "siblings judged against p",
        "without-replacement q not updated",
        "without-replacement q not renormalised",
    ),
)
@pytest.mark.parametrize(
    "mutant, name, modes",
    [
        (residual_not_updated, "reject_child", ["iid", "without_replacement", "deterministic"]),
        (siblings_judged_against_p, "node_rules", ["iid", "deterministic"]),
        (q_not_updated, "reject_child", ["without_replacement"]),
        (q_not_renormalised, "reject_child", ["without_replacement"]),
        (residual_at_drafted_token_only, "reject_child", ["iid", "without_replacement"]),
    ],
    ids=[
        "a-residual-not-updated",
        "a-siblings-judged-against-p",
        "b-q-not-updated",
        "b-q-not-renormalised",
        "c-xllm-2175-residual-at-drafted-token",
    ],
)
def test_mutants_break_the_node_identity_and_tree_decoding(
    monkeypatch: pytest.MonkeyPatch, mutant: Callable, name: str, modes: list[str]
) -> None:
    target, draft = toy_pair(3, (2, 2), 5, 0.0, "other")
    for mode in modes:
        assert node_gap(NODE_P, NODE_Q, mode, 3) < TOL  # the real rule, on the same case
        assert (
            max_gap(
                tree_decoding_distribution(target, draft, (0,), (3, 2), mode, 3, Sampling()),
                sequence_distribution(reference_next(target, Sampling()), (0,), 3),
            )
            < TOL
        )
    monkeypatch.setattr(tree, name, mutant)
    for mode in modes:
        assert node_gap(NODE_P, NODE_Q, mode, 3) > 1e-3, mode
        got = tree_decoding_distribution(target, draft, (0,), (3, 2), mode, 3, Sampling())
        assert (
            max_gap(got, sequence_distribution(reference_next(target, Sampling()), (0,), 3)) > 1e-3
        ), mode


@proof(
    "a child of target probability 0 is never accepted, even at r = 0",
    "exact: r forced to 0",
    rejects=("r <= ratio (SGLang #35771)",),
)
@pytest.mark.parametrize("mode", ["iid", "without_replacement", "deterministic"])
def test_zero_probability_child_is_never_accepted_even_at_r_0(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """d. SGLang #35771: accepting when r <= ratio takes a child the target gives
    probability 0 when the uniform draw is exactly 0 (torch.rand can return 0). No
    probability calculation sees it (P(r <= a) = P(r < a)), so the uniforms are forced to 0."""
    p = distribution([0, 1, 1, 1]).repeat(3, 1)  # token 0 is impossible after every path
    q = distribution([5, 1, 1, 1]).repeat(3, 1)  # and the draft likes it
    t = TokenTree(torch.tensor([0, 2]), [-1, -1], mode, q)
    zeros = torch.zeros(2, dtype=torch.float64)
    real = verify_tree(p, t, torch.Generator().manual_seed(0), uniforms=zeros).read()
    assert real.path == [1] and real.tokens[0] == 2  # node 0 rejected, node 1 (ratio > 0) accepted
    monkeypatch.setattr(tree, "passes", lambda r, ratio: r <= ratio)
    broken = verify_tree(p, t, torch.Generator().manual_seed(0), uniforms=zeros).read()
    assert broken.path == [0] and broken.tokens[0] == 0  # an impossible token emitted


@proof(
    "children judged with another q than they were drawn from are caught",
    "exact",
    rejects=("raw q (transformers #47932 / vLLM #10198)",),
)
@pytest.mark.parametrize("mode", ["iid", "without_replacement"])
def test_children_drawn_from_warped_q_but_judged_with_raw_q_are_caught(mode: str) -> None:
    """e. transformers #47932, vLLM #10198: the draft samples from its top-k/temperature-
    warped q, the ratio and residual use the raw softmax. Any q is fine as long as it is the
    one the children were drawn from; this mismatch is not."""
    warped = Sampling(temperature=0.7, top_k=2)
    raw = Sampling()
    q_raw = warp(torch.log(NODE_Q), raw)
    q_warped = warp(torch.log(NODE_Q), warped)
    assert node_gap(NODE_P, q_warped, mode, 2) < TOL  # judged with what it was drawn from: exact
    assert node_gap(NODE_P, q_raw, mode, 2, draft_q=q_warped) > 1e-3
    target, draft = toy_pair(4, (2, 2), 9, 0.0, "other")
    expected = sequence_distribution(reference_next(target, warped), (0,), 3)
    assert (
        max_gap(tree_decoding_distribution(target, draft, (0,), (2, 2), mode, 3, warped), expected)
        < TOL
    )
    got = tree_decoding_distribution(target, draft, (0,), (2, 2), mode, 3, warped, judge=raw)
    assert max_gap(got, expected) > 1e-3


@proof(
    "the bonus at an accepted leaf comes from the leaf's own p",
    "exact and sampled",
    rejects=("bonus from the parent's p",),
)
@pytest.mark.parametrize("mode", MODES)
def test_bonus_from_the_parents_p_is_caught(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """g. the bonus token at an accepted leaf drawn from its parent's p instead of the
    leaf's own row: caught exactly on whole trees and by the sampled walk."""
    target, draft = toy_pair(3, (2, 2), 3, 0.0, "other")
    expected = sequence_distribution(reference_next(target, Sampling()), (0,), 3)
    token_tree, p = fixed_case(mode)
    outcomes = expected_outcomes(token_tree, p)
    monkeypatch.setattr(tree, "tree_rules", bonus_from_parent)
    assert (
        max_gap(one_iteration_distribution(target, draft, (0,), (2, 2), mode, Sampling()), expected)
        > 1e-3
    )
    assert chi_square_pvalue(sampled_outcomes(token_tree, p, 1500, seed=2), outcomes) < 1e-3
