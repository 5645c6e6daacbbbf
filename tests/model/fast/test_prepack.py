"""Weights reordered once for oneDNN (model/fast/prepack.py): same logits, same generations.

Prepacking only changes the order of float32 additions, so a prepacked model must agree
with the plain one to float32 rounding, with and without the KV cache, and speculative
greedy decoding on a prepacked pair must still return the target's own greedy output.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from model import Llama, ModelConfig
from model.call import chain
from model.fast import prepack
from model.fast.prepack import (
    MIN_ELEMENTS,
    PrepackedLinear,
    packable,
    prepack_linears,
    prepack_supported,
)
from speculative import autoregressive_generate, speculative_generate
from tests.support.hf import randomize_
from weights import save_model

needs_onednn = pytest.mark.skipif(
    not prepack_supported(), reason="this PyTorch build lacks the oneDNN prepacking operators"
)

# Big enough that the MLP and attention projections pass MIN_ELEMENTS, small enough to be fast.
CONFIG = ModelConfig(
    dim=384, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=512, hidden_dim=1024, max_seq_len=64
)


def random_model(
    config: ModelConfig = CONFIG, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Llama:
    """Weights N(0, 0.08), sharper than init, so that logits spread and disagreements show."""
    return randomize_(Llama(config), seed=seed, std=0.08).to(dtype).eval()


@needs_onednn
def test_prepacked_logits_equal_plain_ones() -> None:
    plain = random_model()
    packed = copy.deepcopy(plain)
    count = prepack_linears(packed)
    # q, o, gate, up, down per block and the head pass the threshold; k and v (384 x 128) do not.
    assert count == 2 * 5 + 1
    assert isinstance(packed.layers[0].mlp.up_proj, PrepackedLinear)
    assert type(packed.layers[0].self_attn.k_proj) is nn.Linear
    tokens = torch.randint(
        0, CONFIG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1)
    )
    with torch.inference_mode():
        expected, got = plain(tokens), packed(tokens)
        assert expected.abs().max() > 1.0
        assert (got - expected).abs().max().item() < 1e-4
        # cached: a prefill, then chunks of 5 (a verification) and of 1 (a decode step)
        for model in (plain, packed):
            model.setup_cache(2, 64)
        for start, end in ((0, 30), (30, 35), (35, 36), (36, 40)):
            call = chain(start, end - start, tokens.device, rows=2)
            a, b = plain(tokens[:, start:end], call), packed(tokens[:, start:end], call)
            assert (a - b).abs().max().item() < 1e-4
            assert (b - expected[:, start:end]).abs().max().item() < 1e-4


@needs_onednn
def test_the_comparison_can_fail() -> None:
    """A prepacked layer holding the wrong matrix is seen: the tolerance above is not loose."""
    plain = random_model()
    packed = copy.deepcopy(plain)
    prepack_linears(packed)
    wrong = plain.layers[1].mlp.down_proj.weight.detach().clone()
    wrong[0] += 0.01  # one output feature off by a hundredth per weight
    packed.layers[1].mlp.down_proj = PrepackedLinear(wrong)
    tokens = torch.randint(
        0, CONFIG.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2)
    )
    with torch.inference_mode():
        assert (plain(tokens) - packed(tokens)).abs().max().item() > 1e-3


@needs_onednn
def test_only_plain_large_float32_cpu_layers_are_swapped() -> None:
    class AllReduceLinear(nn.Linear):  # as tensor parallelism's row-parallel layer
        pass

    holder = nn.Module()
    holder.big = nn.Linear(512, 512, bias=False)
    holder.small = nn.Linear(64, 64, bias=False)
    holder.biased = nn.Linear(512, 512, bias=True)
    holder.subclass = AllReduceLinear(512, 512, bias=False)
    assert 512 * 512 >= MIN_ELEMENTS > 64 * 64
    assert prepack_linears(holder) == 1
    assert isinstance(holder.big, PrepackedLinear)
    assert (holder.big.in_features, holder.big.out_features) == (512, 512)
    assert type(holder.small) is nn.Linear and type(holder.biased) is nn.Linear
    assert type(holder.subclass) is AllReduceLinear
    # PyTorch does not repack per call for it
    assert prepack_linears(random_model(dtype=torch.float64)) == 0
    # not prepacked: see model/fast/prepack.py
    assert prepack_linears(random_model(dtype=torch.float16)) == 0
    # oneDNN reorders bfloat16 at every call: packed where native
    bf16 = random_model(dtype=torch.bfloat16)
    assert (prepack_linears(bf16) > 0) == packable(torch.bfloat16)


@needs_onednn
@pytest.mark.parametrize("cache", [None, 1 << 30, 384 * 512 * 4 - 1])
def test_a_tied_output_head_is_packed_only_where_it_outgrows_the_cpu_cache(
    cache: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed copy of a head tied to the embeddings sits beside the original the embeddings
    read: more memory, and for a head that fits in the last-level cache a slower step. Only a
    head larger than that cache (here 384 x 512 float32 weights against a cache one byte
    smaller) is packed; where the cache is unknown it is not. The embeddings keep the original."""
    monkeypatch.setattr(prepack, "last_level_cache_bytes", lambda: cache)
    tied = random_model(dataclasses.replace(CONFIG, tie_word_embeddings=True))
    untied = random_model()
    assert tied.lm_head.weight is tied.embed_tokens.weight
    weight = tied.embed_tokens.weight
    x = torch.randn(3, CONFIG.dim, generator=torch.Generator().manual_seed(1))
    assert prepack_linears(untied) == 2 * 5 + 1 and isinstance(untied.lm_head, PrepackedLinear)
    large = cache is not None and cache < weight.numel() * 4
    assert prepack_linears(tied) == 2 * 5 + large
    assert isinstance(tied.lm_head, PrepackedLinear if large else nn.Linear)
    assert tied.embed_tokens.weight is weight
    torch.testing.assert_close(tied.lm_head(x), x @ weight.T, rtol=1e-4, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("gamma", [1, 4, 7])
def test_speculative_greedy_on_a_prepacked_pair_is_the_targets_greedy(gamma: int) -> None:
    target = random_model(seed=3)
    draft_config = dataclasses.replace(CONFIG, n_layers=1)
    draft = random_model(draft_config, seed=4)
    for model in (target, draft):
        assert prepack_linears(model) > 0
    prompt = [5, 17, 42, 7]
    expected = autoregressive_generate(target, prompt, 40, temperature=0.0).tokens
    got = speculative_generate(target, draft, prompt, 40, gamma=gamma, temperature=0.0).tokens
    assert len(expected) == 40
    assert got == expected


@needs_onednn
def test_a_prepacked_model_is_not_saved_with_layers_missing(tmp_path) -> None:
    model = random_model()
    save_model(model, tmp_path / "plain")  # the whole model: fine
    prepack_linears(model)
    with pytest.raises(ValueError, match="prepacked"):
        save_model(model, tmp_path / "packed")
