"""The parallel drafters (speculative/draft/parallel.py: a draft model with mask tokens, PARD;
an EAGLE-3 head with mask positions, P-EAGLE) and their training layouts
(speculative/draft/parallel_training.py): the engine with one draft call per iteration follows
the target's law, its greedy output (chains, trees, rows of a batch) is the target's, q_i is
the warped distribution of the call's i-th position, the conditional-drop layout computes
what the cached drafter computes at every anchor and depth, and gamma="auto" weighs a
parallel draft's one call and its falling acceptance.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model import call as calls
from speculative import speculative_generate, speculative_generate_batch
from speculative.draft.parallel import ParallelDrafter, ParallelFeatureDrafter
from speculative.draft.parallel_training import (
    cod_layout,
    layout_mask,
    masked_forward,
    parallel_losses,
    peagle_losses,
)
from speculative.engine.gamma import AutoGamma
from speculative.proofs.cases import parallel_drafter, peagle_drafter
from speculative.proofs.checker import check
from speculative.proofs.toys import parallel_copy, random_peagle_head
from speculative.sampling import Sampling
from tests.support.proofs import proof
from tests.support.statistical import BUGS, P_VALUE, Setting, sample_counts, window_distribution
from tests.support.toy_models import (
    chi_square_pvalue,
    llama_next_logits,
    random_llama,
    ref_warp,
    reference_greedy,
)

RUNS = 1000
CASES = [
    ("correct", Sampling()),
    ("correct", Sampling(temperature=0.8, top_k=5, top_p=0.9)),
    ("inverted-ratio", Sampling()),
    ("q-of-next-position", Sampling()),
]


@pytest.fixture(scope="module")
def small() -> dict:
    target = random_llama(
        vocab=8, dim=16, n_layers=4, n_heads=2, n_kv_heads=1, hidden_dim=32, seed=0
    )
    return {
        "target": target,
        "model": parallel_drafter(target),
        "head": peagle_drafter(target),
        "logits": llama_next_logits(target),
    }


@proof(
    "the engine with a parallel drafter (one call: mask tokens, or a P-EAGLE head's mask positions) follows "
    "the target's law",
    "chi-square, p > 1e-3, 1000 seeded runs",
    rejects=("inverted ratio", "q of the next position"),
)
@pytest.mark.parametrize("kind", ["model", "head"])
@pytest.mark.parametrize("variant, sampling", CASES, ids=[f"{v}-{s}" for v, s in CASES])
def test_parallel_first_tokens_have_the_target_distribution(
    small: dict, kind: str, variant: str, sampling: Sampling, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_law(small, kind, variant, sampling, monkeypatch, "token")


@proof(
    "block verification of a parallel draft follows the target's law",
    "chi-square, p > 1e-3, 1000 seeded runs",
)
@pytest.mark.parametrize("kind", ["model", "head"])
def test_parallel_drafts_verified_as_a_block_have_the_target_distribution(
    small: dict, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_law(small, kind, "correct", Sampling(temperature=0.9), monkeypatch, "block")


def check_law(
    small: dict,
    kind: str,
    variant: str,
    sampling: Sampling,
    monkeypatch: pytest.MonkeyPatch,
    verify: str,
) -> None:
    if variant in BUGS:
        BUGS[variant](monkeypatch, Setting(sampling, draft_after=lambda drafted: None))
    target, drafter = small["target"], small[kind]

    def generate(seed: int) -> list[int]:
        return speculative_generate(
            target,
            drafter,
            [1, 5],
            4,
            gamma=3,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=seed,
            verify=verify,
        ).tokens

    counts = sample_counts(generate, RUNS, 1, 2)

    def next_probs(ctx: tuple[int, ...]) -> list[float]:
        return ref_warp(
            small["logits"](ctx).tolist(), sampling.temperature, sampling.top_k, sampling.top_p
        )

    p_value = chi_square_pvalue(counts, window_distribution(next_probs, [1, 5], 1, 2))
    if variant in BUGS:
        assert p_value < P_VALUE, f"the test did not catch {variant} (p = {p_value:.3g})"
    else:
        assert p_value > P_VALUE, f"{variant} rejected (p = {p_value:.3g})"


def first_q(draft):
    """The bug: x_i drawn from q_i, but the verifier handed q_1 at every position (as if every
    position shared the distribution of the first)."""
    if draft.q is not None:
        draft.q = draft.q[:, :1].expand_as(draft.q).clone()
    return draft


class FirstQ(ParallelDrafter):
    def propose(self, *args, **kwargs):
        return first_q(super().propose(*args, **kwargs))


class HeadFirstQ(ParallelFeatureDrafter):
    def propose(self, *args, **kwargs):
        return first_q(super().propose(*args, **kwargs))


@proof(
    "a parallel drafter must hand over the q each token was drawn from: the checker rejects q_1 everywhere",
    "exact law through the engine, float64, to 1e-9",
    rejects=("q_1 at every position",),
)
def test_the_checker_passes_the_parallel_drafters_and_rejects_a_shared_q() -> None:
    def broken(target):
        real = parallel_drafter(target)
        return FirstQ(real.model, real.mask_id, real.vocab_size)

    def broken_head(target):
        return HeadFirstQ(peagle_drafter(target).head, target)

    for good, bad in ((parallel_drafter, broken), (peagle_drafter, broken_head)):
        passed = check(good, quick=True, properties=["exact"])
        failed = check(bad, quick=True, properties=["exact"])
        assert passed.results[0].status == "PASS", passed.results[0].line()
        assert failed.results[0].status == "FAIL", failed.results[0].line()


@pytest.fixture(scope="module")
def llama64() -> dict:
    target = random_llama(
        vocab=16,
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        max_seq_len=64,
        seed=3,
        dtype=torch.float64,
    )
    close = parallel_copy(target, std=0.05, seed=7)  # often right at the first position
    return {
        "target": target,
        "drafter": parallel_drafter(target),
        "close": ParallelDrafter(close, close.config.extra["pard_token"], 16),
        "head": random_peagle_head(target, std=0.2, drop=(3, 9, 15)),
    }


@proof(
    "the parallel drafter's greedy output is the target's, in chains and in trees", "exact identity"
)
@settings(max_examples=20, derandomize=True, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 15), min_size=1, max_size=8),
    gamma=st.integers(1, 8),
    tree=st.sampled_from([None, (2, 2), (3, 1, 1)]),
)
def test_parallel_greedy_output_is_the_target_greedy_output(
    llama64: dict, prompt: list[int], gamma: int, tree: tuple | None
) -> None:
    target = llama64["target"]
    shape = {"gamma": gamma} if tree is None else {"tree": tree}
    for drafter in (llama64["close"], ParallelFeatureDrafter(llama64["head"], target)):
        out = speculative_generate(target, drafter, prompt, 16, temperature=0, **shape)
        assert out.tokens == reference_greedy(target, prompt, 16)
        # one call per iteration
        assert out.stats.draft_calls == sum(1 for g in out.stats.gamma_history if g)


def test_parallel_rows_of_a_batch_each_get_the_target_greedy_output(llama64: dict) -> None:
    target = llama64["target"]
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    for drafter in (llama64["close"], ParallelFeatureDrafter(llama64["head"], target)):
        batch = speculative_generate_batch(target, drafter, prompts, 12, gamma=4, temperature=0)
        assert [r.tokens for r in batch.results] == [
            reference_greedy(target, p, 12) for p in prompts
        ]
    # one call per iteration (none in the first)
    assert batch.stats.draft_calls < batch.stats.iterations


def test_q_i_is_the_warp_of_the_call_s_i_th_position_and_the_mask_is_never_drafted(
    llama64: dict,
) -> None:
    """q_i against a no-cache forward over the prompt and i - 1 masks (the mask id in the
    target's range too: it must get probability 0)."""
    drafter = llama64["drafter"]
    # a mask inside the target's ids
    inside = ParallelDrafter(drafter.model, mask_id=7, vocab_size=16)
    prompt = [1, 2, 3, 4]
    sampling = Sampling(temperature=0.7, top_k=6, top_p=0.95)
    for d, mask in ((drafter, 16), (inside, 7)):
        d.start(1, 32)
        d.keep_rows([], 1)
        draft = d.propose(
            [prompt], [4], [sampling], [torch.Generator().manual_seed(0)], torch.device("cpu")
        )
        assert draft.calls == 1 and draft.q.shape == (1, 4, 16)
        for i in range(4):
            with torch.no_grad():
                logits = d.model(torch.tensor([prompt + [mask] * i]))[0, -1, :16].clone()
            if mask < 16:
                logits[mask] = float("-inf")
            expected = torch.tensor(ref_warp(logits.tolist(), 0.7, 6, 0.95), dtype=torch.float64)
            torch.testing.assert_close(draft.q[0, i], expected, rtol=0, atol=1e-12)
            assert draft.q[0, i, mask : mask + 1].sum() == 0 if mask < 16 else True
            assert 0 <= int(draft.tokens[0, i]) < 16 and int(draft.tokens[0, i]) != mask


def test_the_training_layout_computes_what_the_cached_drafter_computes(llama64: dict) -> None:
    """Mask node (t, d) of the conditional-drop forward is the cached draft's output after x_0..x_t
    and d masks, one call as the drafter makes it; real positions are the plain causal forward."""
    draft = llama64["drafter"].model
    tokens = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(1))
    anchors, depth = cod_layout(12, 5, 0.8, 0.3, torch.Generator().manual_seed(0))
    positions, visible = layout_mask(12, anchors, depth)
    with torch.no_grad():
        out = masked_forward(
            draft, torch.cat([tokens, torch.full((2, len(anchors)), 16)], 1), positions, visible
        )
        torch.testing.assert_close(out[:, :12], draft(tokens), rtol=1e-9, atol=1e-9)
        for row in range(2):
            for i, (t, d) in enumerate(zip(anchors.tolist(), depth.tolist())):
                draft.setup_cache(1, 32)
                feed = torch.tensor([tokens[row, : t + 1].tolist() + [16] * d])
                logits = draft(feed, calls.chain(0, feed.shape[1], "cpu"))[0, -1]
                torch.testing.assert_close(logits, out[row, 12 + i], rtol=1e-9, atol=1e-9)


def test_conditional_drop_keeps_a_shrinking_nested_share_of_anchors() -> None:
    anchors, depth = cod_layout(41, 6, 0.5, 0.1, torch.Generator().manual_seed(2))
    by_depth = {d: set(anchors[depth == d].tolist()) for d in range(1, 6)}
    # 40 anchors: depth d keeps ceil(max(0.5^d, 0.1) * 40) = 20, 10, 5, 4, 4 of those that fit (t <= 39 - d)
    assert [len(by_depth[d]) for d in range(1, 6)] == [20, 10, 5, 4, 4]
    for d in range(2, 6):
        assert by_depth[d] <= by_depth[d - 1]
        assert max(by_depth[d]) <= 41 - 2 - d


def test_parallel_losses_per_position_and_gradients(llama64: dict) -> None:
    target, draft = llama64["target"], llama64["drafter"].model
    tokens = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(4))
    loss, per = parallel_losses(draft, target, tokens, 4, keep=1.0, min_keep=1.0)
    assert len(per["alpha"]) == len(per["loss"]) == 4 and all(0 <= a <= 1 for a in per["alpha"])
    loss.backward()
    assert draft.embed_tokens.weight.grad[16].abs().sum() > 0  # the mask's embedding learns
    draft.zero_grad()


def test_the_peagle_layout_computes_what_the_cached_head_computes(llama64: dict) -> None:
    """Real node t and mask node (t, d) of peagle_losses are the head's cached call over the true
    inputs up to t and d mask positions, as ParallelFeatureDrafter makes it (the mask id occurs in
    the text too, and reads the mask embedding there)."""
    target, head = (
        llama64["target"],
        random_peagle_head(llama64["target"], std=0.2, drop=(3, 9, 15)),
    )
    tokens = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(1))
    tokens[0, 5] = head.mask_token_id
    seen = []
    real = head.draft_logits
    head.draft_logits = lambda h: seen.append(h) or real(h)
    loss, per = peagle_losses(
        head, target, tokens, 4, keep=0.8, min_keep=0.3, gen=torch.Generator().manual_seed(0)
    )
    head.draft_logits = real
    anchors, depth = cod_layout(12, 4, 0.8, 0.3, torch.Generator().manual_seed(0))
    assert loss.requires_grad and len(per["alpha"]) == 4
    with torch.no_grad():
        _, fused = target(tokens, return_hidden=head.target_layers)
        features, embeddings = head.project(fused[:, :-1]), head.embed(tokens, target.embed_tokens)
        mask_feature, mask_embedding = head.mask_inputs()
        nodes = [(t, 0) for t in range(11)] + list(zip(anchors.tolist(), depth.tolist()))
        for row in range(2):
            for i, (t, d) in enumerate(nodes):
                head.setup_cache(1, 32)
                f = torch.cat([features[row, : t + 1], mask_feature.expand(d, -1)]).unsqueeze(0)
                e = torch.cat([embeddings[row, 1 : t + 2], mask_embedding.expand(d, -1)]).unsqueeze(
                    0
                )
                out = head(f, e, calls.chain(0, t + 1 + d, "cpu"))[0, -1]
                torch.testing.assert_close(out, seen[0][row, i], rtol=1e-9, atol=1e-9)


def test_auto_gamma_for_a_parallel_draft_weighs_its_falling_acceptance_and_the_target_s_width() -> (
    None
):
    """Hand-computed choices. Acceptance 0.9 at position 1 and 0.2 after it, one call of 0.1 and a
    target call of 1.0 at every width: tokens 1.9, 2.08, 2.116, ... per 1.1 -> gamma 8 gains
    little but something; at a target call growing 0.25 per token, gamma 1 (1.9 / 1.35 = 1.41)
    beats gamma 2 (2.08 / 1.6 = 1.30)."""
    auto = AutoGamma(gamma_max=8, parallel=True, fade=1.0)
    flat, growing = {w: 1.0 for w in range(2, 10)}, {w: 1.0 + 0.25 * (w - 2) for w in range(2, 10)}
    for widths, expected in ((flat, 8), (growing, 1)):
        auto.by_position = {
            1: [90 * 0.9 - 1, 88.0],
            **{i: [20 * 0.9 - 1, 88.0] for i in range(2, 9)},
        }
        auto.by_width, auto.draft_step_s, auto.target_call_s, auto.alpha = (
            dict(widths),
            0.1,
            1.0,
            0.5,
        )
        assert abs(auto.alpha_at(1) - 0.9) < 1e-9 and abs(auto.alpha_at(5) - 0.2) < 1e-9
        assert auto.best_parallel() == expected
    # Fed through update: positions 1 and 2 always accepted, 3 never (alpha_3 about 0.05 after 50);
    # a 4-token call 1.04 s, a 7-token one 1.30 s, so 3 tokens cost about 0.95 s on their line:
    # gamma 2 gives 2.86 tokens in 0.96 s (2.97 a second), gamma 3 only 0.04 more in 1.05 s (2.76).
    auto = AutoGamma(gamma_max=6, parallel=True)
    for width, seconds in ((4, 1.04), (7, 1.30)) * 25:
        auto.update([1.0, 1.0, 0.0], 0.01, seconds, positions=[1, 2, 3], width=width)
    assert abs(auto.target_at(3) - 0.9533) < 1e-3
    assert auto.gamma == 2
