"""Token trees end to end: speculative_generate(..., tree=...) with a draft model and with the
feature drafter, on a LLaMA target (tree attention, each node at its depth, the accepted
path moved into place with move_cache).

* Chi-square: the first tokens have the target's exact distribution, for every way of
  drawing children (without replacement, i.i.d., deterministic top-k), for both drafters;
  and the same test rejects the tree mutants injected into the real loop (a: the residual
  not updated between siblings; b: siblings drawn without replacement judged with an
  unrenormalised q; g: the bonus token at a leaf drawn from the parent's p).
* Greedy: the output is the target's own greedy output, token for token (float64).
* Bookkeeping: a tree that shrinks near max_new_tokens and the context's end, and the stats.
* tree="auto": the shape chosen by whole iterations' timings (a fake clock), the law kept across
  a change of shape (chi-square, with a mutant it rejects), greedy output unchanged.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch

from speculative import FeatureDrafter, PromptLookupDrafter, speculative_generate
from speculative.engine.trees import AUTO_SHAPES, AutoTree
from speculative.sampling import Sampling
from tests.support.proofs import proof
from tests.support.statistical import P_VALUE, sample_counts, window_distribution
from tests.support.toy_models import (
    chi_square_pvalue,
    llama_next_logits,
    noisy_copy,
    random_head,
    random_llama,
    ref_warp,
    reference_greedy,
)

tree_module = importlib.import_module("speculative.verify.tree")
engine_module = importlib.import_module("speculative.engine.engine")
gamma_policy_module = importlib.import_module("speculative.engine.gamma_policy")
real_reject = tree_module.reject_child
real_tree_rules = tree_module.tree_rules

RUNS = 1000


def residual_not_updated(mp: pytest.MonkeyPatch) -> None:
    """a. every sibling judged against the node's first p (xLLM-style residual bookkeeping bug)."""
    mp.setattr(
        tree_module,
        "reject_child",
        lambda p_cur, q_child, token, mode: (p_cur, real_reject(p_cur, q_child, token, mode)[1]),
    )


def q_not_renormalised(mp: pytest.MonkeyPatch) -> None:
    """b. siblings drawn without replacement, but q kept as it was."""
    mp.setattr(
        tree_module,
        "reject_child",
        lambda p_cur, q_child, token, mode: (real_reject(p_cur, q_child, token, mode)[0], q_child),
    )


def bonus_from_parent(mp: pytest.MonkeyPatch) -> None:
    """g. at an accepted leaf, the bonus token drawn from the parent's row of p."""

    def rules(p, tree):
        out = real_tree_rules(p, tree)
        by_row = tree.children_by_row()
        for node, parent in enumerate(tree.parents):
            if not by_row[node + 1]:  # a leaf
                out.stop[node + 1] = p[parent + 1]
        return out

    mp.setattr(tree_module, "tree_rules", rules)


MUTANTS = {
    "residual-not-updated": residual_not_updated,
    "q-not-renormalised": q_not_renormalised,
    "bonus-from-parent": bonus_from_parent,
}


@pytest.fixture(scope="module")
def pair() -> dict:
    target = random_llama(
        vocab=6,
        dim=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        hidden_dim=32,
        seed=0,
        dtype=torch.float64,
    )
    return {
        "target": target,
        "draft": random_llama(
            vocab=6,
            dim=8,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            hidden_dim=16,
            seed=1,
            dtype=torch.float64,
        ),
        "head": random_head(target),
        "logits": llama_next_logits(target),
    }


CASES = [
    ("model", "without_replacement", None),
    ("model", "iid", None),
    ("model", "deterministic", None),
    ("feature", "without_replacement", None),
    ("feature", "iid", None),
    ("model", "iid", "residual-not-updated"),
    ("model", "without_replacement", "q-not-renormalised"),
    ("feature", "without_replacement", "bonus-from-parent"),
]


@proof(
    "the engine with token trees follows the target's law (draft model and feature head)",
    "chi-square, p > 1e-3, 1000 seeded runs",
    rejects=("residual not updated (xLLM #2175)", "q not renormalised"),
)
@pytest.mark.parametrize(
    "drafter, mode, mutant", CASES, ids=[f"{d}-{m}-{b or 'correct'}" for d, m, b in CASES]
)
def test_tree_first_tokens_have_the_target_distribution(
    pair: dict, drafter: str, mode: str, mutant: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tree (3, 2) at temperature 1 over 6 tokens, two tokens jointly: tokens 1-2 for the draft
    model, 2-3 for the feature drafter (whose first iteration is a plain step, so its first
    tree decides token 2 onwards)."""
    if mutant is not None:
        MUTANTS[mutant](monkeypatch)
    target = pair["target"]
    draft = pair["draft"] if drafter == "model" else FeatureDrafter(pair["head"], target)
    sampling = Sampling(temperature=1.0)
    drafted = 0

    def generate(seed: int) -> list[int]:
        nonlocal drafted
        out = speculative_generate(
            target, draft, [1, 4], 3, temperature=1.0, seed=seed, tree=(3, 2), tree_mode=mode
        )
        drafted += out.stats.drafted_tokens
        return out.tokens

    skip = 0 if drafter == "model" else 1
    counts = sample_counts(generate, RUNS, skip, 2)

    def next_probs(ctx: tuple[int, ...]) -> list[float]:
        return ref_warp(pair["logits"](ctx).tolist(), sampling.temperature)

    p_value = chi_square_pvalue(counts, window_distribution(next_probs, [1, 4], skip, 2))
    assert drafted > RUNS
    if mutant is not None:
        assert p_value < P_VALUE, f"the test did not catch {mutant} (p = {p_value:.3g})"
    else:
        assert p_value > P_VALUE, f"{drafter}/{mode} rejected (p = {p_value:.3g})"


@pytest.fixture(scope="module")
def llama64() -> dict:
    target = random_llama(
        vocab=16,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        max_seq_len=64,
        seed=3,
        dtype=torch.float64,
    )
    return {
        "target": target,
        "close": noisy_copy(target, 0.05),
        "head": random_head(target, std=0.2),
    }


@proof("greedy trees give the target's greedy output", "exact identity")
@pytest.mark.parametrize("shape", [(1,), (2,), (3, 2, 1, 1), (2, 2, 2), (4, 1, 1, 1, 1)])
@pytest.mark.parametrize("kind", ["close", "feature"])
def test_greedy_trees_give_the_target_greedy_output(
    llama64: dict, shape: tuple[int, ...], kind: str
) -> None:
    target = llama64["target"]
    draft = llama64["close"] if kind == "close" else FeatureDrafter(llama64["head"], target)
    for prompt in ([1], [3, 1, 4, 1, 5]):
        out = speculative_generate(target, draft, prompt, 30, temperature=0, tree=shape)
        assert out.tokens == reference_greedy(target, prompt, 30)


def test_a_tree_accepts_more_than_its_chain(llama64: dict) -> None:
    """Greedy, a close draft: the (3, 2, 1, 1) tree keeps at least as many tokens per target call
    as the 4-token chain, and the chain of the tree's first children is the chain itself."""
    target, draft = llama64["target"], llama64["close"]
    chain = speculative_generate(target, draft, [2, 7], 40, gamma=4, temperature=0)
    tree = speculative_generate(target, draft, [2, 7], 40, temperature=0, tree=(3, 2, 1, 1))
    assert tree.tokens == chain.tokens
    assert tree.stats.tokens_per_target_call >= chain.stats.tokens_per_target_call


def test_trees_shrink_at_the_limits_and_the_stats_add_up(llama64: dict) -> None:
    target, draft = llama64["target"], llama64["close"]
    for max_new in (1, 2, 5, 13):
        out = speculative_generate(
            target, draft, [1, 2], max_new, temperature=1.0, seed=max_new, tree=(2, 2, 2)
        )
        assert len(out.tokens) == max_new and out.stats.stop_reason == "max_new_tokens"
        assert max(out.stats.gamma_history) <= 3 and out.stats.drafted_tokens >= sum(
            out.stats.gamma_history
        )
    long = speculative_generate(
        target, draft, list(range(1, 16)) * 3, 100, temperature=0, tree=(2, 2, 2)
    )
    assert 45 + len(long.tokens) == 64 and long.stats.stop_reason == "max_seq_len"
    assert long.tokens == reference_greedy(target, list(range(1, 16)) * 3, len(long.tokens))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tree": (0, 2)}, "integers >= 1"),
        ({"tree": ()}, "at least one depth"),
        ({"tree": (2, 2), "tree_mode": "topk"}, "tree_mode must be one of"),
        ({"tree": (2, 2), "verify": "block"}, "--verify block judges a chain"),
        (
            {"tree": (2, 2), "verify": lambda p, q, drafted, generator: None},
            "a verifier of your own judges a chain",
        ),
        ({"tree": (2, 2), "gamma": 7}, "leave gamma alone"),
        (
            {"tree": (2, 2), "gamma": 4},
            "leave gamma alone",
        ),  # the default's value, given: still two settings
        ({"tree": (8, 8)}, "cannot fit"),
    ],
)
def test_bad_tree_requests(llama64: dict, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        speculative_generate(llama64["target"], llama64["close"], [1], 5, **kwargs)


def test_a_tree_with_its_own_depth_as_gamma_is_one_setting(llama64: dict) -> None:
    out = speculative_generate(
        llama64["target"], llama64["close"], [1], 5, temperature=0, tree=(2, 2), gamma=2
    )
    assert len(out.tokens) == 5


def test_a_drafter_without_trees_is_refused(llama64: dict) -> None:
    with pytest.raises(ValueError, match="cannot build token trees"):
        speculative_generate(llama64["target"], PromptLookupDrafter(), [1], 5, tree=(2, 1))


# ----------------------------------------------------------------------------- tree="auto"
class Clock:
    """Marks are seconds on a clock the test moves."""

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start


def drive(
    auto: AutoTree,
    iterations: int,
    cost: dict,
    first: int = 0,
    now: float = 0.0,
    limited: Callable[[int], bool] = lambda i: False,
) -> tuple[list[tuple[int, ...]], float]:
    """Run the engine's side of ``auto`` for ``iterations``: iteration i uses the shape chosen,
    takes cost[shape] = (seconds, tokens), or cost[shape](i) (a plain step after a drafted one is
    clean; the one after a plain step costs twice, as a drafter catching up), or drafts nothing
    where ``limited(i)``."""
    chosen, previous = [], None
    for i in range(first, first + iterations):
        shape = auto.choose(i)
        depth = 0 if limited(i) else len(shape)
        spent = cost[shape] if depth or not shape else cost[()]
        seconds, tokens = spent(i) if callable(spent) else spent
        seconds *= 2 if depth and previous == 0 else 1
        auto.observe(i, depth, tokens, now, Clock)
        chosen.append(shape)
        now, previous = now + seconds, depth
    return chosen, now


def test_auto_tries_every_shape_then_keeps_the_fastest_and_probes_the_others() -> None:
    """A fake clock: every shape is tried until it has a clean iteration (the prompt's, the one
    after a plain step and one cut to nothing do not count), then the most tokens per second
    wins, and one iteration in 8 goes to the shape measured longest ago. A shape is judged on its
    last 6 clean iterations together: one unlucky iteration does not hand the run to a plain step,
    and a shape that got faster takes over once its figure shows it."""
    shapes = ((1, 1), (2, 1), ())
    cost = {(1, 1): (1.0, 2), (2, 1): (1.0, 3), (): (1.0, 1)}
    auto = AutoTree(shapes=shapes)
    chosen, now = drive(auto, 6, cost)
    # 0: the prompt's (not counted) -> (1, 1) again; then (2, 1); then plain; after it (2, 1)'s
    # iteration is not clean (a catch-up) but (2, 1) was measured already: the fastest is used.
    assert chosen[:4] == [(1, 1), (1, 1), (2, 1), ()]
    assert chosen[4:] == [(2, 1), (2, 1)] and set(auto.rates) == set(shapes)
    chosen, now = drive(auto, 18, cost, first=6, now=now)
    probes = [i for i, shape in enumerate(chosen, start=6) if shape != (2, 1)]
    # the longest unseen first
    assert probes == [8, 16] and chosen[8 - 6] == (1, 1) and chosen[16 - 6] == ()
    # The plain step gets faster than (2, 1): once its probes show it, it is the one kept.
    chosen, _ = drive(auto, 120, {**cost, (): (0.2, 1)}, first=24, now=now)
    assert chosen[-8:].count(()) >= 6  # a probe now takes two iterations: catching up, then timed
    # The plain step leads, then (2, 1) gets faster: a probe after a plain step catches up first and is
    # timed on its second iteration, so (2, 1) is seen again and takes over.
    auto = AutoTree(shapes=shapes)
    slow = {(1, 1): (1.0, 1), (2, 1): (1.0, 1), (): (0.5, 1)}
    chosen, now = drive(auto, 30, slow)
    assert chosen[-8:].count(()) >= 6
    chosen, _ = drive(auto, 150, {**slow, (2, 1): (0.5, 3)}, first=30, now=now)
    assert chosen[-8:].count((2, 1)) >= 6
    # Sampled: (2, 1)'s iterations emit 1 or 3 tokens (2 a second on average), the plain step 1.6, (1, 1) 1.3: a
    # single iteration of 1 token would put (2, 1) below it, the last 6 together do not.
    auto = AutoTree(shapes=shapes)
    noisy = {(1, 1): (1.5, 2), (2, 1): lambda i: (1.0, 1 if i % 4 in (0, 1) else 3), (): (0.625, 1)}
    chosen, _ = drive(auto, 200, noisy)
    assert chosen[-100:].count((2, 1)) >= 80
    # Cut to nothing by the row's limits: a drafted shape that drafted nothing is not timed as itself.
    auto = AutoTree(shapes=shapes)
    drive(auto, 5, cost, limited=lambda i: i in (1, 2))
    assert auto.rates.get((1, 1)) is None or auto.seen[(1, 1)] not in (1, 2)


def test_auto_covers_every_candidate() -> None:
    """The cache slots kept free for "auto" hold the largest of its trees, at every depth."""
    covering = AutoTree().covering()
    assert covering == (3, 2, 1, 1)
    from speculative.verify.tree import branching_parents

    assert all(
        len(branching_parents(s)) <= len(branching_parents(covering)) for s in AUTO_SHAPES if s
    )


@proof(
    'tree="auto" follows the target\'s law while its shape changes from one iteration to the next',
    "chi-square, p > 1e-3, 1000 seeded runs",
    rejects=("residual not updated (xLLM #2175)",),
)
@pytest.mark.parametrize(
    "mutant", [None, "residual-not-updated"], ids=["correct", "residual-not-updated"]
)
def test_auto_tree_tokens_have_the_target_distribution(
    pair: dict, mutant: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokens 3-4 jointly at temperature 1, the first iterations' shapes a chain of one, twice (the
    prompt's iteration is not timed), then (2, 1, 1): what auto tries first does not depend on the
    clock, so the window spans a change of shape in most runs."""
    if mutant is not None:
        MUTANTS[mutant](monkeypatch)
    monkeypatch.setattr(
        gamma_policy_module, "AutoTree", lambda: AutoTree(shapes=((1,), (2, 1, 1), ()))
    )
    target, sampling, shapes = pair["target"], Sampling(temperature=1.0), []

    def generate(seed: int) -> list[int]:
        out = speculative_generate(
            target, pair["draft"], [1, 4], 6, temperature=1.0, seed=seed, tree="auto"
        )
        shapes.append(tuple(out.stats.tree_shapes))
        return out.tokens

    counts = sample_counts(generate, RUNS, 2, 2)

    def next_probs(ctx: tuple[int, ...]) -> list[float]:
        return ref_warp(pair["logits"](ctx).tolist(), sampling.temperature)

    p_value = chi_square_pvalue(counts, window_distribution(next_probs, [1, 4], 2, 2))
    assert sum((2, 1, 1) in s for s in shapes) > RUNS // 2  # most runs changed shape
    if mutant is not None:
        assert p_value < P_VALUE, f"the test did not catch {mutant} (p = {p_value:.3g})"
    else:
        assert p_value > P_VALUE, f"tree auto rejected (p = {p_value:.3g})"


@pytest.mark.parametrize("kind", ["close", "feature"])
def test_greedy_auto_gives_the_target_greedy_output_and_says_what_it_chose(
    llama64: dict, kind: str
) -> None:
    target = llama64["target"]
    draft = llama64["close"] if kind == "close" else FeatureDrafter(llama64["head"], target)
    out = speculative_generate(target, draft, [3, 1, 4, 1, 5], 40, temperature=0, tree="auto")
    assert out.tokens == reference_greedy(target, [3, 1, 4, 1, 5], 40)
    assert len(out.stats.tree_shapes) >= 4 and set(out.stats.tree_shapes) <= set(AUTO_SHAPES)
    assert sum(out.stats.tree_shapes.values()) <= out.stats.target_calls
    assert out.stats.to_dict()["tree_shapes"]  # JSON-friendly keys
    assert all(isinstance(k, str) for k in out.stats.to_dict()["tree_shapes"])


def test_a_tree_name_that_is_not_auto_is_refused(llama64: dict) -> None:
    with pytest.raises(ValueError, match='or "auto"'):
        speculative_generate(llama64["target"], llama64["close"], [1], 5, tree="best")
