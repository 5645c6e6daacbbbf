"""A GGUF file's own codes (weights/gguf_blocks.py, GGUFFile.codes) against the gguf package's
dequantizer, and the int4 layer over them (model/scale/codes.py) against a product written here.

The oracle is gguf.quants: the file's blocks dequantized by llama.cpp's Python reader must equal
scale * code + zero exactly, and the int4 layer must multiply by those same numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model.scale.codes import GROUP, GroupCodes, dequantize, int4_layer
from tests.weights.test_gguf import SMALL, byte_level_vocab, write_gguf
from weights.gguf import GGUFFile
from weights.gguf_blocks import block_codes

gguf = pytest.importorskip("gguf")


@pytest.fixture
def gpt2_vocab() -> dict:
    """A byte-level vocabulary for the test files (tests/weights/test_gguf.py's)."""
    return byte_level_vocab()


Q = gguf.GGMLQuantizationType


def quantized(kind: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    weight = np.random.default_rng(seed).normal(0, 0.3, shape).astype(np.float32)
    return gguf.quants.quantize(weight, Q[kind])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_codes_are_the_files_numbers(kind):
    blocks = quantized(kind, (6, 96))
    codes = block_codes(blocks, kind, (6, 96))
    want = torch.from_numpy(gguf.quants.dequantize(blocks, Q[kind]).reshape(6, 96))
    assert torch.equal(dequantize(codes), want)
    assert codes.codes.dtype == torch.int8 and codes.scale.shape == (6, 96 // GROUP)
    low, high = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q8_0": (-128, 127)}[kind]
    assert low <= int(codes.codes.min()) and int(codes.codes.max()) <= high


def test_nibble_order_is_checked():
    """Swapping a 4-bit block's halves (inputs 16..31 read first) must break the equality above."""
    blocks = quantized("Q4_1", (2, 64))
    codes = block_codes(blocks, "Q4_1", (2, 64))
    swapped = GroupCodes(
        codes.codes.view(2, 2, 2, 16).flip(2).reshape(2, 64),
        codes.scale,
        codes.zero,
        4,
        "Q4_1",
    )
    want = torch.from_numpy(gguf.quants.dequantize(blocks, Q["Q4_1"]).reshape(2, 64))
    assert not torch.equal(dequantize(swapped), want)


def test_refused_kinds_and_sizes():
    with pytest.raises(ValueError, match="Q4_K blocks are not read as codes"):
        block_codes(np.zeros(144, np.uint8), "Q4_K", (1, 256))
    with pytest.raises(ValueError, match="cannot hold"):
        block_codes(quantized("Q8_0", (2, 64))[:1], "Q8_0", (2, 64))
    with pytest.raises(ValueError, match="do not split"):
        block_codes(np.zeros(34, np.uint8), "Q8_0", (1, 48))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_layer_multiplies_by_the_codes(kind, dtype):
    blocks = quantized(kind, (64, 128), seed=1)
    codes = block_codes(blocks, kind, (64, 128))
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, Q[kind]).reshape(64, 128))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    got = int4_layer(codes, dtype)(x.to(dtype)).float()
    want = F.linear(x.to(dtype).float(), weight)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got, want, atol=tol * want.abs().max(), rtol=0), (got - want).abs().max()
    # the layer must not be multiplying by the shifted codes without their zero
    wrong = F.linear(
        x, (codes.codes.float().view(64, 4, GROUP) * codes.scale[..., None]).view(64, 128)
    )
    if kind == "Q4_1":
        assert not torch.allclose(got, wrong, atol=tol * want.abs().max(), rtol=0)


def test_int4_layer_refuses_8_bit_codes_and_other_dtypes():
    codes = block_codes(quantized("Q8_0", (4, 64)), "Q8_0", (4, 64))
    with pytest.raises(ValueError, match="not 4-bit"):
        int4_layer(codes, torch.float32)
    four = block_codes(quantized("Q4_0", (4, 64)), "Q4_0", (4, 64))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        int4_layer(four, torch.float16)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_file_codes_equal_its_tensors(tmp_path, gpt2_vocab, kind):
    """GGUFFile.codes gives every quantized matrix under its HF name, q/k rows in the order
    GGUFFile.tensors (checked against transformers in test_gguf.py) puts them."""
    path = tmp_path / f"tiny-{kind}.gguf"
    write_gguf(path, shape=SMALL, tokenizer=gpt2_vocab, qtype=kind)
    file = GGUFFile(path)
    codes, tensors = file.codes(), file.tensors()
    matrices = {n for n, t in tensors.items() if t.dim() == 2}
    assert set(codes) == matrices
    for name, c in codes.items():
        assert torch.equal(dequantize(c), tensors[name]), name
    four_bit = file.four_bit_shapes()
    assert four_bit == (
        {} if kind == "Q8_0" else {n: c.shape for n, c in codes.items() if ".layers." in n}
    )
