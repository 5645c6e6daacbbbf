"""The integer codes of a GGUF tensor as the file stores them, not dequantized.

A quantized GGUF tensor is a run of blocks, each covering 32 consecutive inputs of one output row and
holding a float16 scale ``d`` (and for Q4_1 a float16 minimum ``m``) followed by the codes. llama.cpp
multiplies by exactly these numbers:

    Q4_0: 18 bytes   d, 16 bytes of nibbles q in 0..15        weight = d * (q - 8)
    Q4_1: 20 bytes   d, m, 16 bytes of nibbles q in 0..15     weight = d * q + m
    Q8_0: 34 bytes   d, 32 signed bytes q in -128..127        weight = d * q

In a 4-bit block, byte j holds input j in its low nibble and input j + 16 in its high nibble.

:func:`block_codes` turns such blocks into one layout for all three, ``weight = scale * code + zero``
per group of 32 inputs: ``code`` as int8 (Q4_0's q - 8, Q4_1's q, Q8_0's q), ``scale`` and ``zero`` as
float32 (zero is 0 for the symmetric kinds). float16 to float32 is exact, so these are the file's own
numbers; model.scale.codes.dequantize multiplies them out (the gguf package's dequantizer is the independent
check in the tests). K-quants pack several scales per block in 6-bit fields: they stay dequantized.
"""

from __future__ import annotations

import numpy as np
import torch

from model.scale.codes import GROUP, GroupCodes

# kind name -> (bytes per block, has a minimum, bits per code)
LAYOUTS = {
    "Q4_0": (2 + GROUP // 2, False, 4),
    "Q4_1": (4 + GROUP // 2, True, 4),
    "Q8_0": (2 + GROUP, False, 8),
}


def block_codes(data: np.ndarray, kind: str, shape: tuple[int, int]) -> GroupCodes:
    """The codes of a tensor of ``shape`` [out, in] stored as ``kind`` blocks (``data``: its bytes as
    uint8, any shape). Raises ValueError for another kind or a size that does not fit."""
    if kind not in LAYOUTS:
        raise ValueError(f"{kind} blocks are not read as codes (only {', '.join(LAYOUTS)})")
    size, has_min, bits = LAYOUTS[kind]
    out, inputs = shape
    if inputs % GROUP:
        raise ValueError(f"{inputs} inputs do not split into blocks of {GROUP}")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    count = out * inputs // GROUP
    if blocks.size != count * size:
        raise ValueError(
            f"{blocks.size} bytes of {kind} cannot hold a [{out}, {inputs}] tensor "
            f"({count} blocks of {size} bytes)"
        )
    blocks = blocks.reshape(count, size)
    scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    start = 2
    zero = np.zeros_like(scale)
    if has_min:
        zero = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        start = 4
    payload = blocks[:, start:]
    if bits == 8:
        codes = payload.copy().view(np.int8)
    else:
        low, high = payload & 0x0F, payload >> 4  # inputs 0..15, then 16..31
        codes = np.concatenate([low, high], axis=1).astype(np.int8)
        if kind == "Q4_0":
            codes -= 8
    groups = inputs // GROUP
    return GroupCodes(
        torch.from_numpy(codes.reshape(out, inputs)),
        torch.from_numpy(scale.reshape(out, groups)),
        torch.from_numpy(zero.reshape(out, groups)),
        bits,
        kind,
    )
