"""A weight kept as a file's own integer codes (weights/gguf_blocks.py reads them), and the layer that
multiplies by 4-bit ones.

A 4-bit GGUF file (Q4_0, Q4_1) is how people keep a model on a CPU; llama.cpp multiplies by its codes
as stored. torch's packed int4 kernel (``Int4Linear``, model/scale/quantize.py) does the same here: it takes
codes 0..15 and one scale and zero per group with ``weight = (code - 8) * scale + zero``. A Q4_1
block's ``d * q + m`` is that with ``zero = m + 8 d``, a Q4_0 block's ``d * (q - 8)`` with ``zero = 0``.
It computes in float32 or bfloat16; where the CPU has bfloat16 instructions (AVX-512 BF16, AMX) the
bfloat16 kernel is the fast one, elsewhere it may lose to float32 by far
(docs/results/quantized_avx2_zen3.md).

Whether codes beat the file read as floats depends on the CPU: weights/reading.py times both on this
machine and records the answer once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.scale.quantize import INT4_DTYPES, Int4Linear

GROUP = 32  # inputs per block, for every kind here


@dataclass(frozen=True)
class GroupCodes:
    """A [out, in] weight as ``scale * code + zero``, one scale and zero per group of GROUP inputs.

    ``codes``: int8 [out, in]; ``scale``, ``zero``: float32 [out, in / GROUP]; ``bits``: 4 (codes in
    -8..15) or 8; ``kind``: the GGUF type it came from."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    kind: str

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def rows(self, order: torch.Tensor) -> GroupCodes:
        """The same weight with its output rows in ``order`` (groups run along the inputs, so a row
        keeps its own scales)."""
        return GroupCodes(
            self.codes[order].contiguous(),
            self.scale[order].contiguous(),
            self.zero[order].contiguous(),
            self.bits,
            self.kind,
        )


def dequantize(codes: GroupCodes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float [out, in] weight the codes stand for, computed in float32 as llama.cpp does."""
    out, inputs = codes.shape
    grouped = codes.codes.view(out, inputs // GROUP, GROUP).float()
    weight = grouped * codes.scale[..., None] + codes.zero[..., None]
    return weight.reshape(out, inputs).to(dtype)


# the lowest code of each 4-bit kind: Int4Linear wants codes 0..15
LOWEST_CODE = {"Q4_0": -8, "Q4_1": 0}


def int4_layer(codes: GroupCodes, dtype: torch.dtype) -> Int4Linear:
    """torch's packed int4 kernel over a 4-bit GGUF tensor's own codes, computing in ``dtype``.

    weight = scale * code + zero = (code' - 8) * scale + (zero + (lowest + 8) * scale), where
    code' = code - lowest lies in 0..15."""
    if codes.bits != 4 or codes.kind not in LOWEST_CODE:
        raise ValueError(f"{codes.kind} codes are not 4-bit codes torch's int4 kernel takes")
    if dtype not in INT4_DTYPES:
        raise ValueError(f"torch's int4 kernel computes in float32 or bfloat16, not {dtype}")
    lowest = LOWEST_CODE[codes.kind]
    shifted = codes.codes.to(torch.int32) - lowest
    zero = codes.zero + (lowest + 8) * codes.scale
    return Int4Linear(shifted, codes.scale, zero).to(dtype)
