"""What one linear layer costs on this CPU for 1..8 input rows, with PyTorch's default
matmul and with the weight reordered once for oneDNN (model/fast/prepack.py).

    python -m benchmarks.matmul_rows              # prints a markdown table (float32)
    python -m benchmarks.matmul_rows --dtypes float32 bfloat16 float16 --threads 2

Speculative decoding assumes that verifying gamma + 1 tokens costs about one decode step.
This shows whether the machine's matmul honours that: a decode step multiplies one row,
a verification gamma + 1 rows, by the same weights. Shapes: the shipped target's MLP
(1024 x 384) and a Llama-2-7B projection (4096 x 4096). Medians of many calls; run it on a
quiet machine. A dtype oneDNN cannot prepack on this CPU (float16 without AVX-512 FP16 or AMX,
bfloat16 without native bf16) gets "–" in the prepacked columns.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import machine_line, script_parser, time_call
from model.fast.prepack import PrepackedLinear, prepack_supported
from model.scale.quantize import Int4Linear, Int8Linear, quantize_weight


def median_us(layer, x: torch.Tensor, calls: int) -> float:
    """Median microseconds of layer(x), after a warm-up of a twentieth as many calls (3 at least)."""
    return time_call(lambda: layer(x), calls, warmup=max(3, calls // 20)).median * 1e6


def quantized(name: str, weight: torch.Tensor) -> tuple[Any, Any]:
    """The weight-only layers of ``name``: (the project's layer, torch's int8 kernel or None)."""
    if name == "int4":
        return Int4Linear.from_float(weight, 32), None
    q, scale = quantize_weight(weight)
    return Int8Linear(q, scale), lambda x: torch.ops.aten._weight_int8pack_mm(
        x.reshape(-1, x.shape[-1]), q, scale
    )


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("matmul_rows", __doc__)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1, 2, 5, 8], help="input rows (default 1 2 5 8)"
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16", "float16", "int8", "int4"],
        help="weight and input dtypes (default float32); int8 and int4 are weight-only with float32 "
        "inputs: int8's default column dequantizes per call (model.scale.quantize.Int8Linear) and "
        "its prepacked column is torch's int8 kernel; int4 is torch's packed int4 kernel "
        "(Int4Linear, groups of 32)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{machine_line(args.threads)}; microseconds per call (median)\n")
    print(
        "| weight [out x in] | dtype | rows | PyTorch default | prepacked | default / one row | "
        "prepacked / one row |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features, calls in ((1024, 384, 2000), (4096, 4096, 60)):
        for name in args.dtypes:
            dtype = torch.float32 if name in ("int8", "int4") else getattr(torch, name)
            weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
            plain, packed = (
                quantized(name, weight)
                if name in ("int8", "int4")
                else (
                    partial(F.linear, weight=weight),
                    PrepackedLinear(weight) if prepack_supported(dtype) else None,
                )
            )
            first: tuple[float, float | None] | None = None
            with torch.inference_mode():
                for rows in args.rows:
                    x = torch.randn(1, rows, in_features, generator=generator).to(dtype)
                    plain_us = median_us(plain, x, calls)
                    packed_us = median_us(packed, x, calls) if packed else None
                    first = first or (plain_us, packed_us)
                    packed_cell, packed_ratio = (
                        (f"{packed_us:.1f}", f"{packed_us / first[1]:.2f}")
                        if packed_us
                        else ("–", "–")
                    )
                    print(
                        f"| {out_features} x {in_features} | {name} | {rows} | {plain_us:.1f} | {packed_cell} | "
                        f"{plain_us / first[0]:.2f} | {packed_ratio} |"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
