"""Weight-only int8 and int4: exact per-layer error bounds, the CPU kernels against the dequantised
products, whole-model closeness, memory, and speculation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model import Llama, ModelConfig
from model.call import chain
from model.scale.quantize import (
    QMAX,
    Int4Linear,
    Int8Linear,
    dequantize_int4_weight,
    dequantize_weight,
    max_abs_error_bound,
    quantize_int4,
    quantize_int4_weight,
    quantize_int8,
    quantize_weight,
)
from model.scale.tensor_parallel import weight_bytes
from speculative import autoregressive_generate, speculative_generate

CONFIG = ModelConfig(
    vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=160, max_seq_len=64
)
DRAFT = ModelConfig(
    vocab_size=96, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64, max_seq_len=64
)
PROMPT = [1, 4, 9, 16, 25, 36, 49]
# Whole-model bound on max |logits(int8) - logits(float32)|, as a fraction of the logits'
# standard deviation. Rounding moves each weight uniformly within +-s/2 with s = absmax/127,
# a standard deviation of absmax/(127*sqrt(12)); Kaiming-uniform rows have absmax =
# sqrt(3)*sigma, so each linear's output carries relative noise 1/254 = 0.4%, and residual
# connections and RMSNorm keep the logits' error at that order. Measured on this config
# over five seeds: 0.62% to 0.73%. 2.5% is 3.5 times the worst seed, while a real bug
# fails it: scales applied to the wrong rows give 3.7%, 4-bit rounding 17%.
LOGIT_BOUND = 0.025


def random_model(config: ModelConfig, seed: int, dtype: torch.dtype = torch.float32) -> Llama:
    torch.manual_seed(seed)
    return Llama(config).to(dtype).eval()


def test_quantize_weight_rounds_each_weight_by_at_most_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 80) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different magnitude
    w[5] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert q.abs().max().item() == QMAX
    nonzero = torch.arange(48) != 5
    assert (q[nonzero].abs().amax(1) == QMAX).all()  # each row's largest weight maps onto +-127
    err = (dequantize_weight(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert (q[5] == 0).all()


def test_int8_linear_stays_within_the_analytic_bound() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(128, 72, bias=False)
    x = torch.randn(3, 5, 128)
    layer = Int8Linear.from_float(linear.weight.detach())
    with torch.no_grad():
        err = (layer(x) - linear(x)).abs()
    bound = max_abs_error_bound(x, layer.scale)
    assert (err <= bound + 1e-5).all()
    assert err.max() > 0  # it really is quantized


def test_int8_halves_the_bytes_of_bfloat16_block_weights() -> None:
    model = random_model(CONFIG, 0, torch.bfloat16)
    before = sum(
        p.numel() * 2
        for n, p in model.named_parameters()
        if n.startswith("layers.") and "proj" in n
    )
    total_before = weight_bytes(model)
    quantize_int8(model)
    linears = [m for m in model.layers.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 7 * CONFIG.n_layers
    assert not any(type(m) is nn.Linear for m in model.layers.modules())
    after = sum(m.weight.numel() + m.scale.numel() * 2 for m in linears)
    assert all(m.weight.dtype == torch.int8 and m.scale.dtype == torch.bfloat16 for m in linears)
    assert after < 0.52 * before  # 1 byte instead of 2, plus one bf16 scale per output row
    assert weight_bytes(model) == total_before - before + after
    assert model.lm_head.weight.dtype == torch.bfloat16  # kept by default


def test_int8_logits_close_to_float32() -> None:
    model = random_model(CONFIG, 2)
    tokens = torch.tensor([PROMPT * 3])
    with torch.inference_mode():
        reference = model(tokens)
        quantized = quantize_int8(random_model(CONFIG, 2))(tokens)
    diff = (quantized - reference).abs().max().item()
    assert 0 < diff < LOGIT_BOUND * reference.std().item()


def test_int8_with_cache_and_lm_head() -> None:
    model = quantize_int8(random_model(CONFIG, 3), include_lm_head=True)
    assert isinstance(model.lm_head, Int8Linear)
    tokens = torch.tensor([PROMPT])
    with torch.inference_mode():
        full = model(tokens)
        model.setup_cache(1, 16)  # counts KV heads from k_proj.weight, which Int8Linear keeps
        cached = torch.cat(
            [
                model(tokens[:, :4], chain(0, 4, "cpu")),
                model(tokens[:, 4:], chain(4, tokens.shape[1] - 4, "cpu")),
            ],
            dim=1,
        )
    assert (cached - full).abs().max().item() < 1e-4


def test_tied_head_is_never_quantized() -> None:
    config = ModelConfig(
        vocab_size=96,
        dim=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=2,
        hidden_dim=64,
        tie_word_embeddings=True,
    )
    model = quantize_int8(random_model(config, 4), include_lm_head=True)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_speculative_greedy_equals_target_greedy_under_int8() -> None:
    """Speculation stays lossless with a quantized pair: it reproduces the int8 target's own greedy output.

    float64 activations (the int8 weights dequantise exactly) remove rounding ties between
    the one-token and the gamma+1-token forward passes.
    """
    target = quantize_int8(random_model(CONFIG, 5, torch.float64))
    draft = quantize_int8(random_model(DRAFT, 6, torch.float64))
    with torch.inference_mode():
        alone = autoregressive_generate(target, PROMPT, 32, temperature=0.0).tokens
        spec = speculative_generate(target, draft, PROMPT, 32, gamma=4, temperature=0.0).tokens
    assert len(alone) == 32
    assert spec == alone


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_int8_bfloat16_logits() -> None:
    """On the GPU in bfloat16: int8 adds at most the quantization bound on top of bf16's own rounding."""
    tokens = torch.tensor([PROMPT * 3], device="cuda")
    with torch.inference_mode():
        reference = random_model(CONFIG, 7).cuda()(tokens)
        bf16 = random_model(CONFIG, 7, torch.bfloat16).cuda()
        bf16_logits = bf16(tokens)
        int8_logits = quantize_int8(bf16)(tokens)
    scale = reference.std().item()
    bf16_err = (bf16_logits - reference).abs().max().item()
    assert (int8_logits - reference).abs().max().item() < LOGIT_BOUND * scale + bf16_err
    assert math.isfinite(bf16_err)


def test_functional_form_matches_dequantised_matmul() -> None:
    """Scaling the output equals multiplying by the dequantised matrix (the scale factors out)."""
    torch.manual_seed(8)
    w, x = torch.randn(40, 24, dtype=torch.float64), torch.randn(6, 24, dtype=torch.float64)
    q, s = quantize_weight(w)
    assert torch.allclose(Int8Linear(q, s)(x), F.linear(x, dequantize_weight(q, s)), atol=1e-12)


def test_int4_codes_stand_for_each_weight_within_half_a_step() -> None:
    torch.manual_seed(10)
    w = torch.randn(24, 64) * torch.linspace(0.1, 3, 64)  # groups of very different spans
    codes, scale, zero = quantize_int4_weight(w, 32)
    assert codes.dtype == torch.int32 and int(codes.min()) == 0 and int(codes.max()) == 15
    assert scale.shape == zero.shape == (24, 2)
    step = scale.repeat_interleave(32, 1)
    assert ((dequantize_int4_weight(codes, scale, zero) - w).abs() <= step / 2 * (1 + 1e-5)).all()
    # each group's smallest and largest weight are codes 0 and 15 exactly
    groups = w.reshape(24, 2, 32)
    assert torch.allclose(zero - 8 * scale, groups.amin(-1), atol=1e-6)
    assert torch.allclose(zero + 7 * scale, groups.amax(-1), atol=1e-5)
    with pytest.raises(ValueError, match="groups of 32"):
        quantize_int4_weight(torch.randn(4, 40), 32)


def test_int4_linear_is_its_dequantised_matmul() -> None:
    """torch's packed int4 kernel computes x @ dequantised^T: one group's codes, scales and zeros
    each in their place (a layer whose groups were swapped, or whose zero were left out, is far off)."""
    torch.manual_seed(11)
    w, x = torch.randn(96, 128), torch.randn(3, 7, 128)
    codes, scale, zero = quantize_int4_weight(w, 32)
    layer = Int4Linear(codes, scale, zero)
    reference = x.double() @ dequantize_int4_weight(codes, scale, zero).double().t()
    got = layer(x)
    assert got.shape == (3, 7, 96)
    assert (got.double() - reference).abs().max() <= 1e-5 * reference.abs().max()
    swapped = x.double() @ dequantize_int4_weight(codes, scale.flip(1), zero.flip(1)).double().t()
    assert (
        swapped - reference
    ).abs().max() > 0.05 * reference.abs().max()  # what the check would catch
    with pytest.raises(TypeError, match="computes torch.float32 on a CPU, got torch.bfloat16"):
        layer(x.bfloat16())


def test_int4_linear_in_bfloat16_is_its_dequantised_matmul_to_bfloat16_rounding() -> None:
    """.to(torch.bfloat16) rounds the scales and zeros; the layer then takes bfloat16 inputs and its
    output is the matmul with those scales and zeros to bfloat16's rounding (2^-8 relative), where
    a layer with its groups swapped is far off."""
    torch.manual_seed(12)
    w, x = torch.randn(96, 128), torch.randn(3, 7, 128).bfloat16()
    codes, scale, zero = quantize_int4_weight(w, 32)
    layer = Int4Linear(codes, scale, zero).to(torch.bfloat16)
    assert layer.scales_and_zeros.dtype == torch.bfloat16 and layer.weight.dtype == torch.uint8
    rounded = scale.bfloat16().float(), zero.bfloat16().float()
    reference = x.double() @ dequantize_int4_weight(codes, *rounded).double().t()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 7, 96)
    assert float((got.double() - reference).norm() / reference.norm()) < 2**-8
    swapped = (
        x.double()
        @ dequantize_int4_weight(codes, rounded[0].flip(1), rounded[1].flip(1)).double().t()
    )
    assert float((swapped - reference).norm() / reference.norm()) > 0.05
    with pytest.raises(TypeError, match="computes torch.bfloat16 on a CPU, got torch.float32"):
        layer(x.float())


def test_speculative_greedy_equals_target_greedy_under_int4() -> None:
    """A pair with int4 blocks is another target; speculation reproduces that target's greedy output."""
    target = quantize_int4(random_model(CONFIG, 5))
    draft = quantize_int4(random_model(DRAFT, 6))
    assert sum(isinstance(m, Int4Linear) for m in target.modules()) == 2 * 7
    with torch.inference_mode():
        alone = autoregressive_generate(target, PROMPT, 32, temperature=0.0).tokens
        spec = speculative_generate(target, draft, PROMPT, 32, gamma=4, temperature=0.0).tokens
    assert spec == alone
