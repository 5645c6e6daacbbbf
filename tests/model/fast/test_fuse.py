"""Stacked projections (model/fast/fuse.py): the same logits and generations with fewer products.

Stacking q/k/v and gate/up computes the same dot products, so a fused model must agree
with the plain one to rounding (to 1e-12 in float64), cached and uncached, with grouped-
query heads, and the comparison must see a wrongly stacked matrix.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from model import Llama, ModelConfig
from model.call import chain
from model.fast.fuse import fuse_projections
from model.fast.prepack import prepack_linears, prepack_supported
from model.scale.quantize import Int4Linear, Int8Linear, quantize_int4
from speculative import autoregressive_generate, speculative_generate
from tests.support.hf import randomize_
from weights import save_model

# Grouped-query attention (6 query heads, 2 KV heads), so that the split of the stack matters.
CONFIG = ModelConfig(
    dim=384, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=512, hidden_dim=1024, max_seq_len=64
)


def random_model(
    config: ModelConfig = CONFIG, seed: int = 0, dtype: torch.dtype = torch.float64
) -> Llama:
    """Weights N(0, 0.08), sharper than init, so that logits spread and disagreements show."""
    return randomize_(Llama(config), seed=seed, std=0.08).to(dtype).eval()


def max_difference(a: Llama, b: Llama, tokens: torch.Tensor) -> float:
    """Largest logit difference over an uncached forward and a cached prefill + verification + steps."""
    with torch.inference_mode():
        worst = (a(tokens) - b(tokens)).abs().max().item()
        for model in (a, b):
            model.setup_cache(tokens.shape[0], CONFIG.max_seq_len)
        for start, end in ((0, 30), (30, 35), (35, 36), (36, 40)):
            call = chain(start, end - start, tokens.device, rows=tokens.shape[0])
            worst = max(
                worst,
                (a(tokens[:, start:end], call) - b(tokens[:, start:end], call)).abs().max().item(),
            )
    return worst


TOKENS = torch.randint(0, CONFIG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))


def test_fused_logits_equal_plain_ones() -> None:
    plain = random_model()
    fused = copy.deepcopy(plain)
    # one attention and one MLP group per block
    assert fuse_projections(fused) == 2 * CONFIG.n_layers
    attention, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert attention.q_proj is None and attention.k_proj is None and mlp.gate_proj is None
    assert attention.qkv_proj.weight.shape == ((6 + 2 * 2) * CONFIG.head_dim, CONFIG.dim)
    assert attention.qkv_heads == (6, 2)
    with torch.inference_mode():
        assert plain(TOKENS).abs().max() > 1.0
    assert max_difference(plain, fused, TOKENS) < 1e-12
    # the cache reads the KV head count from the stack
    assert fused.layers[0].self_attn.cache.k.shape[1] == 2
    assert fuse_projections(fused) == 0  # nothing left to fuse


@pytest.mark.parametrize("swap", ["k and v", "gate and up"])
def test_the_comparison_sees_a_wrong_stack(swap: str) -> None:
    """Stacking in the wrong order (k where v belongs, up where gate belongs) is caught."""
    plain = random_model()
    fused = copy.deepcopy(plain)
    fuse_projections(fused)
    kv_rows = CONFIG.n_kv_heads * CONFIG.head_dim
    with torch.no_grad():
        if swap == "k and v":
            w = fused.layers[1].self_attn.qkv_proj.weight
            k, v = w[-2 * kv_rows : -kv_rows].clone(), w[-kv_rows:].clone()
            w[-2 * kv_rows : -kv_rows], w[-kv_rows:] = v, k
        else:
            w = fused.layers[1].mlp.gate_up_proj.weight
            w.copy_(torch.cat(w.chunk(2)[::-1]))
    assert max_difference(plain, fused, TOKENS) > 1e-3


def test_only_plain_layers_are_stacked() -> None:
    model = random_model(dtype=torch.float32)
    model.layers[0].self_attn.k_proj = nn.Linear(
        CONFIG.dim, CONFIG.n_kv_heads * CONFIG.head_dim, bias=True
    )
    second = model.layers[1]  # int8 layers are not plain nn.Linear
    second.self_attn.q_proj = Int8Linear.from_float(second.self_attn.q_proj.weight.detach())
    second.mlp.up_proj = Int8Linear.from_float(second.mlp.up_proj.weight.detach())
    assert fuse_projections(model) == 1  # only the first block's MLP
    assert getattr(model.layers[0].mlp, "gate_up_proj", None) is not None
    assert getattr(model.layers[0].self_attn, "qkv_proj", None) is None
    assert (
        getattr(second.self_attn, "qkv_proj", None) is None
        and getattr(second.mlp, "gate_up_proj", None) is None
    )


@pytest.mark.skipif(
    not prepack_supported(), reason="this PyTorch build lacks the oneDNN prepacking operators"
)
def test_fused_then_prepacked_float32_logits_equal_plain_ones() -> None:
    plain = random_model(dtype=torch.float32)
    fast = copy.deepcopy(plain)
    fuse_projections(fast)
    # qkv (640 x 384), o, gate_up (2048 x 384) and down per block, and the head
    assert prepack_linears(fast) == 2 * 4 + 1
    assert max_difference(plain, fast, TOKENS) < 1e-4


@pytest.mark.parametrize("gamma", [1, 4, 7])
def test_speculative_greedy_on_a_fused_pair_is_the_targets_greedy(gamma: int) -> None:
    target = random_model(seed=3)
    draft = random_model(dataclasses.replace(CONFIG, n_layers=1), seed=4)
    prompt = [5, 17, 42, 7]
    expected = autoregressive_generate(target, prompt, 40, temperature=0.0).tokens
    for model in (target, draft):
        assert fuse_projections(model) > 0
    got = speculative_generate(target, draft, prompt, 40, gamma=gamma, temperature=0.0).tokens
    assert len(expected) == 40
    assert got == expected


def test_a_fused_model_is_not_saved(tmp_path) -> None:
    model = random_model(dtype=torch.float32)
    fuse_projections(model)
    with pytest.raises(ValueError, match="stacked"):
        save_model(model, tmp_path / "fused")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_layers_stack_to_the_same_logits(dtype) -> None:
    """int4 projections (model/scale/quantize.py) stack too: the packed rows and scales concatenate.
    The kernel computes each output row alone, so the stacked model's logits are the unstacked
    one's exactly; a stack whose scales were put in the wrong order must not be."""
    plain = random_model(dtype=torch.float32)
    quantize_int4(plain)
    plain = plain.to(dtype)
    stacked = copy.deepcopy(plain)
    assert fuse_projections(stacked) == 2 * CONFIG.n_layers
    assert isinstance(stacked.layers[0].self_attn.qkv_proj, Int4Linear)
    tokens = TOKENS[:1]
    assert max_difference(plain, stacked, tokens) == 0.0
    qkv = stacked.layers[0].self_attn.qkv_proj
    n_q = CONFIG.dim
    qkv.scales_and_zeros = torch.cat(
        [qkv.scales_and_zeros[:, n_q:], qkv.scales_and_zeros[:, :n_q]], dim=1
    )
    assert max_difference(plain, stacked, tokens) > 0.1


def test_int4_layers_of_other_groups_do_not_stack() -> None:
    layers = [Int4Linear.from_float(torch.randn(32, 64), g) for g in (32, 64)]
    with pytest.raises(ValueError, match="one input size, group size and dtype"):
        Int4Linear.stacked(layers)
