"""Batched speculation emits, in every row, exactly the target's distribution, and rows are
independent of each other -- proved on the real batched loop, and shown to fail on broken
variants.

* Exact enumeration: the real ``speculative_generate_batch`` runs with two rows of
  different prompt lengths, but every random choice (a drafted token, an accept/reject, a
  residual or bonus token) is taken by a Chooser (speculative.proofs.branching) that replays a script; a
  depth-first search over scripts visits every branch once, with its exact probability
  (float64). The joint law of the two rows' first tokens must be the product of the
  target's own laws, to 1e-10. The acceptance test and the residual are the library's
  (proved alone in tests/speculative/verify/test_token.py); what is tested here is the batching.
* Chi-square, end to end with the real generators: each row's first tokens against the
  target's exact law, and the joint law of two rows with the same prompt against the
  product of the marginals.

Mutants (each must be rejected): ``other-rows-q`` (row b judged with the q of the row judged
before it); ``position-of-other-row`` (a row's cache position advanced by another row's
count); ``shared-uniforms`` (every row seeded alike, so rows with one prompt draw the same
uniforms: each row's marginal is still exact -- the marginal test passes -- and only the
joint test sees it). Look-alike (must pass): ``cut-to-shortest`` (every row keeps only as
many tokens as the row that kept fewest: a prefix of an exact sample, only slower).
"""

from __future__ import annotations

import importlib
import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch

import speculative.verify.token as verify
from speculative import speculative_generate_batch
from speculative.proofs.branching import Chooser
from speculative.proofs.branching import enumerate_runs as enumerate_law
from speculative.sampling import Sampling
from tests.support.proofs import proof
from tests.support.statistical import set_verify_step
from tests.support.toy_models import (
    chi_square_pvalue,
    llama_next_logits,
    random_llama,
    ref_warp,
    sequence_distribution,
)

torch.set_num_threads(1)
batch = importlib.import_module("speculative.engine.engine")
judging = importlib.import_module("speculative.engine.judging")
drafter_module = importlib.import_module("speculative.draft.protocol")
loop = importlib.import_module("speculative.engine.engine")

TOL = 1e-10
P_VALUE = 1e-3


# ----------------------------------------------------------------------------- mutants
def other_rows_q(mp: pytest.MonkeyPatch) -> None:
    """Row b is judged with the q that came with the row judged just before it."""
    real, previous = judging.judge, {}

    def judge(logits, drafted, q, tree, sampling, rule, generator, finite=None):
        other = previous.get("q")
        previous["q"] = q
        if other is not None and q is not None and other.shape == q.shape:
            q = other
        return real(logits, drafted, q, tree, sampling, rule, generator, finite)

    mp.setattr(judging, "judge", judge)


def position_of_other_row(mp: pytest.MonkeyPatch) -> None:
    """Row b's target cache position moves as if it had accepted row b+1's count. (Where that
    is less than its own, the row only re-reads tokens, which is harmless; where it is more,
    the row skips its newest tokens.)"""

    real = batch.Engine.commit

    def commit(self, rows, draft, steps, hidden):
        real(self, rows, draft, steps, hidden)
        # None: plain steps left on the device
        for b, row in enumerate(rows if steps is not None else []):
            other = steps[(b + 1) % len(steps)]
            row.target_next = row.length - 1 - steps[b].accepted + other.accepted

    mp.setattr(batch.Engine, "commit", commit)


def shared_uniforms(mp: pytest.MonkeyPatch) -> None:
    """Every row's generator gets the first row's seed."""
    generation = importlib.import_module("speculative.engine.generation")
    real = generation.row_seeds
    mp.setattr(generation, "row_seeds", lambda seed, count: real(seed, count)[:1] * count)


def cut_to_shortest(mp: pytest.MonkeyPatch) -> None:
    """Every row emits as many tokens as the row that emitted fewest (rollback stays consistent)."""
    real = batch.judge_rows

    def judge_rows(*args, **kwargs):
        verdict = real(*args, **kwargs)

        def finish(*host):
            steps = verdict.finish(*host)
            keep = min(len(step.tokens) for step in steps)
            return [
                verify.Verification(step.tokens[:keep], min(step.accepted, keep), step.overlap)
                for step in steps
            ]

        return verify.Verdict(verdict.parts, finish)

    mp.setattr(batch, "judge_rows", judge_rows)


BUGS = {"other-rows-q": other_rows_q, "position-of-other-row": position_of_other_row}


# ----------------------------------------------------------------------------- enumeration
def enumerate_runs(run: Callable[[], list[list[int]]], chooser_box: dict) -> dict[tuple, float]:
    """The exact law of ``run()``'s outcome, summed over every script (speculative.proofs.branching's depth-first
    search); ``chooser_box["now"]`` is the run's Chooser. A broken variant may also crash: an outcome too."""

    def scripted(chooser: Chooser) -> tuple:
        chooser_box["now"] = chooser
        try:
            return tuple(tuple(tokens) for tokens in run())
        except (ValueError, IndexError, RuntimeError):
            return ("error",)

    return enumerate_law(scripted)


def install_chooser(mp: pytest.MonkeyPatch, box: dict) -> None:
    """Route the batched loop's randomness through box["now"]: drafted tokens (sample_rows in
    the drafter), lines 5-9 (the verifier, with the library's own ratio and residual) and the
    engine's plain step where no row drafted (sample_rows in speculative.engine.judging)."""

    def sample_rows(probs: torch.Tensor, generators: list) -> torch.Tensor:
        picks = [
            box["now"].choose(row.tolist()) if gen is not None else int(row.argmax())
            for row, gen in zip(probs, generators)
        ]
        return torch.tensor(picks)

    def enumerated_verify(
        p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator
    ) -> verify.Verdict:
        tokens, chooser = [], box["now"]
        for i, x in enumerate(drafted.tolist()):
            a = float(verify.acceptance_probability(p[i], q[i], x))
            if chooser.choose([a, 1 - a]) == 1:  # rejected: the target's token from the residual
                y = chooser.choose(verify.residual_distribution(p[i], q[i]).tolist())
                return decided(verify.Verification(tokens + [y], i, [0.0] * len(drafted)))
            tokens.append(x)
        y = chooser.choose(p[len(tokens)].tolist())  # all accepted: the bonus token
        return decided(verify.Verification(tokens + [y], len(tokens), [0.0] * len(drafted)))

    def decided(
        outcome: verify.Verification,
    ) -> verify.Verdict:  # decided on the host already: nothing to copy
        return verify.Verdict([], lambda: outcome)

    mp.setattr(drafter_module, "sample_rows", sample_rows)
    # an iteration where no row drafted: t ~ p_1 per row
    mp.setattr(judging, "sample_rows", sample_rows)
    set_verify_step(mp, enumerated_verify)


def make_pair(vocab: int) -> dict:
    """A float64 LLaMA target and an independent draft (low acceptance, so every branch has weight)."""
    target = random_llama(
        vocab=vocab,
        dim=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        hidden_dim=16,
        max_seq_len=32,
        seed=11,
        std=0.6,
        dtype=torch.float64,
    )
    draft = random_llama(
        vocab=vocab,
        dim=8,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        hidden_dim=16,
        max_seq_len=32,
        seed=12,
        std=0.6,
        dtype=torch.float64,
    )
    return {"target": target, "draft": draft, "logits": llama_next_logits(target)}


@pytest.fixture(scope="module")
def pairs() -> dict[int, dict]:
    return {vocab: make_pair(vocab) for vocab in (2, 3)}


PROMPTS = [[1], [0, 0, 1, 1]]  # two rows of different prompt lengths


def product_law(pair: dict, sampling: Sampling, length: int) -> dict[tuple, float]:
    """The target's own law for each row, independently, from no-cache logits and the reference warp."""
    laws = [
        sequence_distribution(
            lambda ctx: ref_warp(
                pair["logits"](ctx).tolist(), sampling.temperature, sampling.top_k, sampling.top_p
            ),
            prompt,
            length,
        )
        for prompt in PROMPTS
    ]
    return {(a, b): pa * pb for a, pa in laws[0].items() for b, pb in laws[1].items()}


def batch_law(
    pair: dict, sampling: Sampling, gamma: int, length: int, mp: pytest.MonkeyPatch
) -> dict[tuple, float]:
    box: dict = {}
    install_chooser(mp, box)

    def run() -> list[list[int]]:
        out = speculative_generate_batch(
            pair["target"],
            pair["draft"],
            PROMPTS,
            length,
            gamma=gamma,
            verify="token",  # the rule enumerated here (token-wise, speculative.verify.token)
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=0,
        )
        return [r.tokens for r in out.results]

    return enumerate_runs(run, box)


def gap(a: dict[tuple, float], b: dict[tuple, float]) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# (vocab, sampling, gamma, tokens per row): the branches multiply across rows, so the cases stay small
CASES = [
    (2, Sampling(), 2, 3),
    (3, Sampling(temperature=0.7, top_k=2), 2, 3),
    (3, Sampling(temperature=1.3, top_p=0.95), 1, 2),
]


@proof(
    "rows of a batch are independent and each exact: the joint law of two rows is the product of the target's laws",
    "exact enumeration of the real engine, float64, to 1e-10, rows of different lengths",
)
@pytest.mark.parametrize("vocab, sampling, gamma, length", CASES)
def test_exact_law_of_two_rows_is_the_product_of_target_laws(
    pairs: dict,
    vocab: int,
    sampling: Sampling,
    gamma: int,
    length: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    got = batch_law(pairs[vocab], sampling, gamma, length, monkeypatch)
    assert math.isclose(sum(got.values()), 1.0, abs_tol=TOL)
    assert gap(got, product_law(pairs[vocab], sampling, length)) < TOL


@pytest.mark.parametrize("vocab, sampling, gamma, length", CASES)
def test_a_look_alike_that_only_cuts_rows_short_stays_exact(
    pairs: dict,
    vocab: int,
    sampling: Sampling,
    gamma: int,
    length: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cut-to-shortest is slower, not wrong: the enumeration must not reject it (it is not a
    proof of exactness, so ``pytest -m proof`` leaves it to the full suite)."""
    cut_to_shortest(monkeypatch)
    got = batch_law(pairs[vocab], sampling, gamma, length, monkeypatch)
    assert gap(got, product_law(pairs[vocab], sampling, length)) < TOL


@proof(
    "the batch enumeration can fail",
    "exact",
    rejects=("another row's q", "another row's cache position"),
)
@pytest.mark.parametrize("variant", list(BUGS))
def test_exact_law_catches_broken_batching(
    pairs: dict, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    BUGS[variant](monkeypatch)
    got = batch_law(pairs[2], Sampling(), 2, 3, monkeypatch)
    assert gap(got, product_law(pairs[2], Sampling(), 3)) > 1e-3


def test_chooser_search_visits_every_branch_once() -> None:
    """The search itself, on a known law: two dice of weights (1/2, 1/4, 1/4) and (1/3, 2/3)."""
    box: dict = {}

    def run() -> list[list[int]]:
        return [[box["now"].choose([0.5, 0.25, 0.25]), box["now"].choose([1 / 3, 0.0, 2 / 3])]]

    law = enumerate_runs(run, box)
    expected = {
        ((a, b),): pa * pb
        for a, pa in enumerate([0.5, 0.25, 0.25])
        for b, pb in ((0, 1 / 3), (2, 2 / 3))
    }
    assert gap(law, expected) < 1e-15 and len(law) == 6


# ----------------------------------------------------------------------------- chi-square, real generators
RUNS = 1200


@pytest.fixture(scope="module")
def llama8() -> dict:
    """float32 target and draft over 8 tokens, as in test_generation_statistical.py."""
    target = random_llama(
        vocab=8, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32, seed=0
    )
    draft = random_llama(vocab=8, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=16, seed=1)
    return {"target": target, "draft": draft, "logits": llama_next_logits(target)}


def row_law(pair: dict, prompt: list[int], sampling: Sampling, length: int) -> dict[tuple, float]:
    return sequence_distribution(
        lambda ctx: ref_warp(
            pair["logits"](ctx).tolist(), sampling.temperature, sampling.top_k, sampling.top_p
        ),
        prompt,
        length,
    )


def batch_samples(
    pair: dict, prompts: list[list[int]], sampling: Sampling, length: int
) -> list[Counter]:
    """Per row, the first ``length`` tokens of RUNS batched runs; run r seeds its rows with
    2r + i, so no seed is used twice."""
    counts = [Counter() for _ in prompts] + [Counter()]
    for run in range(RUNS):
        try:
            out = speculative_generate_batch(
                pair["target"],
                pair["draft"],
                prompts,
                length,
                gamma=2,
                verify="token",  # the rule enumerated here (token-wise, speculative.verify.token)
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                seed=len(prompts) * run,
            )
            rows = [tuple(r.tokens[:length]) for r in out.results]
        # a broken variant may crash: an impossible outcome
        except (
            ValueError,
            IndexError,
            RuntimeError,
        ):
            rows = [(-1,) * length for _ in prompts]
        for counter, row in zip(counts, rows):
            counter[row] += 1
        counts[-1][(rows[0][0], rows[1][0])] += 1  # the joint first tokens of rows 0 and 1
    return counts


@proof(
    "each row of a batch follows the target's law",
    "chi-square, p > 1e-3, 1200 seeded runs, 64 cells per row",
    rejects=("another row's q", "another row's cache position"),
)
@pytest.mark.parametrize("variant", ["correct", "shared-uniforms", *BUGS])
def test_each_row_has_the_target_distribution(
    llama8: dict, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rows of different prompts, the first 2 tokens of each (64 cells per row)."""
    if variant == "shared-uniforms":
        shared_uniforms(monkeypatch)
    elif variant in BUGS:
        BUGS[variant](monkeypatch)
    sampling, prompts = Sampling(temperature=0.8), [[1, 5], [3, 3, 6, 2, 7]]
    counts = batch_samples(llama8, prompts, sampling, 2)
    p_values = [
        chi_square_pvalue(counts[i], row_law(llama8, prompts[i], sampling, 2)) for i in range(2)
    ]
    if variant in BUGS:
        assert min(p_values) < P_VALUE, f"{variant} not caught (p = {p_values})"
    else:  # shared uniforms leave each row's marginal exact: only the joint test below sees them
        assert min(p_values) > P_VALUE, f"{variant} rejected (p = {p_values})"


@proof(
    "rows with the same prompt are independent",
    "chi-square, p > 1e-3 on the joint law",
    rejects=("every row seeded alike",),
)
@pytest.mark.parametrize("variant", ["correct", "shared-uniforms"])
def test_rows_are_independent(llama8: dict, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rows with the same prompt: the joint law of their first tokens is the product of
    the target's law with itself (64 cells)."""
    if variant == "shared-uniforms":
        shared_uniforms(monkeypatch)
    sampling, prompt = Sampling(), [4, 1]
    counts = batch_samples(llama8, [prompt, prompt], sampling, 1)
    first = row_law(llama8, prompt, sampling, 1)
    joint = {(a[0], b[0]): pa * pb for a, pa in first.items() for b, pb in first.items()}
    p_value = chi_square_pvalue(counts[-1], joint)
    if variant == "correct":
        assert p_value > P_VALUE, f"independent rows rejected (p = {p_value:.3g})"
    else:
        assert p_value < P_VALUE, f"shared uniforms not caught (p = {p_value:.3g})"
