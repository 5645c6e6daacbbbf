"""The feature drafter (speculative/draft/eagle.py): the engine with a feature head follows the
target's law (chi-square, with the variants of tests/support/statistical.py), every drafter's
greedy output is the target's, and its bookkeeping: the features it keeps are the target's own,
position by position, and it refuses to run without them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.call import chain
from speculative import FeatureDrafter, PromptLookupDrafter, speculative_generate
from speculative.sampling import Sampling
from tests.support.proofs import proof
from tests.support.statistical import BUGS, P_VALUE, Setting, sample_counts, window_distribution
from tests.support.toy_models import (
    chi_square_pvalue,
    llama_next_logits,
    random_head,
    random_llama,
    ref_warp,
    reference_greedy,
)

# ----------------------------------------------------------------------------- feature drafter
FEATURE_RUNS = 1000
FEATURE_CASES = [
    ("correct", Sampling()),
    ("correct", Sampling(temperature=0.8, top_k=5, top_p=0.9)),
    ("inverted-ratio", Sampling()),
    ("residual-from-p", Sampling()),
    ("q-of-next-position", Sampling()),
    ("temperature-on-p-only", Sampling(temperature=0.4)),
]


@pytest.fixture(scope="module")
def feature_pair() -> dict:
    target = random_llama(
        vocab=8, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32, seed=0
    )
    return {"target": target, "head": random_head(target), "logits": llama_next_logits(target)}


@proof(
    "the engine with the feature head follows the target's law",
    "chi-square, p > 1e-3, 1000 seeded runs",
    rejects=("the same bugs as the draft model",),
)
@pytest.mark.parametrize(
    "variant, sampling", FEATURE_CASES, ids=[f"{v}-{s}" for v, s in FEATURE_CASES]
)
def test_feature_drafter_first_tokens_have_the_target_distribution(
    feature_pair: dict, variant: str, sampling: Sampling, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gamma 2, tokens 2 and 3 jointly (64 cells): the first iteration reads the prompt and
    drafts nothing, so the drafted tokens (and the bugs) start at token 2."""
    if variant in BUGS:
        BUGS[variant](monkeypatch, Setting(sampling, draft_after=lambda drafted: None))
    target = feature_pair["target"]
    drafter = FeatureDrafter(feature_pair["head"], target)
    drafted = 0

    def generate(seed: int) -> list[int]:
        nonlocal drafted
        out = speculative_generate(
            target,
            drafter,
            [1, 5],
            4,
            gamma=2,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=seed,
            verify="token",  # the bugs catalogued are of the token-wise rule
        )
        drafted += out.stats.drafted_tokens
        return out.tokens

    counts = sample_counts(generate, FEATURE_RUNS, 1, 2)

    def next_probs(ctx: tuple[int, ...]) -> list[float]:
        return ref_warp(
            feature_pair["logits"](ctx).tolist(),
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
        )

    p_value = chi_square_pvalue(counts, window_distribution(next_probs, [1, 5], 1, 2))
    assert drafted >= FEATURE_RUNS  # the drafter did draft
    if variant in BUGS:
        assert p_value < P_VALUE, f"the test did not catch {variant} (p = {p_value:.3g})"
    else:
        assert p_value > P_VALUE, f"{variant} rejected (p = {p_value:.3g})"


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
    return {"target": target, "head": random_head(target, std=0.2)}


@proof("every drafter's greedy output is the target's", "exact identity")
@settings(max_examples=25, derandomize=True, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 15), min_size=1, max_size=8),
    gamma=st.integers(1, 6),
    kind=st.sampled_from(["lookup", "feature"]),
)
def test_greedy_output_of_every_drafter_is_the_target_greedy_output(
    llama64: dict, prompt: list[int], gamma: int, kind: str
) -> None:
    target = llama64["target"]
    drafter = PromptLookupDrafter() if kind == "lookup" else FeatureDrafter(llama64["head"], target)
    out = speculative_generate(target, drafter, prompt, 16, gamma=gamma, temperature=0)
    assert out.tokens == reference_greedy(target, prompt, 16)


@proof(
    "the feature drafter keeps the target's features of the accepted path only", "exact, to 1e-9"
)
def test_feature_drafter_keeps_the_target_features_of_the_accepted_path(llama64: dict) -> None:
    """After every iteration the features it holds for positions 0..L-2 are the target's own
    (a no-cache forward over the final sequence), and the head read every position once
    with a true feature: a drafter that kept the features of rejected tokens, or that did
    not re-read positions it had drafted from predicted features, fails here."""
    target = llama64["target"]
    head = copy.deepcopy(llama64["head"])
    drafter = FeatureDrafter(head, target)
    calls: list[tuple[int, int]] = []
    real_forward = head.forward

    def recording(features, embeddings, call=None):
        calls.append((None if call is None else int(call.slots[0, 0]), features.shape[1]))
        return real_forward(features, embeddings, call)

    head.forward = recording
    snapshots = []

    def known(drafter: FeatureDrafter) -> torch.Tensor:  # the features it holds for its row
        return drafter.features[0, : drafter.known[0]].clone()

    out = speculative_generate(
        target,
        drafter,
        [3, 1, 4],
        30,
        gamma=3,
        temperature=1.0,
        seed=2,
        callback=lambda ids, flags: snapshots.append(known(drafter)),
    )
    # accepted and rejected both happened
    assert 0 < out.stats.accepted_draft_tokens < out.stats.drafted_tokens
    sequence = [3, 1, 4] + out.tokens
    with torch.no_grad():
        _, hidden = target(torch.tensor([sequence]), return_hidden=True)
    for kept in snapshots:
        torch.testing.assert_close(kept, hidden[0, : kept.shape[0]], rtol=1e-9, atol=1e-9)
    assert snapshots[-1].shape[0] == len(sequence) - 1
    # Catch-up calls (the first of each iteration) start where the true inputs end.
    firsts = [start for start, width in calls if width > 1 or start == 0]
    assert firsts == sorted(firsts)


def test_feature_drafter_needs_the_target_features() -> None:
    target = random_llama(vocab=8)
    drafter = FeatureDrafter(random_head(target), target)
    drafter.start(1, 8, target)
    with pytest.raises(ValueError, match="hidden states"):
        drafter.commit([3], None, [0])
    with pytest.raises(ValueError, match="another target"):
        drafter.start(1, 8, random_llama(vocab=8))


def test_return_hidden_is_what_the_output_head_reads() -> None:
    model = random_llama(
        vocab=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, dtype=torch.float64
    )
    tokens = torch.tensor([[1, 5, 2, 7, 3]])
    with torch.no_grad():
        logits, hidden = model(tokens, return_hidden=True)
        torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)
        torch.testing.assert_close(model.lm_head(hidden), logits, rtol=0, atol=0)
        model.setup_cache(1, 8)
        first, h1 = model(tokens[:, :3], chain(0, 3, "cpu"), return_hidden=True)
        second, h2 = model(tokens[:, 3:], chain(3, 2, "cpu"), return_hidden=True)
    torch.testing.assert_close(torch.cat([h1, h2], dim=1), hidden, rtol=1e-12, atol=1e-12)


def test_seeded_runs_of_lookup_and_feature_drafters_repeat() -> None:
    target = random_llama(vocab=8, max_seq_len=40)
    for drafter in (PromptLookupDrafter(), FeatureDrafter(random_head(target), target)):
        runs = [
            speculative_generate(target, drafter, [1, 2, 1, 2], 20, gamma=3, seed=9).tokens
            for _ in range(2)
        ]
        assert runs[0] == runs[1]
        other = speculative_generate(target, drafter, [1, 2, 1, 2], 20, gamma=3, seed=10).tokens
        assert other != runs[0]
