"""The memory limit of a decode step: how fast this machine reads memory, and each set-up's
one-token step as a share of what reading its own weights at that speed would take.

    python -m benchmarks.limit --target SMOLLM2_GGUF_OR_FOLDER --threads 1 2 --out docs/results/limit_smollm2_zen4.md
    python -m benchmarks.limit --target tiny-target --threads 1 --rounds 1      # a smoke run

Why this is the yardstick. A step at one token multiplies every weight once by one row: two
flops per weight read, far too few for the arithmetic units to be what waits, so on a CPU the
step is bound by how fast memory streams the weights in. The fastest a step can be is its bytes
over the machine's read bandwidth; whatever it takes beyond that is overhead (operations that
read or write activations, launches, copies, Python) that a faster step must remove. A
verification of a few tokens reads the same weights, so its time should stay close to one
step's: the table shows the call of 5 tokens beside it.

What is measured, at each ``--threads`` count:

* **bandwidth**: a sum over a float32 buffer as large as the target's float32 weights (read once,
  nothing written back), the best of ``--rounds`` medians;
* **each set-up's step**: the target as generate.py sets it up (projections stacked, large weights
  prepacked for oneDNN), in float32, and in bfloat16 where oneDNN computes it natively on this
  CPU (model.fast.prepack.prepack_supported), and the compiled float32 steps where the compiled
  step cache holds them for widths 1 and 5 (``--compiled GAMMA``, as benchmarks/widths.py);
  milliseconds per call at 1 and at 5 tokens after 100 cached, the best of ``--rounds`` medians;
* **bytes**: what a one-token step reads of its weights: every parameter once (a weight shared by
  the embedding and the output head counted once; an embedding table of its own only one row);
* **share of the limit**: (bytes / bandwidth) / the step's time: 100% is a step that does nothing
  but read its weights.

Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.harness import (
    command_line,
    machine_line,
    markdown_table,
    page_head,
    script_parser,
    time_call,
    write_page,
)
from benchmarks.widths import MAX_WIDTH, START, compiled_targets, ms_per_call, prepared
from model.fast.prepack import prepack_supported
from model.scale.quantize import Int4Linear
from weights import StepCache, load_model
from weights.reading import file_reading
from weights.sharded import load_model_tp

VERIFY_WIDTH = 5  # a verification of 4 drafted tokens
TITLE = "A decode step against the memory limit"


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a one-token step reads of ``model``'s weights: each parameter once (a tied weight
    once), the codes, scales and zeros of int4 layers, an embedding table that is not also the
    output head one row only."""
    seen: set[int] = set()
    total = 0
    codes = [
        t
        for m in model.modules()
        if isinstance(m, Int4Linear)
        for t in (m.weight, m.scales_and_zeros)
    ]
    for parameter in [p for _, p in model.named_parameters()] + codes:
        if parameter.data_ptr() in seen:
            continue
        seen.add(parameter.data_ptr())
        total += parameter.numel() * parameter.element_size()
    embedding = getattr(model, "embed_tokens", None)
    output = getattr(model, "lm_head", None)
    if embedding is not None and (
        output is None or output.weight.data_ptr() != embedding.weight.data_ptr()
    ):
        weight = embedding.weight
        total -= (weight.shape[0] - 1) * weight.shape[1] * weight.element_size()
    return total


def read_bandwidth(nbytes: int, rounds: int) -> float:
    """Bytes per second of a sum over a float32 buffer of ``nbytes``: the best of ``rounds``
    medians of 5 sums, after one untimed. A lower bound of what the machine can read: a product
    with many independent streams of loads may read faster (a share of the limit over 100%)."""
    buffer = torch.ones(max(nbytes // 4, 1))
    best = 0.0
    for _ in range(rounds):
        seconds = time_call(lambda: buffer.sum(), 5, warmup=1).median
        best = max(best, buffer.numel() * 4 / seconds)
    return best


def step_ms(models: dict[str, Any], rounds: int) -> dict[tuple[str, int], float]:
    """Each model's call at 1 and VERIFY_WIDTH tokens: the lowest of ``rounds`` medians over
    enough calls for about 0.2 s."""
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, model in models.items():
                calls = max(3, int(0.2 / (ms_per_call(model, 1, 2) / 1e3)))
                for width in (1, VERIFY_WIDTH):
                    ms = ms_per_call(model, width, calls)
                    best[name, width] = min(ms, best.get((name, width), ms))
    return best


def set_ups(args: argparse.Namespace) -> dict[str, tuple[torch.dtype, Any]]:
    """The target in each set-up this machine runs, with its weights' dtype: float32, bfloat16
    where oneDNN computes it natively, and the compiled float32 steps where the cache has them."""
    models = {
        "float32, stacked and prepacked": (
            torch.float32,
            prepared(args.target, torch.float32, True, True, VERIFY_WIDTH),
        )
    }
    if prepack_supported(torch.bfloat16):
        models["bfloat16, stacked and prepacked"] = (
            torch.bfloat16,
            prepared(args.target, torch.bfloat16, True, True, VERIFY_WIDTH),
        )
    codes = file_reading(args.target, StepCache()) is not None  # a 4-bit GGUF: its codes too
    if codes:
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{str(dtype).removeprefix('torch.')} with the file's 4-bit codes, stacked"
            models[name] = (dtype, prepared(args.target, dtype, True, True, VERIFY_WIDTH, "file"))
    if args.compiled is not None:
        compiled, built = compiled_targets(
            argparse.Namespace(target=args.target, compiled=args.compiled, dtypes=["float32"]),
            START + MAX_WIDTH + VERIFY_WIDTH,
        )
        if codes:
            more, _ = compiled_targets(
                argparse.Namespace(
                    target=args.target,
                    compiled=args.compiled,
                    dtypes=["bfloat16"],
                    quantize="file",
                ),
                START + MAX_WIDTH + VERIFY_WIDTH,
            )
            compiled.update(more)
        if VERIFY_WIDTH in built:
            models.update({name: (m.dtype, m) for name, m in compiled.items()})
        else:
            print(
                f"the compiled steps of --gamma {args.compiled} have no call of {VERIFY_WIDTH} "
                "tokens: left out",
                file=sys.stderr,
            )
    return models


def table(args: argparse.Namespace) -> list[str]:
    plain = load_model(args.target, dtype=torch.float32)
    float32_bytes = weight_bytes(plain)
    del plain
    lines = [f"Target `{args.target}`, {float32_bytes / 1e6:.0f} MB of float32 weights a step."]
    # a 4-bit file's codes as loaded, before any set-up packs them out of sight
    codes_bytes = {}
    if file_reading(args.target, StepCache()) is not None:
        for dtype in (torch.float32, torch.bfloat16):
            codes_bytes[dtype] = weight_bytes(
                load_model_tp(args.target, dtype=dtype, quantize="file")
            )
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth = read_bandwidth(float32_bytes, args.rounds)
        models = set_ups(args)
        times = step_ms({name: model for name, (_, model) in models.items()}, args.rounds)
        rows = []
        for name, (dtype, model) in models.items():
            nbytes = float32_bytes * dtype.itemsize // 4
            if any(isinstance(m, Int4Linear) for m in model.modules()):
                nbytes = codes_bytes[dtype]
            limit_ms = nbytes / bandwidth * 1e3
            one, verify = times[name, 1], times[name, VERIFY_WIDTH]
            rows.append(
                [
                    name,
                    f"{nbytes / 1e6:.0f}",
                    f"{limit_ms:.2f}",
                    f"{one:.2f}",
                    f"{limit_ms / one:.0%}",
                    f"{verify:.2f} ({verify / one:.2f})",
                ]
            )
        lines += [
            "",
            f"**{threads} thread{'s' if threads > 1 else ''}**: {machine_line(threads)}; reading "
            f"memory at {bandwidth / 1e9:.1f} GB/s (a sum over {float32_bytes / 1e6:.0f} MB).",
            "",
            *markdown_table(
                [
                    "set-up",
                    "MB read a step",
                    "limit, ms",
                    "ms a step",
                    "share of the limit",
                    f"ms a call of {VERIFY_WIDTH} tokens (in steps)",
                ],
                rows,
                "lrrrrr",
            ),
        ]
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = script_parser("limit", __doc__)
    parser.add_argument(
        "--target",
        default="tiny-target",
        help="registry name, folder or GGUF (default tiny-target)",
    )
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[1, 2], help="torch threads (default: 1 2)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds; the best is kept (default 3)"
    )
    parser.add_argument(
        "--compiled",
        type=int,
        metavar="GAMMA",
        help="also the compiled float32 steps of generate.py --compile --gamma GAMMA, from the cache",
    )
    parser.add_argument("--out", default="", help="write the table as a page here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or any(t < 1 for t in args.threads):
        parser.error("--rounds and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    lines = table(args)
    print("\n".join(lines))
    if args.out:
        write_page(args.out, "\n".join(page_head(TITLE, command_line("limit", argv)) + lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
