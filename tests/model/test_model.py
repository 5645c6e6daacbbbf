"""The hand-written decoder against transformers' LlamaForCausalLM, and its KV cache.

transformers is the oracle here: a random checkpoint written by ``save_pretrained`` must
give the same logits through ``weights.load_model``, and a checkpoint written by
``weights.save_model`` must give the same logits in ``LlamaForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import pytest
import torch

from model import Llama, ModelConfig
from model import call as calls
from model.call import CacheCall
from model.model import apply_rope, rope_cos_sin
from tests.support.hf import HF_CONFIGS, hf_config, hf_logits, hf_model, random_tokens, randomize_
from weights import load_model, save_model

transformers = pytest.importorskip(
    "transformers", reason="transformers (the reference) is in the [test] extras"
)

PARITY_ATOL = 1e-5  # float32, max abs logits difference
SEQ = 48  # below the scaled configs' original_max_position_embeddings, above every rope wavelength that matters


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_logits_match_transformers(name: str, tmp_path) -> None:
    """HF save_pretrained -> our load_model: same logits to 1e-5 in float32."""
    config = hf_config(name)
    reference = hf_model(config, seed=0)
    reference.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    tokens = random_tokens(2, SEQ, config["vocab_size"])
    expected = hf_logits(reference, tokens)
    with torch.no_grad():
        got = ours(tokens)
    assert got.shape == expected.shape == (2, SEQ, config["vocab_size"])
    assert expected.abs().max() > 1.0  # logits are not flat, so the comparison means something
    diff = _max_diff(got, expected)
    print(f"{name}: max |logits diff| = {diff:.3g}")
    assert diff <= PARITY_ATOL, f"{name}: max abs logits difference {diff:.3g}"


@pytest.mark.parametrize("name", ["llama3.1", "linear-rope"])
def test_parity_check_sees_rope_scaling(name: str, tmp_path) -> None:
    """The parity test can fail: dropping the rope scaling moves logits far beyond 1e-5."""
    config = hf_config(name)
    reference = hf_model(config, seed=0)
    reference.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ours.config.rope_scaling = None  # what a loader that ignored rope_scaling would build
    tokens = random_tokens(1, SEQ, config["vocab_size"])
    with torch.no_grad():
        diff = _max_diff(ours(tokens), hf_logits(reference, tokens))
    assert diff > 1e-2


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_saved_model_loads_in_transformers(name: str, tmp_path) -> None:
    """Our save_model -> transformers' from_pretrained: same logits."""
    config = ModelConfig.from_hf(hf_config(name))
    ours = randomize_(Llama(config), seed=3).eval()
    save_model(ours, tmp_path)
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert reference.config.tie_word_embeddings == config.tie_word_embeddings
    tokens = random_tokens(2, SEQ, config.vocab_size, seed=4)
    with torch.no_grad():
        got = ours(tokens)
    diff = _max_diff(got, hf_logits(reference, tokens))
    print(f"{name} (reverse): max |logits diff| = {diff:.3g}")
    assert diff <= PARITY_ATOL


def test_greedy_generation_matches_transformers_generate(tmp_path) -> None:
    """50 greedy tokens from our cached decode loop equal transformers' greedy ``generate``.

    float32 is enough here: the init (std 0.15) keeps the smallest top-1/top-2 logit gap
    along the way around 1e-2, four orders of magnitude above the ~1e-6 numerical
    difference between the two implementations, and the test checks that margin so a
    near-tie can never make it flaky (it would fail loudly and call for float64).
    """
    config = hf_config("gqa")
    reference = hf_model(config, seed=0)
    reference.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    prompt = random_tokens(2, 6, config["vocab_size"], seed=5).clamp(min=3)
    new_tokens = 50
    expected = reference.generate(
        prompt,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    ours.setup_cache(max_batch_size=2, max_seq_len=prompt.shape[1] + new_tokens)
    tokens, gaps = prompt, []
    with torch.no_grad():
        logits = ours(prompt, calls.chain(0, prompt.shape[1], prompt.device, rows=2))[:, -1]
        for _ in range(new_tokens):
            top2 = logits.topk(2, dim=-1).values
            gaps.append((top2[:, 0] - top2[:, 1]).min().item())
            nxt = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            logits = ours(nxt, calls.chain(tokens.shape[1] - 1, 1, nxt.device, rows=2))[:, -1]
    assert min(gaps) > 1e-3, f"near-tie in greedy decoding (gap {min(gaps):.2g}); use float64"
    assert expected.shape == tokens.shape == (2, 6 + new_tokens)
    assert tokens.tolist() == expected.tolist()
    assert len(set(tokens[0, 6:].tolist())) > 5  # not a degenerate single-token loop


# ----------------------------------------------------------------------------- cache
def _model(name: str = "gqa", seed: int = 7) -> Llama:
    return randomize_(Llama(ModelConfig.from_hf(hf_config(name))), seed=seed).eval()


@pytest.mark.parametrize("name", ["gqa", "llama3.1"])
def test_cached_decoding_equals_uncached_forward(name: str) -> None:
    """Prefill, then single tokens, then chunks of 5: each step's logits equal the full forward's."""
    model = _model(name)
    tokens = random_tokens(2, 30, model.config.vocab_size, seed=8)
    with torch.no_grad():
        full = model(tokens)
        model.setup_cache(max_batch_size=2, max_seq_len=32)
        steps = [(0, 7)] + [(p, p + 1) for p in range(7, 15)] + [(15, 20), (20, 25), (25, 30)]
        for start, end in steps:
            got = model(
                tokens[:, start:end], calls.chain(start, end - start, tokens.device, rows=2)
            )
            assert got.shape == (2, end - start, model.config.vocab_size)
            diff = _max_diff(got, full[:, start:end])
            assert diff <= PARITY_ATOL, f"positions {start}..{end - 1}: {diff:.3g}"


def test_rollback_overwrites_stale_cache_entries() -> None:
    """Calling again at an earlier slot discards what was written past it."""
    model = _model()
    vocab = model.config.vocab_size
    first = random_tokens(1, 20, vocab, seed=9)
    second = torch.cat([first[:, :10], random_tokens(1, 10, vocab, seed=10)], dim=1)
    assert not torch.equal(first[:, 10:], second[:, 10:])
    with torch.no_grad():
        expected = model(second)
        model.setup_cache(max_batch_size=1, max_seq_len=24)
        model(first[:, :16], calls.chain(0, 16, "cpu"))  # slots 10..15 now hold `first`'s entries
        # Roll back to 10: three new tokens in a chunk (masked call), then single tokens
        # (unmasked call) while stale entries of `first` still sit at 13..15.
        got = [model(second[:, 10:13], calls.chain(10, 3, "cpu"))]
        got += [model(second[:, p : p + 1], calls.chain(p, 1, "cpu")) for p in range(13, 15)]
        got.append(model(second[:, 15:20], calls.chain(15, 5, "cpu")))
    diff = _max_diff(torch.cat(got, dim=1), expected[:, 10:20])
    assert diff <= PARITY_ATOL
    # A rollback that forgot to overwrite would show: the stale prefix gives other logits.
    with torch.no_grad():
        stale = model(first[:, :16])[:, 10:13]
    assert _max_diff(stale, expected[:, 10:13]) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_write_their_own_slots_and_nothing_else(dtype: torch.dtype) -> None:
    """KVCache.write with rows at their own slots (a ragged batch, in every dtype: a 16-bit batch
    write once went through a scatter_ that copied the whole cache): each row's vectors land at
    its slots, and every other slot keeps what it held."""
    from model.model import KVCache

    cache = KVCache(3, 2, 16, 4, dtype, torch.device("cpu"))
    before_k, before_v = torch.randn(3, 2, 16, 4).to(dtype), torch.randn(3, 2, 16, 4).to(dtype)
    cache.k.copy_(before_k)
    cache.v.copy_(before_v)
    slots = torch.tensor([[5, 6], [0, 1], [14, 15]]).view(3, 1, 2, 1)
    k, v = torch.randn(3, 2, 2, 4).to(dtype), torch.randn(3, 2, 2, 4).to(dtype)
    cache.write(slots, 16, k, v)
    want_k, want_v = before_k.clone(), before_v.clone()
    for b, row in enumerate(([5, 6], [0, 1], [14, 15])):
        for i, slot in enumerate(row):
            want_k[b, :, slot], want_v[b, :, slot] = k[b, :, i], v[b, :, i]
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)


def _outside(top: int) -> str:
    return rf"slots or positions up to {top} fall outside the KV cache \(max_seq_len 16\)"


def test_going_past_the_cache_raises() -> None:
    model = _model()
    tokens = random_tokens(1, 12, model.config.vocab_size, seed=11)
    model.setup_cache(max_batch_size=1, max_seq_len=16)
    with torch.no_grad():
        model(tokens[:, :10], calls.chain(0, 10, "cpu"))
        with pytest.raises(ValueError, match=_outside(17)):
            model(tokens[:, :8], calls.chain(10, 8, "cpu"))
        with pytest.raises(ValueError, match=_outside(16)):
            # slot 16 is the scratch slot, never a token's
            model(tokens[:, :1], calls.chain(16, 1, "cpu"))
        with pytest.raises(ValueError, match="max_batch_size"):
            model(random_tokens(2, 1, model.config.vocab_size), calls.chain(10, 1, "cpu", rows=2))
        model(tokens[:, :6], calls.chain(10, 6, "cpu"))  # exactly filling the cache is fine


def test_a_bad_cache_call_raises_one_clear_error() -> None:
    """Calls built by hand (CacheCall, CacheCall.of) are checked: slots or positions past the
    cache, a window past it, visibility of the wrong shape or dtype, positions that do not
    match the slots, a call for another number of tokens, and anything that is not a call."""
    model = _model()
    model.setup_cache(max_batch_size=1, max_seq_len=16)
    x = torch.zeros(1, 3, dtype=torch.long)
    slots = torch.tensor([[4, 5, 6]])
    see_all = torch.ones(1, 3, 7, dtype=torch.bool)
    with torch.no_grad():
        with pytest.raises(ValueError, match=_outside(17)):
            # a slot past the cache (16 is the scratch slot)
            model(x, CacheCall.of(torch.tensor([[4, 5, 17]])))
        with pytest.raises(ValueError, match=_outside(17)):
            # a position past it
            model(x, CacheCall.of(slots, positions=torch.tensor([[4, 5, 17]])))
        with pytest.raises(ValueError, match=_outside(16)):
            # a window past it
            model(x, CacheCall(slots, slots, torch.ones(1, 3, 17, dtype=torch.bool), 17, 6))
        with pytest.raises(
            ValueError, match=r"visible must be a BoolTensor \(1, 3, 7\) \(rows, tokens, window\)"
        ):
            CacheCall(slots, slots, torch.ones(1, 3, 6, dtype=torch.bool), 7, 6)
        with pytest.raises(ValueError, match=r"visible must be a BoolTensor \(1, 3, 7\)"):
            CacheCall(slots, slots, see_all.float(), 7, 6)
        with pytest.raises(
            ValueError, match=r"positions must be a LongTensor of the slots' shape \(1, 3\)"
        ):
            CacheCall(slots, torch.tensor([[4, 5]]), see_all, 7, 6)
        with pytest.raises(
            ValueError, match=r"positions must be a LongTensor of the slots' shape \(1, 3\)"
        ):
            CacheCall(slots, slots.int(), see_all, 7, 6)
        with pytest.raises(ValueError, match=r"slots must be a LongTensor \[B, T\]"):
            CacheCall(slots[0], slots[0], None, 7, 6)
        with pytest.raises(ValueError, match="reads at least one slot"):
            CacheCall(slots, slots, None, 0, 6)
        with pytest.raises(ValueError, match="must be >= 0"):
            CacheCall.of(torch.tensor([[-1, 0, 1]]))
        with pytest.raises(
            ValueError, match=r"the call places \(1, 2\) tokens, the input has \(1, 3\)"
        ):
            model(x, calls.chain(4, 2, "cpu"))
        with pytest.raises(TypeError, match="takes a CacheCall"):
            model(x, 4)
        # well formed
        assert model(x, CacheCall(slots, slots, see_all, 7, 6)).shape == (
            1,
            3,
            model.config.vocab_size,
        )


def test_cache_and_uncached_forward_respect_max_position_embeddings() -> None:
    model = _model()  # max_position_embeddings 128
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len 128"):
        model.setup_cache(max_batch_size=1, max_seq_len=129)
    with pytest.raises(ValueError, match="exceed the model's max_seq_len 128"), torch.no_grad():
        model(torch.zeros(1, 129, dtype=torch.long))


def test_cached_call_without_setup_raises() -> None:
    model = _model()
    with pytest.raises(RuntimeError, match="setup_cache"):
        model(torch.zeros(1, 3, dtype=torch.long), calls.chain(0, 3, "cpu"))


# ----------------------------------------------------------------------------- sizes
# The published Llama-2 config.json files (meta-llama/Llama-2-{7b,13b,70b}-hf), written out here.
LLAMA2_CONFIGS = {
    "7b": (
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
        ),
        6_738_415_616,
    ),
    "13b": (
        dict(
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=40,
        ),
        13_015_864_320,
    ),
    "70b": (
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
        ),
        68_976_648_192,
    ),
}


@pytest.mark.parametrize("size", list(LLAMA2_CONFIGS))
def test_llama2_parameter_counts(size: str) -> None:
    """The real Llama-2 shapes, built on the meta device, have exactly the published sizes."""
    shape, expected = LLAMA2_CONFIGS[size]
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "rope_scaling": None,
        "torch_dtype": "float16",
        "use_cache": True,
        "transformers_version": "4.31.0.dev0",
        **shape,
    }
    config = ModelConfig.from_hf(hf)
    with torch.device("meta"):
        model = Llama(config)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == expected
    assert config.num_parameters() == expected


# ----------------------------------------------------------------------------- rotary
def test_rolled_rope_is_the_rotate_half_formula_bit_for_bit() -> None:
    """apply_rope (roll + signed sin) against transformers' form x * cos + cat(-x2, x1) * sin,
    written out here from its definition, with the unsigned sin computed independently."""
    head_dim, positions = 64, torch.arange(40)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, signed_sin = rope_cos_sin(inv_freq, positions)
    angles = positions.float()[:, None] * inv_freq[None, :]
    sin = torch.cat((angles, angles), dim=-1).sin()
    x = torch.randn(2, 3, 40, head_dim, generator=torch.Generator().manual_seed(0))
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    expected = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    assert torch.equal(apply_rope(x, cos, signed_sin), expected)
    # and the check can fail: the sign on the wrong half is a rotation the other way
    assert not torch.allclose(apply_rope(x, cos, -signed_sin), expected, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape", [(1, 9, 3, 1, 40), (2, 9, 3, 5, 40), (1, 8, 2, 3, 17), (1, 4, 4, 2, 9)]
)
def test_attention_with_grouped_heads_is_plain_attention(dtype, shape) -> None:
    """model.model.attend folds a 16-bit CPU call's grouped query heads into rows: it must be the
    attention of every query head over its own KV head (h // group), under each token's mask row,
    to the dtype's rounding of a float64 reference written here, and a fold that pairs query heads
    with the wrong KV head must not pass."""
    from model.model import attend

    batch, heads, kv, tokens, slots = shape
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(batch, tokens, heads, 64, generator=g).transpose(1, 2)
    k, v = (torch.randn(batch, kv, slots, 64, generator=g) for _ in range(2))
    visible = torch.rand(batch, tokens, slots, generator=g) > 0.3
    visible[..., 0] = True
    mask = torch.where(visible.unsqueeze(1), 0.0, float("-inf"))
    group = heads // kv
    want = torch.empty(batch, heads, tokens, 64, dtype=torch.float64)
    for h in range(heads):
        scores = q[:, h].double() @ k[:, h // group].double().transpose(-1, -2) / 8.0
        scores = scores + mask[:, 0].double()
        want[:, h] = scores.softmax(-1) @ v[:, h // group].double()
    got = attend(q.to(dtype), k.to(dtype), v.to(dtype), mask.to(dtype), False).double()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got - want).abs().max() < tolerance
    if group > 1:  # query head h paired with KV head h % KV: a wrong fold
        wrong = (
            q.reshape(batch, group, kv, tokens, 64)
            .transpose(1, 2)
            .reshape(batch, heads, tokens, 64)
        )
        bad = attend(wrong.to(dtype), k.to(dtype), v.to(dtype), mask.to(dtype), False).double()
        assert (bad - want).abs().max() > 10 * tolerance
