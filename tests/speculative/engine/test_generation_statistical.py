"""End to end, with sampling: the real speculative_generate loop, run many times, emits its
first tokens with the target's exact joint distribution -- and deliberately broken variants
of the algorithm are caught by the very same test.

The test: run the loop N times (seeds 0..N-1), count the first few tokens jointly, and
compare with the target's exact distribution (computed from no-cache logits and the
plain-Python reference warp) by Pearson's chi-square; reject at p < 1e-3. Everything is
seeded, so every outcome is reproducible.

Variants are injected by monkeypatching the functions the loop calls
(``speculative.verify.acceptance_probability`` / ``residual_distribution`` and the loop's
``verify_step``); they and the harness live in tests/support/statistical.py, which the drafters'
and the trees' chi-square proofs share. Bugs that must be rejected:

* ``inverted-ratio``: accept with min(1, q/p) instead of min(1, p/q);
* ``residual-from-p``: at a rejection, resample from p instead of norm(max(0, p - q));
* ``bonus-from-draft``: when all are accepted, the extra token comes from the draft, not p_{gamma+1};
* ``temperature-on-p-only``: tokens drafted from the tempered q, but judged with the untempered q;
* ``q-of-next-position``: p_i compared with q_{i+1} (an off-by-one between the two models).

Look-alikes that are NOT bugs and must pass:

* ``ratio-without-min``: r < p/q instead of r < min(1, p/q) -- the same event for r in [0, 1);
* ``no-bonus-token``: dropping the bonus token only wastes a target call;
* ``gamma-auto``: gamma changing between iterations with the measured alpha and c;
* ``guard-recorded``: generate.py's guard (recorded costs): drafting turned off and on again by the
  tokens the iterations emitted.
"""

from __future__ import annotations

import copy

import pytest
import torch

from speculative import autoregressive_generate, speculative_generate
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
from tests.support.toy_models import (
    NGramModel,
    chi_square_pvalue,
    llama_next_logits,
    random_llama,
    ref_warp,
    reference_greedy,
)

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- toy models
TOY_SAMPLING = Sampling(temperature=0.5)
TOY_RUNS = 2000


@pytest.fixture(scope="module")
def toy() -> dict:
    """Bigram target and draft over 3 tokens. The seeds were picked (among the first dozen)
    so that every bug above moves the distribution far: with 800 runs each already gives
    p < 1e-16. With random tables some bugs can be nearly invisible, e.g. q_{i+1} = q_i
    whenever the drafted token equals the previous one."""
    target = NGramModel.random(3, 2, seed=10, scale=1.0)
    draft = NGramModel.random(3, 2, seed=1010, scale=1.0)
    s = TOY_SAMPLING

    def next_probs(ctx: tuple[int, ...]) -> list[float]:
        return ref_warp(target.next_logits(ctx).tolist(), s.temperature, s.top_k, s.top_p)

    setting = Setting(s, lambda drafted: warp(draft.table[int(drafted[-1])], s))
    return {"target": target, "draft": draft, "next_probs": next_probs, "setting": setting}


@proof(
    "the engine's sampled tokens follow the target's law (toy models, gamma 2 and auto)",
    "chi-square, p > 1e-3, 2000 seeded runs, 27 cells",
    rejects=(
        "ratio inverted",
        "residual from p",
        "bonus from the draft",
        "temperature on p only (transformers #47932)",
        "q of the next position",
    ),
)
@pytest.mark.parametrize("variant", list(NOT_BUGS) + list(BUGS))
def test_toy_first_tokens_have_the_target_distribution(
    toy: dict, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gamma 2, the first 3 tokens jointly (27 cells); gamma-auto and guard-recorded: tokens 6..8 of 8 (a
    speculating iteration costs 2.2 plain steps there: on or off by the tokens each run's iterations emitted)."""
    patch = BUGS.get(variant) or NOT_BUGS[variant]
    if patch is not None:
        patch(monkeypatch, toy["setting"])
    gamma, max_new, skip = {"gamma-auto": ("auto", 8, 5), "guard-recorded": (2, 8, 5)}.get(
        variant, (2, 3, 0)
    )
    guard = (1.0, 2.2) if variant == "guard-recorded" else False
    s = TOY_SAMPLING

    def generate(seed: int) -> list[int]:
        return speculative_generate(
            toy["target"],
            toy["draft"],
            [0],
            max_new,
            gamma=gamma,
            guard=guard,
            verify="token",  # the mutants are of the token-wise rule
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=seed,
        ).tokens

    counts = sample_counts(generate, TOY_RUNS, skip, 3)
    p_value = chi_square_pvalue(counts, window_distribution(toy["next_probs"], [0], skip, 3))
    if variant in BUGS:
        assert p_value < P_VALUE, f"the test did not catch {variant} (p = {p_value:.3g})"
    else:
        assert p_value > P_VALUE, f"{variant} rejected (p = {p_value:.3g})"


@proof(
    "the baseline (the target alone) follows the target's law",
    "chi-square, p > 1e-3, 2000 seeded runs",
)
def test_toy_baseline_has_the_target_distribution(toy: dict) -> None:
    s = TOY_SAMPLING
    counts = sample_counts(
        lambda seed: (
            autoregressive_generate(
                toy["target"], [0], 3, temperature=s.temperature, seed=seed
            ).tokens
        ),
        TOY_RUNS,
        0,
        3,
    )
    assert chi_square_pvalue(counts, window_distribution(toy["next_probs"], [0], 0, 3)) > P_VALUE


# ----------------------------------------------------------------------------- LLaMA
LLAMA_RUNS = 1000
LLAMA_CASES = [
    ("correct", Sampling()),
    ("correct", Sampling(temperature=0.8, top_k=5, top_p=0.9)),
    ("correct", Sampling(temperature=0.6)),
    ("draft-is-target-copy", Sampling()),
    ("inverted-ratio", Sampling()),
    ("residual-from-p", Sampling()),
    ("q-of-next-position", Sampling()),
    ("temperature-on-p-only", Sampling(temperature=0.6)),
]


@pytest.fixture(scope="module")
def llama() -> dict:
    """A model.Llama target and a smaller random draft over 8 tokens (float32)."""
    target = random_llama(
        vocab=8, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32, seed=0
    )
    draft = random_llama(vocab=8, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=16, seed=1)
    return {
        "target": target,
        "draft": draft,
        "copy": copy.deepcopy(target),
        "logits": llama_next_logits(target),
    }


@proof(
    "the engine's sampled tokens follow the target's law on a LLaMA (temperature, top-k, top-p)",
    "chi-square, p > 1e-3, 1000 seeded runs, 64 cells",
    rejects=("the same bugs as the toy test",),
)
@pytest.mark.parametrize("variant, sampling", LLAMA_CASES, ids=[f"{v}-{s}" for v, s in LLAMA_CASES])
def test_llama_first_tokens_have_the_target_distribution(
    llama: dict, variant: str, sampling: Sampling, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gamma 2, the first 2 tokens jointly (64 cells)."""
    if variant in BUGS:
        BUGS[variant](monkeypatch, Setting(sampling, draft_after=lambda drafted: None))
    draft = llama["copy"] if variant == "draft-is-target-copy" else llama["draft"]
    drafted = accepted = 0

    def generate(seed: int) -> list[int]:
        nonlocal drafted, accepted
        out = speculative_generate(
            llama["target"],
            draft,
            [1, 5],
            3,
            gamma=2,
            verify="token",  # the mutants are of the token-wise rule
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=seed,
        )
        drafted += out.stats.drafted_tokens
        accepted += out.stats.accepted_draft_tokens
        return out.tokens

    counts = sample_counts(generate, LLAMA_RUNS, 0, 2)

    def next_probs(ctx: tuple[int, ...]) -> list[float]:
        return ref_warp(
            llama["logits"](ctx).tolist(), sampling.temperature, sampling.top_k, sampling.top_p
        )

    p_value = chi_square_pvalue(counts, window_distribution(next_probs, [1, 5], 0, 2))
    if variant in BUGS:
        assert p_value < P_VALUE, f"the test did not catch {variant} (p = {p_value:.3g})"
    else:
        assert p_value > P_VALUE, f"{variant} rejected (p = {p_value:.3g})"
    # float32: verify and draft round differently, ratios ~ 1 +- 1e-6
    if variant == "draft-is-target-copy":
        assert accepted >= 0.999 * drafted


# ----------------------------------------------------------------------------- draft = target
def test_draft_equal_to_target_accepts_everything_float64() -> None:
    target = random_llama(
        vocab=16,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        max_seq_len=64,
        seed=7,
        dtype=torch.float64,
    )
    twin = copy.deepcopy(target)
    for seed in range(10):
        out = speculative_generate(target, twin, [1, 2, 3], 24, gamma=3, temperature=1.0, seed=seed)
        assert out.stats.accepted_draft_tokens == out.stats.drafted_tokens > 0
        assert out.stats.acceptance_rate == pytest.approx(1.0, abs=1e-9)
        # gamma + 1 per call, but for the shrunk last ones
        assert out.stats.tokens_per_target_call > 3
    greedy = speculative_generate(target, twin, [1, 2, 3], 24, gamma=3, temperature=0)
    assert greedy.tokens == reference_greedy(target, [1, 2, 3], 24)


@proof("a draft equal to the target accepts every token", "exact counts")
def test_draft_equal_to_target_toy_is_exact() -> None:
    target = NGramModel.random(4, 3, seed=3)
    twin = NGramModel(target.table.clone())
    for seed in range(20):
        out = speculative_generate(target, twin, [0], 12, gamma=4, seed=seed)
        assert out.stats.accepted_draft_tokens == out.stats.drafted_tokens
        assert out.stats.acceptance_rate == pytest.approx(1.0, abs=1e-12)
        assert out.stats.target_calls == 3  # 5 + 5 + 2 tokens
