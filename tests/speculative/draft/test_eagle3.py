"""The EAGLE-3 drafter (speculative/draft/eagle.py around model/eagle3_head.py) and its training
(speculative/draft/ttt.py): the engine with a head whose draft vocabulary is reduced follows the
target's law, its greedy output (chains and trees) is the target's, the features it keeps are
the target's fused features of the accepted path, q is the warped distribution of the mapped
logits and zero off the draft vocabulary, and training-time test computes what the cached
drafter computes at each draft depth.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model import call as calls
from model.eagle3_head import default_layers
from speculative import FeatureDrafter, speculative_generate, speculative_generate_batch
from speculative.draft.ttt import draft_vocabulary, ttt_losses
from speculative.engine import Engine
from speculative.proofs.checker import check
from speculative.sampling import Sampling
from tests.support.proofs import proof
from tests.support.statistical import BUGS, P_VALUE, Setting, sample_counts, window_distribution
from tests.support.toy_models import (
    chi_square_pvalue,
    llama_next_logits,
    random_eagle3_head,
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
        "head": random_eagle3_head(target, drop=(1, 6)),
        "logits": llama_next_logits(target),
    }


@proof(
    "the engine with an EAGLE-3 head (reduced draft vocabulary) follows the target's law",
    "chi-square, p > 1e-3, 1000 seeded runs",
    rejects=("inverted ratio", "q of the next position"),
)
@pytest.mark.parametrize("variant, sampling", CASES, ids=[f"{v}-{s}" for v, s in CASES])
def test_eagle3_first_tokens_have_the_target_distribution(
    small: dict, variant: str, sampling: Sampling, monkeypatch: pytest.MonkeyPatch
) -> None:
    if variant in BUGS:
        BUGS[variant](monkeypatch, Setting(sampling, draft_after=lambda drafted: None))
    target = small["target"]
    drafter = FeatureDrafter(small["head"], target)

    def generate(seed: int) -> list[int]:
        return speculative_generate(
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


class UnmappedQ(FeatureDrafter):
    """A broken EAGLE-3 drafter: it draws the token from the mapped distribution, but hands the
    verifier q laid out by draft id (the map forgotten on the way out)."""

    def propose(self, *args, **kwargs):
        draft = super().propose(*args, **kwargs)
        if draft.q is not None:
            small = draft.q[..., self.ids]
            draft.q = torch.zeros_like(draft.q)
            draft.q[..., : small.shape[-1]] = small
        return draft


@proof(
    "an EAGLE-3 drafter must hand over q after the id mapping: the checker rejects one that does not",
    "exact law through the engine, float64, to 1e-9",
    rejects=("q laid out by draft id",),
)
def test_the_checker_passes_the_eagle3_drafter_and_rejects_an_unmapped_q() -> None:
    good = check(
        lambda target: FeatureDrafter(random_eagle3_head(target), target),
        quick=True,
        properties=["exact"],
    )
    bad = check(
        lambda target: UnmappedQ(random_eagle3_head(target), target),
        quick=True,
        properties=["exact"],
    )
    assert good.results[0].status == "PASS", good.results[0].line()
    assert bad.results[0].status == "FAIL", bad.results[0].line()


@pytest.fixture(scope="module")
def llama64() -> dict:
    target = random_llama(
        vocab=16,
        dim=32,
        n_layers=5,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        max_seq_len=64,
        seed=3,
        dtype=torch.float64,
    )
    return {"target": target, "head": random_eagle3_head(target, std=0.2, drop=(3, 9, 15))}


@proof(
    "the EAGLE-3 drafter's greedy output is the target's, in chains and in trees", "exact identity"
)
@settings(max_examples=20, derandomize=True, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 15), min_size=1, max_size=8),
    gamma=st.integers(1, 6),
    tree=st.sampled_from([None, (2, 2), (3, 1, 1)]),
)
def test_eagle3_greedy_output_is_the_target_greedy_output(
    llama64: dict, prompt: list[int], gamma: int, tree: tuple | None
) -> None:
    target = llama64["target"]
    shape = {"gamma": gamma} if tree is None else {"tree": tree}  # a tree's depth is its gamma
    out = speculative_generate(
        target, FeatureDrafter(llama64["head"], target), prompt, 16, temperature=0, **shape
    )
    assert out.tokens == reference_greedy(target, prompt, 16)


def layer_inputs(target: torch.nn.Module, layers: tuple[int, ...], ids: list[int]) -> torch.Tensor:
    """The inputs of the target's ``layers`` at every position of ``ids``, concatenated (fc's input), from a
    no-cache forward with the layers read by hooks, not by return_hidden."""
    inputs = {}
    hooks = [
        target.layers[i].register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        for i in set(layers)
    ]
    with torch.no_grad():
        target(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.cat([inputs[i] for i in layers], dim=-1)


@proof(
    "the EAGLE-3 drafter keeps the target's fused features of the accepted path only",
    "exact, to 1e-9",
)
def test_eagle3_keeps_the_fused_features_of_the_accepted_path(llama64: dict) -> None:
    """After every iteration the features it holds for positions 0..L-2 are fc of the target's
    own layer inputs (a no-cache forward over the final sequence, the layers read by hooks,
    not by return_hidden)."""
    target, head = (
        llama64["target"],
        random_eagle3_head(llama64["target"], std=0.2, drop=(3, 9, 15)),
    )
    drafter = FeatureDrafter(head, target)
    snapshots = []
    out = speculative_generate(
        target,
        drafter,
        [3, 1, 4],
        30,
        gamma=3,
        temperature=1.0,
        seed=2,
        callback=lambda ids, flags: snapshots.append(
            drafter.features[0, : drafter.known[0]].clone()
        ),
    )
    assert 0 < out.stats.accepted_draft_tokens < out.stats.drafted_tokens
    sequence = [3, 1, 4] + out.tokens
    with torch.no_grad():
        fused = head.fc(layer_inputs(target, head.target_layers, sequence))
    for kept in snapshots:
        torch.testing.assert_close(kept, fused[0, : kept.shape[0]], rtol=1e-9, atol=1e-9)
    assert snapshots[-1].shape[0] == len(sequence) - 1


def test_plain_steps_project_nothing_until_the_head_drafts_again(
    llama64: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a guard keeps the head off, its commits keep the target's fused features as they come: fc runs
    once, when the head drafts again, over the prompt's and every plain step's positions in one product, and
    the table then holds fc of the target's own layer inputs, as the test above computes them."""
    target, head = (
        llama64["target"],
        random_eagle3_head(llama64["target"], std=0.2, drop=(3, 9, 15)),
    )
    drafter, widths, real = FeatureDrafter(head, target), [], head.project
    monkeypatch.setattr(head, "project", lambda fused: widths.append(fused.shape[1]) or real(fused))
    engine = Engine(target, drafter, gamma=3, temperature=0.0, max_rows=1, cache_len=64, guard=True)
    # off, then on
    engine.gamma_policy.switch.choose, engine.gamma_policy.switch.observe = (
        (lambda i: 0 if i < 8 else 3),
        (lambda *args: None),
    )
    row = engine.add([3, 1, 4], 16)
    for _ in range(8):  # the prompt's call and seven plain steps
        engine.step()
    assert widths == [] and row.stats.gamma_history == [0] * 8
    engine.step()  # drafting again: the prompt's 3 positions and the plain steps' 7, in one product
    assert widths[0] == 10 and row.stats.gamma_history[-1] == 3
    kept = drafter.features[0, : drafter.known[0]].clone()
    engine.run()
    with torch.no_grad():
        fused = real(layer_inputs(target, head.target_layers, row.ids))
    assert kept.shape[0] > 10
    torch.testing.assert_close(kept, fused[0, : kept.shape[0]], rtol=1e-9, atol=1e-9)
    assert row.result().tokens == reference_greedy(target, [3, 1, 4], 16)


def test_q_is_the_warp_of_the_mapped_logits_and_zero_off_the_draft_vocabulary(
    llama64: dict,
) -> None:
    target, head = llama64["target"], llama64["head"]
    drafter, seen = FeatureDrafter(head, target), []
    real = head.draft_logits
    # the head's own ids' logits
    head.draft_logits = lambda hidden: seen.append(real(hidden)) or seen[-1]
    target.setup_cache(1, 32)
    prompt = [1, 2, 3, 4]
    _, hidden = target(
        torch.tensor([prompt]), calls.chain(0, 4, "cpu"), return_hidden=head.target_layers
    )
    drafter.start(1, 32, target)
    drafter.keep_rows([], 1)
    drafter.commit([4], hidden, [0])
    sampling = Sampling(temperature=0.7, top_k=6, top_p=0.95)
    draft = drafter.propose(
        [prompt], [3], [sampling], [torch.Generator().manual_seed(0)], torch.device("cpu")
    )
    del head.draft_logits
    assert len(seen) == 3
    for i in range(3):
        logits = torch.full((16,), float("-inf"), dtype=torch.float64)  # placed at their target ids
        logits[head.target_ids()] = seen[i][0]
        expected = torch.tensor(ref_warp(logits.tolist(), 0.7, 6, 0.95), dtype=torch.float64)
        torch.testing.assert_close(draft.q[0, i], expected, rtol=0, atol=1e-12)
        assert draft.q[0, i, [3, 9, 15]].abs().max() == 0
        assert int(draft.tokens[0, i]) not in (3, 9, 15)


def test_return_hidden_with_layer_ids_is_those_layers_inputs() -> None:
    model = random_llama(
        vocab=16, dim=32, n_layers=5, n_heads=4, n_kv_heads=2, hidden_dim=64, dtype=torch.float64
    )
    tokens = torch.tensor([[1, 5, 2, 7, 3]])
    inputs = {}
    for i in range(5):
        model.layers[i].register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
    with torch.no_grad():
        logits, fused = model(tokens, return_hidden=(4, 0, 2))
        torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)
        torch.testing.assert_close(
            fused, torch.cat([inputs[4], inputs[0], inputs[2]], dim=-1), rtol=0, atol=0
        )
        model.setup_cache(1, 8)
        _, first = model(tokens[:, :3], calls.chain(0, 3, "cpu"), return_hidden=(4, 0, 2))
        _, second = model(tokens[:, 3:], calls.chain(3, 2, "cpu"), return_hidden=(4, 0, 2))
    torch.testing.assert_close(torch.cat([first, second], dim=1), fused, rtol=1e-12, atol=1e-12)
    assert default_layers(32) == (2, 16, 29) and default_layers(8) == (2, 4, 5)


def test_training_time_test_computes_what_the_cached_drafter_computes(llama64: dict) -> None:
    """Step k of ttt_losses at column t is the head's output at draft depth k + 1 after the true
    inputs up to t, computed here by the cached head one call at a time, as the drafter does."""
    target, head = (
        llama64["target"],
        random_eagle3_head(llama64["target"], std=0.2, drop=(3, 9, 15)),
    )
    tokens = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(1))
    outputs = []
    real = head.draft_logits
    head.draft_logits = lambda h: outputs.append(h) or real(h)
    loss, per_step = ttt_losses(head, target, tokens, 4)
    head.draft_logits = real
    assert (
        loss.requires_grad
        and len(per_step["alpha"]) == 4
        and all(0 <= a <= 1 for a in per_step["alpha"])
    )
    with torch.no_grad():
        _, fused = target(tokens, return_hidden=head.target_layers)
        features, embeddings = head.project(fused[:, :-1]), target.embed_tokens(tokens)
        for row in range(2):
            for t in range(5):
                head.setup_cache(1, 32)
                out = head(
                    features[row : row + 1, : t + 1],
                    embeddings[row : row + 1, 1 : t + 2],
                    calls.chain(0, t + 1, "cpu"),
                )[:, -1:]
                torch.testing.assert_close(out[0, 0], outputs[0][row, t], rtol=1e-9, atol=1e-9)
                for k in range(1, 4):
                    out = head(
                        out,
                        embeddings[row : row + 1, t + k + 1 : t + k + 2],
                        calls.chain(t + k, 1, "cpu"),
                    )
                    torch.testing.assert_close(out[0, 0], outputs[k][row, t], rtol=1e-9, atol=1e-9)


def test_the_draft_vocabulary_is_the_most_frequent_ids() -> None:
    tokens = torch.tensor([[5, 5, 5, 2, 2, 7, 9, 9, 9, 9, 1]])
    kept, coverage = draft_vocabulary(tokens, 12, 3)
    assert kept.tolist() == [2, 5, 9] and coverage == pytest.approx(9 / 11)
    kept, _ = draft_vocabulary(torch.tensor([[4, 3]]), 6, 1)  # a tie: the lower id
    assert kept.tolist() == [3]


def test_eagle3_rows_of_a_batch_each_get_the_target_greedy_output(llama64: dict) -> None:
    """Rows of different lengths, in one call per iteration: each row's tokens are its own greedy ones."""
    target = llama64["target"]
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    batch = speculative_generate_batch(
        target, FeatureDrafter(llama64["head"], target), prompts, 12, gamma=3, temperature=0
    )
    assert [r.tokens for r in batch.results] == [reference_greedy(target, p, 12) for p in prompts]
    assert batch.stats.accepted_draft_tokens > 0
