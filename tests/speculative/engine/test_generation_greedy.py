"""Deterministic behaviour of the loop: greedy identity, stopping, rollback, stats, arguments.

Greedy (temperature 0): speculative output is the target's own greedy output, token for
token, in float64; in float32 it may differ only where the target's top two logits are
within 1e-4 (docs/algorithm.md, numerics policy). The references are plain no-cache
forwards of the target, not the code under test.
"""

from __future__ import annotations

import copy
import importlib
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.fast.setup import apply_setup
from speculative import PairMismatchError, autoregressive_generate, check_pair, speculative_generate
from tests.support.proofs import proof
from tests.support.toy_models import (
    FakeTokenizer,
    NGramModel,
    Recording,
    far_from_argmax,
    noisy_copy,
    random_llama,
    reference_greedy,
)

torch.set_num_threads(1)
verify_module = importlib.import_module("speculative.verify.token")
loop_module = importlib.import_module("speculative.engine.engine")


# ----------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def llama64() -> dict[str, torch.nn.Module]:
    target = random_llama(
        vocab=16,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        max_seq_len=64,
        seed=0,
        dtype=torch.float64,
    )
    return {
        "target": target,
        "independent": random_llama(
            vocab=16,
            dim=16,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            hidden_dim=32,
            max_seq_len=64,
            seed=1,
            dtype=torch.float64,
        ),
        "close": noisy_copy(target, std=0.02, seed=2),
    }


@pytest.fixture(scope="module")
def llama32() -> dict[str, torch.nn.Module]:
    target = random_llama(
        vocab=16,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        max_seq_len=64,
        seed=3,
        dtype=torch.float32,
    )
    return {
        "target": target,
        "close": noisy_copy(target, std=0.02, seed=4),
        "independent": random_llama(vocab=16, dim=16, max_seq_len=64, seed=5),
    }


def chain_table(vocab: int, step: int = 1, strength: float = 12.0) -> torch.Tensor:
    """Bigram logits: after token i, token (i + step) % vocab is almost certain."""
    table = torch.zeros(vocab, vocab, dtype=torch.float64)
    for i in range(vocab):
        table[i, (i + step) % vocab] = strength
    return table


def toy_pair(vocab: int = 5, seed: int = 0, max_seq_len: int = 64) -> tuple[NGramModel, NGramModel]:
    return (
        NGramModel.random(vocab, 2, seed=seed, max_seq_len=max_seq_len),
        NGramModel.random(vocab, 2, seed=seed + 100, max_seq_len=max_seq_len),
    )


# ----------------------------------------------------------------------------- greedy identity
@proof("greedy speculative decoding is the target's greedy output", "exact identity, float64")
@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 15), min_size=1, max_size=8),
    gamma=st.integers(1, 8),
    kind=st.sampled_from(["independent", "close"]),
)
def test_greedy_float64_is_the_target_greedy_output(
    llama64: dict, prompt: list[int], gamma: int, kind: str
) -> None:
    out = speculative_generate(
        llama64["target"], llama64[kind], prompt, 16, gamma=gamma, temperature=0
    )
    assert out.tokens == reference_greedy(llama64["target"], prompt, 16)


@proof("the greedy baseline is the target's greedy output", "exact identity, float64")
def test_greedy_float64_baseline_is_the_target_greedy_output(llama64: dict) -> None:
    for prompt in ([1], [3, 1, 4, 1, 5], [15] * 9):
        out = autoregressive_generate(llama64["target"], prompt, 20, temperature=0)
        assert out.tokens == reference_greedy(llama64["target"], prompt, 20)


def test_greedy_accepts_drafts(llama64: dict) -> None:
    """The identity above is not vacuous: the close draft gets most proposals accepted."""
    out = speculative_generate(
        llama64["target"], llama64["close"], [1, 2, 3], 30, gamma=4, temperature=0
    )
    assert out.stats.accepted_draft_tokens > 0.5 * out.stats.drafted_tokens


@proof(
    "in float32 a greedy token differs from the target's argmax only at a near-tie (1e-4)",
    "exact check of every token, 60 runs",
)
@pytest.mark.parametrize("gamma", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("kind", ["independent", "close"])
def test_greedy_float32_differs_only_at_near_ties(llama32: dict, gamma: int, kind: str) -> None:
    target, draft = llama32["target"], llama32[kind]
    for seed in range(6):
        prompt = torch.randint(
            0, 16, (1 + seed,), generator=torch.Generator().manual_seed(seed)
        ).tolist()
        out = speculative_generate(target, draft, prompt, 24, gamma=gamma, temperature=0)
        assert far_from_argmax(target, prompt, out.tokens) == []


@proof(
    "in bfloat16 a greedy token differs from the bfloat16 target's argmax only at a near-tie (1e-2 of the "
    "largest logit), plain and prepacked",
    "exact check of every token, 12 runs; the check rejects every drafted token kept",
    rejects=("every drafted token kept",),
)
@pytest.mark.parametrize("setup", ["plain", "prepacked"])
def test_greedy_bfloat16_differs_only_at_near_ties(
    setup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16-bit target is a different target: the proofs hold for the bfloat16 model that runs,
    in the set-up that runs it (oneDNN-prepacked bfloat16 where the CPU has native bf16); wide
    enough (512) for its products to be prepacked."""
    target = random_llama(
        vocab=16,
        dim=512,
        n_layers=1,
        n_heads=8,
        n_kv_heads=4,
        hidden_dim=512,
        max_seq_len=64,
        seed=7,
        dtype=torch.bfloat16,
    )
    runner, draft = copy.deepcopy(target), noisy_copy(target, std=0.02, seed=8)
    apply_setup(runner, setup, (1,), 64)
    for seed in range(6):
        prompt = torch.randint(
            0, 16, (1 + seed,), generator=torch.Generator().manual_seed(seed)
        ).tolist()
        out = speculative_generate(runner, draft, prompt, 24, gamma=4, temperature=0)
        assert far_from_argmax(target, prompt, out.tokens) == []
    monkeypatch.setattr(verify_module, "greedy_outcome", accept_everything)
    wrong = random_llama(
        vocab=16,
        dim=512,
        n_layers=1,
        n_heads=8,
        n_kv_heads=4,
        hidden_dim=512,
        max_seq_len=64,
        seed=9,
        dtype=torch.bfloat16,
    )
    out = speculative_generate(runner, wrong, [1, 2], 24, gamma=4, temperature=0)
    assert far_from_argmax(target, [1, 2], out.tokens) != []


def accept_everything(xs: list[int], ys: list[int]) -> object:
    """The greedy outcome with every drafted token kept."""
    return verify_module.Verification(
        tokens=xs + [ys[len(xs)]], accepted=len(xs), overlap=[1.0] * len(xs)
    )


@proof("the near-tie check can fail", "exact", rejects=("every drafted token kept",))
def test_near_tie_check_catches_a_broken_greedy(
    llama32: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accepting every draft token must be caught by the check used above."""
    monkeypatch.setattr(verify_module, "greedy_outcome", accept_everything)
    out = speculative_generate(
        llama32["target"], llama32["independent"], [1, 2], 24, gamma=4, temperature=0
    )
    assert far_from_argmax(llama32["target"], [1, 2], out.tokens) != []


# ----------------------------------------------------------------------------- stopping
@pytest.mark.parametrize("gamma", [1, 2, 3, 5, "auto"])
@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 13])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stops_exactly_at_max_new_tokens(
    gamma: int | str, max_new: int, temperature: float
) -> None:
    target, draft = toy_pair()
    same = NGramModel(target.table.clone())  # every proposal accepted: blocks of gamma + 1
    for d in (draft, same):
        out = speculative_generate(
            target, d, [1], max_new, gamma=gamma, temperature=temperature, seed=0
        )
        assert len(out.tokens) == out.stats.new_tokens == max_new
    assert (
        len(autoregressive_generate(target, [1], max_new, temperature=temperature, seed=0).tokens)
        == max_new
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_inside_an_accepted_block(temperature: float) -> None:
    target, draft = NGramModel(chain_table(6)), NGramModel(chain_table(6))
    seen: list[tuple[list[int], list[bool]]] = []
    out = speculative_generate(
        target,
        draft,
        [0],
        20,
        gamma=5,
        temperature=temperature,
        eos_id=3,
        seed=0,
        callback=lambda ids, flags: seen.append((ids, flags)),
    )
    assert out.tokens == [1, 2, 3]  # 4 and 5 were accepted too, but come after EOS
    assert seen == [([1, 2, 3], [True, True, True])]
    assert out.stats.accepted_draft_tokens == 5 and out.stats.target_calls == 1


def test_eos_as_bonus_and_as_correction_token() -> None:
    target = NGramModel(chain_table(6))
    seen: list[tuple[list[int], list[bool]]] = []
    out = speculative_generate(
        target,
        NGramModel(chain_table(6)),
        [0],
        20,
        gamma=2,
        temperature=0,
        eos_id=3,
        callback=lambda ids, flags: seen.append((ids, flags)),
    )
    assert out.tokens == [1, 2, 3] and seen == [([1, 2, 3], [True, True, False])]  # 3 is the bonus
    seen.clear()
    wrong = NGramModel(chain_table(6, step=2))  # proposes i + 2, always rejected
    out = speculative_generate(
        target,
        wrong,
        [1],
        20,
        gamma=3,
        temperature=0,
        eos_id=3,
        callback=lambda ids, flags: seen.append((ids, flags)),
    )
    assert out.tokens == [2, 3] and seen == [([2], [False]), ([3], [False])]


def test_eos_in_the_prompt_does_not_stop_and_the_baseline_stops_at_eos() -> None:
    target = NGramModel(chain_table(6))
    out = speculative_generate(
        target, NGramModel(chain_table(6)), [3, 3], 4, gamma=2, temperature=0, eos_id=3
    )
    assert out.tokens == [4, 5, 0, 1]
    assert autoregressive_generate(target, [0], 20, temperature=0, eos_id=3).tokens == [1, 2, 3]


@pytest.mark.parametrize("gamma", [1, 3, 6, "auto"])
def test_stops_at_max_seq_len(gamma: int | str) -> None:
    target = Recording(NGramModel.random(4, 2, seed=0, max_seq_len=12))
    draft = Recording(NGramModel.random(4, 2, seed=1, max_seq_len=12))
    out = speculative_generate(target, draft, [1, 2, 3, 0], 100, gamma=gamma, seed=0)
    assert len(out.tokens) == 8  # prompt + output = max_seq_len
    for model in (target, draft):
        assert max(model.cache_lengths) <= 12
        assert max(s + len(t) for s, t in model.calls) <= 12
    # the smaller of the two limits wins
    small = NGramModel.random(4, 2, seed=1, max_seq_len=10)
    assert (
        len(
            speculative_generate(target.model, small, [1, 2, 3, 0], 100, gamma=gamma, seed=0).tokens
        )
        == 6
    )
    assert len(autoregressive_generate(target.model, [1, 2, 3, 0], 100, seed=0).tokens) == 8


def test_a_prompt_that_fills_the_context_gives_no_tokens() -> None:
    target, draft = toy_pair(max_seq_len=6)
    assert speculative_generate(target, draft, [1] * 6, 5).tokens == []
    assert autoregressive_generate(target, [1] * 6, 5).tokens == []


# ----------------------------------------------------------------------------- rollback
def replay_and_check(
    calls: list[tuple[int, list[int]]], final: list[int], checked: set[int]
) -> None:
    """Replay the writes into a simulated cache: the calls numbered in `checked` (those that
    start an iteration) must find the final sequence in every slot below the first one they write,
    i.e. no stale (rejected) or missing token in what they attend to."""
    slots: list[int | None] = [None] * (len(final) + 32)
    for index, (start, tokens) in enumerate(calls):
        if index in checked:
            assert slots[:start] == final[:start], f"call at {start} sees a stale or missing slot"
        slots[start : start + len(tokens)] = tokens


def iterations_from_callback(
    prompt_len: int, seen: list[tuple[list[int], list[bool]]]
) -> list[tuple[int, int]]:
    """(n, accepted) per iteration: the sequence length before it and its accepted count."""
    out, n = [], prompt_len
    for ids, flags in seen:
        out.append((n, sum(flags)))
        n += len(ids)
    return out


@proof(
    "both KV caches roll back by position: every call feeds exactly the unread tokens",
    "exact, call by call",
)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1, 3])
def test_rollback_bookkeeping(seed: int, gamma: int) -> None:
    base_target, base_draft = toy_pair(vocab=4, seed=seed)
    target, draft = Recording(base_target), Recording(base_draft)
    prompt = [1, 0, 2]
    seen: list[tuple[list[int], list[bool]]] = []
    out = speculative_generate(
        target,
        draft,
        prompt,
        25,
        gamma=gamma,
        seed=seed,
        callback=lambda ids, flags: seen.append((ids, flags)),
    )
    final = prompt + out.tokens
    # both branches were exercised
    assert 0 < out.stats.accepted_draft_tokens < out.stats.drafted_tokens

    iterations = iterations_from_callback(len(prompt), seen)
    gammas = out.stats.gamma_history
    # target: one call per iteration, from the newest token (the whole prompt the first time)
    assert len(target.calls) == len(iterations)
    for k, ((start, tokens), (n, _)) in enumerate(zip(target.calls, iterations)):
        assert start == (0 if k == 0 else n - 1)
        assert tokens[: n - start] == final[start:n] and len(tokens) == n - start + gammas[k]
    # draft: gamma calls per iteration; the first feeds what the draft has not seen (two tokens
    # after a fully accepted iteration), the others one proposal each
    draft_calls, firsts = iter(draft.calls), set()
    for k, (n, _) in enumerate(iterations):
        if gammas[k] == 0:
            continue
        if k == 0:
            expected_start = 0
        else:
            all_accepted = iterations[k - 1][1] == gammas[k - 1] > 0
            expected_start = n - 2 if all_accepted else n - 1
        firsts.add(sum(gammas[:k]))  # index of this iteration's first draft call
        start, tokens = next(draft_calls)
        assert (start, tokens) == (expected_start, final[expected_start:n])
        for i in range(1, gammas[k]):
            start, tokens = next(draft_calls)
            assert start == n + i - 1 and len(tokens) == 1
    assert next(draft_calls, None) is None
    # within an iteration the draft attends to its own proposals; each iteration starts clean
    replay_and_check(target.calls, final, set(range(len(target.calls))))
    replay_and_check(draft.calls, final, firsts)


@pytest.mark.parametrize("gamma", [1, 4])
def test_every_position_is_fed_once_in_order_when_all_are_accepted(gamma: int) -> None:
    target = Recording(NGramModel.random(5, 2, seed=3))
    draft = Recording(NGramModel(target.model.table.clone()))
    out = speculative_generate(target, draft, [1, 2], 23, gamma=gamma, seed=0)
    assert out.stats.accepted_draft_tokens == out.stats.drafted_tokens
    final = [1, 2] + out.tokens
    for model in (target, draft):
        position = 0
        for start, tokens in model.calls:
            assert start == position, "a position was skipped or fed twice"
            assert tokens == final[start : start + len(tokens)]
            position += len(tokens)


# ----------------------------------------------------------------------------- stats
@pytest.mark.parametrize("gamma", [2, "auto"])
def test_stats_sanity(gamma: int | str) -> None:
    target, draft = (Recording(m) for m in toy_pair(vocab=4, seed=7))
    seen: list[tuple[list[int], list[bool]]] = []
    out = speculative_generate(
        target,
        draft,
        [1],
        40,
        gamma=gamma,
        seed=1,
        callback=lambda ids, flags: seen.append((ids, flags)),
    )
    s = out.stats
    assert [t for ids, _ in seen for t in ids] == out.tokens
    assert s.target_calls == len(seen) == len(s.gamma_history) == len(target.calls)
    assert s.draft_calls == s.drafted_tokens == sum(s.gamma_history) == len(draft.calls)
    assert (
        s.accepted_draft_tokens
        == sum(sum(flags) for _, flags in seen)
        == sum(s.accepted_per_position)
    )
    assert s.new_tokens == len(out.tokens) == 40
    assert all(a <= t for a, t in zip(s.accepted_per_position, s.tried_per_position))
    assert s.tried_per_position[0] == sum(1 for g in s.gamma_history if g > 0)
    assert 0 < s.acceptance_rate < 1 and 0 < s.empirical_acceptance < 1
    assert s.tokens_per_target_call == 40 / s.target_calls
    assert s.draft_time_s > 0 and s.target_time_s > 0 and s.wall_time_s >= s.decode_time_s > 0
    c = (s.draft_time_s / s.draft_calls) / (s.target_time_s / s.target_calls)
    assert s.cost_ratio == pytest.approx(c)
    # The paper's formulas over the gamma each iteration actually drafted (the last ones are
    # capped by max_new_tokens), not over the mean gamma.
    a, history = s.acceptance_rate, s.gamma_history
    assert min(history) < max(history)  # the run did cap gamma, so the two readings differ
    tokens = [(1 - a ** (g + 1)) / (1 - a) for g in history]
    assert s.predicted_tokens_per_target_call == pytest.approx(sum(tokens) / len(history))
    assert s.predicted_speedup == pytest.approx(sum(tokens) / sum(g * c + 1 for g in history))
    assert sum(s.gamma_histogram.values()) == s.target_calls
    if gamma == "auto":
        assert s.gamma_history[0] == 4 and all(0 <= x <= 16 for x in s.gamma_history)
        assert s.gamma == pytest.approx(
            sum(x for x in s.gamma_history if x) / sum(1 for x in s.gamma_history if x)
        )
    else:
        assert s.gamma == 2
    d = json.loads(json.dumps(s.to_dict()))
    for key in (
        "target_calls",
        "draft_calls",
        "new_tokens",
        "drafted_tokens",
        "accepted_draft_tokens",
        "accepted_per_position",
        "tried_per_position",
        "acceptance_rate",
        "empirical_acceptance",
        "tokens_per_target_call",
        "draft_time_s",
        "target_time_s",
        "cost_ratio",
        "gamma",
        "gamma_history",
        "gamma_histogram",
        "predicted_speedup",
        "tokens_per_second",
        "wall_time_s",
    ):
        assert key in d

    base = Recording(target.model)
    ar = autoregressive_generate(base, [1], 40, seed=1)
    assert ar.stats.target_calls == ar.stats.new_tokens == len(base.calls) == 40
    assert ar.stats.tokens_per_second > 0
    assert json.loads(json.dumps(ar.stats.to_dict()))["new_tokens"] == 40


def test_acceptance_rate_is_the_papers_alpha() -> None:
    """With context-free distributions alpha = sum_x min(p, q) exactly, whatever was sampled;
    the empirical ratio is a different, lower number (positions after a rejection count)."""
    p_row = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q_row = torch.tensor([0.1, 0.3, 0.3, 0.3], dtype=torch.float64)
    alpha = 0.1 + 0.3 + 0.2 + 0.0
    target = NGramModel(p_row.log().expand(4, 4).clone(), max_seq_len=1100)
    draft = NGramModel(q_row.log().expand(4, 4).clone(), max_seq_len=1100)
    out = speculative_generate(target, draft, [0], 1000, gamma=4, seed=0)
    assert out.stats.acceptance_rate == pytest.approx(alpha, abs=1e-12)
    assert out.stats.empirical_acceptance < alpha - 0.1
    tried, accepted = sum(out.stats.tried_per_position), sum(out.stats.accepted_per_position)
    assert accepted / tried == pytest.approx(alpha, abs=0.06)  # per verified position: alpha again
    disjoint = NGramModel(
        torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64).log().expand(4, 4).clone(),
        max_seq_len=1100,
    )
    assert (
        speculative_generate(target, disjoint, [0], 20, gamma=3, seed=0).stats.acceptance_rate
        == 0.0
    )


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prompt_ids": []}, "empty"),
        ({"prompt_ids": [1, 9]}, "prompt ids"),
        ({"prompt_ids": [1.5]}, "integers"),
        ({"prompt_ids": [1] * 33}, "max_seq_len"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2.0}, "max_new_tokens"),
        ({"gamma": 0}, "gamma"),
        ({"gamma": 1.5}, "gamma"),
        ({"gamma": "fast"}, "gamma"),
        ({"gamma": True}, "gamma"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    target, draft = (Recording(m) for m in toy_pair(vocab=8, max_seq_len=32))
    args = {"prompt_ids": [1, 2], "max_new_tokens": 5, **kwargs}
    with pytest.raises(ValueError, match=match):
        speculative_generate(target, draft, **args)
    if "gamma" not in kwargs:
        with pytest.raises(ValueError, match=match):
            autoregressive_generate(target, **args)
    assert target.calls == [] and draft.calls == []


def test_check_pair() -> None:
    a, b = NGramModel.random(4, 2), NGramModel.random(5, 2)
    with pytest.raises(PairMismatchError, match="vocabulary"):
        check_pair(a, b)
    assert issubclass(PairMismatchError, ValueError)
    check_pair(a, NGramModel.random(4, 3))
    same, other = FakeTokenizer(b"spm-1"), FakeTokenizer(b"spm-2")
    check_pair(a, a, same, FakeTokenizer(b"spm-1"))
    check_pair(a, a, same, None)  # one tokenizer: nothing to compare
    with pytest.raises(PairMismatchError, match="tokenizer"):
        check_pair(a, a, same, other)


def test_mismatched_pair_fails_before_any_generation() -> None:
    target, draft = Recording(NGramModel.random(4, 2)), Recording(NGramModel.random(5, 2))
    with pytest.raises(PairMismatchError):
        speculative_generate(target, draft, [1], 5)
    assert target.calls == draft.calls == [] and target.cache_lengths == draft.cache_lengths == []


def test_the_same_object_as_draft_and_target_is_refused() -> None:
    model = NGramModel.random(4, 2)
    with pytest.raises(ValueError, match="copy"):
        speculative_generate(model, model, [1], 5)


def test_prompt_as_tensor() -> None:
    target, draft = toy_pair()
    a = speculative_generate(target, draft, [1, 2], 6, seed=3).tokens
    assert speculative_generate(target, draft, torch.tensor([1, 2]), 6, seed=3).tokens == a
    assert speculative_generate(target, draft, torch.tensor([[1, 2]]), 6, seed=3).tokens == a


# ----------------------------------------------------------------------------- seeds
def test_same_seed_same_output_and_no_seed_varies() -> None:
    target, draft = (
        NGramModel.random(6, 2, seed=0, scale=0.3),
        NGramModel.random(6, 2, seed=1, scale=0.3),
    )
    for gen_fn in (
        lambda s: speculative_generate(target, draft, [1], 30, gamma=3, seed=s),
        lambda s: autoregressive_generate(target, [1], 30, seed=s),
    ):
        assert gen_fn(5).tokens == gen_fn(5).tokens
        assert gen_fn(5).tokens != gen_fn(6).tokens
        # ~6^-30 chance of a false failure
        assert len({tuple(gen_fn(None).tokens) for _ in range(3)}) > 1
