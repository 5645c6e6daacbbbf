"""Batches: the model's per-row cache positions, and the batched loops against the
single-sequence ones.

* model.Llama / FeatureHead called with one start slot per row (model.call.ragged:
  ragged rows, padding, padding past the cache's end, dropping and reordering rows with
  move_cache) give each row the logits of a plain forward over that row alone (float64,
  to 1e-12); a batch of one is the chain call bit for bit;
* ``sample_rows`` draws what ``sample`` draws row by row, bit for bit;
* ``speculative_generate_batch`` and ``autoregressive_generate_batch``: row i's tokens are
  those of the single-sequence call with seed + i (float64, where matmul shapes cannot tip
  a draw), for every drafter, both verifiers, batches smaller than the prompt list
  (continuous batching), and every stopping rule; a prompt's tokens do not depend on the
  other prompts of its batch;
* float32 greedy rows are the target's argmax up to the near-ties of the numerics policy
  (and the check catches a broken greedy rule);
* bad input is a one-line ValueError.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from model import call as calls
from model.call import CacheCall
from model.config import ModelConfig
from model.feature_head import FeatureHead
from speculative import (
    FeatureDrafter,
    PromptLookupDrafter,
    autoregressive_generate,
    autoregressive_generate_batch,
    sample,
    speculative_generate,
    speculative_generate_batch,
)
from speculative.sampling import sample_rows
from speculative.verify.verdict import Verification
from tests.support.proofs import proof
from tests.support.toy_models import far_from_argmax, noisy_copy, random_llama, reference_greedy

torch.set_num_threads(1)
verify_module = importlib.import_module("speculative.verify.token")


@pytest.fixture(scope="module")
def llama64() -> dict:
    target = random_llama(
        vocab=16,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        max_seq_len=48,
        seed=0,
        dtype=torch.float64,
    )
    return {
        "target": target,
        "close": noisy_copy(target, std=0.05, seed=1),
        "other": random_llama(vocab=16, dim=16, max_seq_len=48, seed=2, dtype=torch.float64),
    }


def random_prompts(count: int, seed: int, vocab: int = 16, longest: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, longest))] for _ in range(count)]


# ----------------------------------------------------------------------------- model
def ragged(model, tokens: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """The call of a batch whose row b starts at slot starts[b] (model.call.ragged)."""
    return model(tokens, calls.ragged(starts, tokens.shape[1], model.cache_len, tokens.device))


@torch.no_grad()
@pytest.mark.parametrize("seed", range(4))
def test_per_row_positions_give_each_row_its_own_forward(llama64: dict, seed: int) -> None:
    model, rng = llama64["target"], random.Random(seed)
    rows = random_prompts(4, seed)
    model.setup_cache(4, 24)
    fed = [0] * 4
    for _ in range(4):  # ragged calls: each row feeds its own number of tokens, at its own position
        feeds = [
            [rng.randrange(16) for _ in range(rng.randint(1, 3))] if fed[b] else rows[b]
            for b in range(4)
        ]
        if fed[0]:
            rows = [r + f for r, f in zip(rows, feeds)]
        width = max(map(len, feeds))
        out = ragged(model, torch.tensor([f + [0] * (width - len(f)) for f in feeds]), list(fed))
        for b in range(4):
            alone = model(torch.tensor([rows[b]]))[0, -len(feeds[b]) :]  # no cache
            assert torch.allclose(out[b, : len(feeds[b])], alone, atol=1e-12, rtol=0)
        fed = [len(r) for r in rows]
    model.move_cache([2, 0])  # rows finish and the rest move up, in any order
    out = ragged(model, torch.tensor([[5], [6]]), [fed[2], fed[0]])
    for b, old in enumerate([2, 0]):
        alone = model(torch.tensor([rows[old] + [[5], [6]][b]]))[0, -1]
        assert torch.allclose(out[b, -1], alone, atol=1e-12, rtol=0)


@torch.no_grad()
def test_rows_that_move_up_move_only_the_slots_they_hold(llama64: dict) -> None:
    """move_cache(rows, upto=n), what the engine does when a row leaves: the kept rows move only
    their first n slots (the longest kept row's), so a long context is not copied whole; each then
    continues as its own forward, and the slots from n on are left as they were."""
    model = llama64["target"]
    rows = random_prompts(3, 7)
    model.setup_cache(3, 48)
    width = max(map(len, rows))
    ragged(model, torch.tensor([r + [0] * (width - len(r)) for r in rows]), [0, 0, 0])
    longest = max(len(rows[2]), len(rows[1]))
    cache = model.layers[0].self_attn.cache
    beyond = cache.k[:2, :, longest:].clone()
    model.move_cache([2, 1], upto=longest)
    assert torch.equal(cache.k[:2, :, longest:], beyond)
    out = ragged(model, torch.tensor([[5], [6]]), [len(rows[2]), len(rows[1])])
    for b, old in enumerate([2, 1]):
        alone = model(torch.tensor([rows[old] + [[5], [6]][b]]))[0, -1]
        assert torch.allclose(out[b, -1], alone, atol=1e-12, rtol=0)
    for bad in (0, 49):
        with pytest.raises(ValueError, match="upto moves whole rows"):
            model.move_cache([0, 1], upto=bad)


@torch.no_grad()
def test_padding_past_the_end_of_the_cache_is_dropped(llama64: dict) -> None:
    model = llama64["target"]
    model.setup_cache(2, 8)
    ragged(model, torch.tensor([[1, 2, 3, 4, 5, 6, 7, 1], [1, 2, 0, 0, 0, 0, 0, 0]]), [0, 0])
    # row 0's padding runs off the end
    out = ragged(model, torch.tensor([[2, 0, 0], [3, 4, 5]]), [7, 2])
    assert torch.allclose(
        out[0, 0], model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 2]]))[0, -1], atol=1e-12, rtol=0
    )
    assert torch.allclose(out[1], model(torch.tensor([[1, 2, 3, 4, 5]]))[0, 2:], atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="row start positions 0..8 fall outside the KV cache"):
        ragged(model, torch.tensor([[1], [1]]), [8, 0])
    # a call built by hand past the end (and its scratch slot 8) reaches the model, which refuses it
    past_end = CacheCall(torch.tensor([[9], [0]]), torch.tensor([[9], [0]]), None, 8, 9)
    with pytest.raises(ValueError, match="up to 9 fall outside the KV cache"):
        model(torch.tensor([[1], [1]]), past_end)
    with pytest.raises(
        ValueError, match=r"the call places \(2, 1\) tokens, the input has \(1, 1\)"
    ):
        model(torch.tensor([[1]]), calls.ragged([0, 1], 1, model.cache_len, "cpu"))
    with pytest.raises(ValueError, match="rows to keep"):
        model.move_cache([0, 2])


@torch.no_grad()
def test_a_batch_of_one_with_a_list_is_the_single_path_bit_for_bit() -> None:
    model = random_llama(
        vocab=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, seed=3
    )
    model.setup_cache(1, 16)
    a = model(torch.tensor([[1, 2, 3]]), calls.chain(0, 3, "cpu"))
    b = model(torch.tensor([[4]]), calls.chain(3, 1, "cpu"))
    model.setup_cache(1, 16)
    assert torch.equal(ragged(model, torch.tensor([[1, 2, 3]]), [0]), a)
    assert torch.equal(ragged(model, torch.tensor([[4]]), [3]), b)
    # and through a call built from tensors alone, with its causal mask written out
    model.setup_cache(1, 16)
    assert torch.equal(model(torch.tensor([[1, 2, 3]]), CacheCall.of(torch.tensor([[0, 1, 2]]))), a)
    assert torch.equal(model(torch.tensor([[4]]), CacheCall.of(torch.tensor([[3]]))), b)


@torch.no_grad()
def test_feature_head_per_row_positions(llama64: dict) -> None:
    config = ModelConfig(
        vocab_size=16, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=48
    )
    head = FeatureHead(config).double()
    gen = torch.Generator().manual_seed(0)
    feats, emb = (
        torch.randn(2, 6, 32, generator=gen, dtype=torch.float64),
        torch.randn(2, 6, 32, generator=gen, dtype=torch.float64),
    )
    alone = [head(feats[b : b + 1], emb[b : b + 1])[0] for b in range(2)]
    head.setup_cache(2, 12)
    # row 0 then reads 4.., row 1 re-reads 2..
    head(feats[:, :4], emb[:, :4], calls.ragged([0, 0], 4, 12, "cpu"))
    out = head(feats[:, 2:], emb[:, 2:], calls.ragged([2, 2], 4, 12, "cpu"))
    assert torch.allclose(out[0], alone[0][2:], atol=1e-12) and torch.allclose(
        out[1], alone[1][2:], atol=1e-12
    )
    head.move_cache([1])
    tail = head(feats[1:, 5:], emb[1:, 5:], calls.ragged([5], 1, 12, "cpu"))
    assert torch.allclose(tail[0, 0], alone[1][5], atol=1e-12)


# ----------------------------------------------------------------------------- sampling
def test_sample_rows_is_sample_row_by_row() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        probs = torch.softmax(torch.randn(6, 50, generator=gen), -1).to(dtype)
        probs[2] = 0
        probs[2, 7] = 1  # one-hot
        seeds = [gen.seed() % 1000 for _ in range(6)]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        singles = [torch.Generator().manual_seed(s) for s in seeds]
        for _ in range(20):
            got = sample_rows(probs, gens).tolist()
            want = [int(sample(probs[b], singles[b])) for b in range(6)]
            assert got == want
        idle = [gens[0], None, gens[2], None, gens[4], gens[5]]
        before = gens[1].get_state()
        got = sample_rows(probs, idle)
        assert got[1] == probs[1].argmax() and torch.equal(gens[1].get_state(), before)


# ----------------------------------------------------------------------------- the loops against the single loop
def drafter_for(kind: str, llama64: dict):
    if kind == "lookup":
        return PromptLookupDrafter()
    if kind == "head":
        target = llama64["target"]
        config = ModelConfig(
            vocab_size=16,
            dim=32,
            n_layers=1,
            n_heads=4,
            n_kv_heads=2,
            hidden_dim=64,
            max_seq_len=48,
        )
        torch.manual_seed(0)
        return FeatureDrafter(FeatureHead(config).double(), target)
    return llama64[kind]


@proof(
    "row i of a batch is the batch of one with seed + i, token for token (every drafter, token and block)",
    "exact identity, float64",
)
@pytest.mark.parametrize("kind", ["close", "other", "lookup", "head"])
@pytest.mark.parametrize("temperature, verify", [(0.0, "token"), (1.0, "token"), (0.8, "block")])
def test_each_row_is_the_single_prompt_call(
    llama64: dict, kind: str, temperature: float, verify: str
) -> None:
    prompts = random_prompts(5, seed=len(kind))
    prompts[1] = [3, 4, 3, 4, 3, 4, 3]  # something for the lookup to find
    draft = drafter_for(kind, llama64)
    for batch_size in (5, 2):
        out = speculative_generate_batch(
            llama64["target"],
            draft,
            prompts,
            14,
            gamma=3,
            temperature=temperature,
            seed=40,
            verify=verify,
            batch_size=batch_size,
            top_k=6,
        )
        for i, prompt in enumerate(prompts):
            alone = speculative_generate(
                llama64["target"],
                draft,
                prompt,
                14,
                gamma=3,
                temperature=temperature,
                seed=40 + i,
                verify=verify,
                top_k=6,
            )
            assert out.results[i].tokens == alone.tokens, (i, batch_size)
            assert out.results[i].stats.accepted_draft_tokens == alone.stats.accepted_draft_tokens
        assert max(out.stats.rows_history) == batch_size
        assert out.stats.new_tokens == 5 * 14 and len(out.results) == 5
        # continuous batching: a waiting prompt joins as soon as a row leaves, so the batch
        # only shrinks once nobody waits (waves of batch_size would refill after a dip)
        history = out.stats.rows_history
        assert history[0] == batch_size and history == sorted(history, reverse=True)


@proof("the batched baseline's rows are the single calls", "exact identity, float64")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_autoregressive_rows_are_the_single_calls(llama64: dict, temperature: float) -> None:
    prompts = random_prompts(6, seed=9)
    for batch_size in (6, 4):
        out = autoregressive_generate_batch(
            llama64["target"],
            prompts,
            12,
            temperature=temperature,
            seed=5,
            batch_size=batch_size,
            top_p=0.9,
        )
        for i, prompt in enumerate(prompts):
            alone = autoregressive_generate(
                llama64["target"], prompt, 12, temperature=temperature, seed=5 + i, top_p=0.9
            )
            assert out.results[i].tokens == alone.tokens


def test_a_prompt_does_not_depend_on_its_batch(llama64: dict) -> None:
    """A batch of one prompt, and the same prompt first in a batch of eight: the same tokens."""
    prompts = random_prompts(8, seed=4)
    alone = speculative_generate_batch(
        llama64["target"], llama64["close"], prompts[:1], 20, seed=123
    )
    crowd = speculative_generate_batch(llama64["target"], llama64["close"], prompts, 20, seed=123)
    assert alone.results[0].tokens == crowd.results[0].tokens
    seeds = [7, 1, 9, 3, 5, 2, 8, 4]  # explicit seeds follow their prompt, wherever it stands
    shuffled = speculative_generate_batch(
        llama64["target"], llama64["close"], prompts[::-1], 20, seed=seeds[::-1]
    )
    direct = speculative_generate_batch(
        llama64["target"], llama64["close"], prompts, 20, seed=seeds
    )
    assert [r.tokens for r in shuffled.results[::-1]] == [r.tokens for r in direct.results]


def test_stopping_rules_per_row(llama64: dict) -> None:
    """EOS, max_new_tokens and the context end, each row by itself (the context row is padded
    by the others past the end of its cache)."""
    target, draft = llama64["target"], llama64["close"]
    prompts = [[1] * 44, [2, 3], [4], [5, 6, 7]]
    for eos in (None, 3, 7):
        out = speculative_generate_batch(
            target, draft, prompts, 10, gamma=4, temperature=1.0, seed=3, eos_id=eos
        )
        for i, prompt in enumerate(prompts):
            alone = speculative_generate(
                target, draft, prompt, 10, gamma=4, temperature=1.0, seed=3 + i, eos_id=eos
            )
            assert out.results[i].tokens == alone.tokens
            assert out.results[i].stats.stop_reason == alone.stats.stop_reason
        assert (
            out.results[0].stats.stop_reason in ("max_seq_len", "eos")
            and len(out.results[0].tokens) <= 4
        )


# ----------------------------------------------------------------------------- float32 greedy
@pytest.fixture(scope="module")
def llama32() -> dict:
    target = random_llama(
        vocab=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=64, seed=3
    )
    return {"target": target, "close": noisy_copy(target, std=0.02, seed=4)}


@proof(
    "greedy rows are the target's greedy output up to near-ties, batch sizes 1, 3, 8",
    "exact check of every token",
)
@pytest.mark.parametrize("size", [1, 3, 8])
def test_greedy_float32_rows_are_the_target_up_to_near_ties(llama32: dict, size: int) -> None:
    prompts = random_prompts(size, seed=size)
    out = speculative_generate_batch(
        llama32["target"], llama32["close"], prompts, 20, gamma=4, temperature=0
    )
    for prompt, result in zip(prompts, out.results):
        assert far_from_argmax(llama32["target"], prompt, result.tokens) == []
    plain = autoregressive_generate_batch(llama32["target"], prompts, 20, temperature=0)
    for prompt, result in zip(prompts, plain.results):
        assert far_from_argmax(llama32["target"], prompt, result.tokens) == []
        assert result.tokens == reference_greedy(llama32["target"], prompt, 20) or size > 1


@proof("the batched near-tie check can fail", "exact", rejects=("every drafted token kept",))
def test_near_tie_check_catches_a_broken_batched_greedy(
    llama32: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        verify_module,
        "greedy_outcome",
        lambda xs, ys: Verification(xs + [ys[len(xs)]], len(xs), [1.0] * len(xs)),
    )
    independent = random_llama(vocab=16, dim=16, max_seq_len=64, seed=5)
    prompts = random_prompts(3, seed=1)
    out = speculative_generate_batch(
        llama32["target"], independent, prompts, 20, gamma=4, temperature=0
    )
    assert any(
        far_from_argmax(llama32["target"], p, r.tokens) for p, r in zip(prompts, out.results)
    )


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prompts": []}, "prompts is empty"),
        ({"prompts": [1, 2]}, "prompt 0"),
        ({"prompts": [[1], []]}, "prompt 1: the prompt is empty"),
        ({"prompts": [[1], [99]]}, r"prompt 1: prompt ids must lie in \[0, 16\)"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"seed": [1]}, "one per prompt"),
        ({"gamma": 0}, "gamma must be"),
        ({"verify": "tree"}, "verify must be one of"),
    ],
)
def test_bad_input_is_a_clear_error(llama64: dict, kwargs: dict, match: str) -> None:
    args = {"prompts": [[1, 2], [3]], **kwargs}
    with pytest.raises(ValueError, match=match):
        speculative_generate_batch(
            llama64["target"], llama64["close"], args.pop("prompts"), 4, **args
        )


def test_a_drafter_of_the_old_single_sequence_protocol_is_refused(llama64: dict) -> None:
    """One drafter protocol, over rows: an object with only the old per-sequence calls (no
    keep_rows, per-sequence propose) is not a drafter, alone or in a batch."""

    class OneRow:
        reads_features, vocab_size, max_seq_len = False, None, None

        def start(self, cache_len, target): ...
        def propose(self, seq, ids, gamma, sampling, generator): ...
        def commit(self, length, hidden=None, hidden_start=0): ...

    with pytest.raises(TypeError, match="keep_rows"):
        speculative_generate_batch(llama64["target"], OneRow(), [[1]], 4)
    with pytest.raises(TypeError, match="keep_rows"):
        speculative_generate(llama64["target"], OneRow(), [1], 4)
