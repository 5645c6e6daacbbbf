"""What one call of a target costs by its width, under each way the target can run: the cost side
of speculation on a step bound by reading the weights (a real model on a CPU), where a call of
several tokens can cost little more than one.

    python -m benchmarks.target_setups --target SMOLLM2_FOLDER_OR_GGUF --out docs/results/target_setups.md
    python -m benchmarks.target_setups --target tiny-target --widths 1 5 --rounds 3   # a smoke run

Set-ups: the weights as loaded (``plain``), q/k/v and gate/up stacked into one product each
(``stacked``, model/fast/fuse.py), stacked and reordered once for oneDNN (``prepacked``,
model/fast/prepack.py), each in float32 and in bfloat16 (another target unless the checkpoint is
stored in it: docs/compiled.md, "16 bits on a CPU"; prepacked only where oneDNN computes the dtype
natively); with ``--compiled GAMMA`` also the compiled steps of a speculative run with the target's
default drafter, which ``generate.py --target ... --compile --gamma GAMMA`` built into the
compiled-step cache (``SPECULATIVE_CACHE``), at the widths they were built for (1, 2 and GAMMA + 1:
model.fast.compile.decode_widths; a call of another width would be padded to the next), where they
measured faster than the eager set-up (with the features a head reads, which a plain call drops).
A call of w tokens after 100 cached ones; each figure is the median of enough calls for about
0.2 s, the lowest over ``--rounds`` rounds taken in turns (the VM's speed drifts), in
milliseconds and in one-token calls of the same set-up. Prints a markdown table and the
machine, and writes them as a page with --out; run it with nothing else on the machine.
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks.harness import (
    command_line,
    machine_line,
    markdown_table,
    page_head,
    script_parser,
    turn_order,
    write_page,
)
from benchmarks.step_times import START, ms_per_call
from model.fast.compile import decode_widths
from model.fast.fuse import prepare_for_decoding
from model.fast.prepack import prepack_supported
from speculative.inputs import GAMMA_MAX
from weights import StepCache, load_model, read_pair
from weights.load import default_draft

SETUPS = {"plain": (False, False), "stacked": (True, False), "prepacked": (True, True)}


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("target_setups", __doc__)
    parser.add_argument(
        "--target",
        default="tiny-target",
        help="registry name, folder or GGUF (default tiny-target)",
    )
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[1, 2, 4, 6, 8, 12, 16, 24],
        help="tokens per call (default 1 2 4 6 8 12 16 24)",
    )
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds taken in turns (default 5)")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)"
    )
    parser.add_argument(
        "--compiled",
        type=int,
        default=None,
        metavar="GAMMA",
        help="also the compiled steps of generate.py --compile --gamma GAMMA (the default drafter's "
        "run), from the cache",
    )
    parser.add_argument(
        "--out", default="", help="write the table as a page here (default: print only)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.threads < 1 or any(not 1 <= w <= 64 for w in args.widths):
        sys.exit("error: --rounds and --threads must be >= 1, --widths in 1..64")
    torch.set_num_threads(args.threads)
    models = {}
    for dtype in args.dtypes:
        for name, (stack, prepack) in SETUPS.items():
            if prepack and not prepack_supported(getattr(torch, dtype)):
                continue
            model = load_model(args.target, dtype=getattr(torch, dtype)).eval()
            prepare_for_decoding(model, stack=stack, prepack=prepack)
            model.setup_cache(1, START + 64 + max(args.widths))
            models[f"{name}, {dtype}"] = model
    widths = sorted(set(args.widths) | {1})
    only: dict[str, tuple[int, ...]] = {}  # set-ups timed at some widths only
    if args.compiled is not None:
        built = decode_widths(args.compiled, GAMMA_MAX)
        for dtype in args.dtypes:
            pair = read_pair(args.target, default_draft(args.target)).load(
                dtype=getattr(torch, dtype), prepare_models=False
            )
            pair, setups = pair.set_up(
                "default", built, START + 64 + max(widths), store=StepCache()
            )
            if setups.choices and setups.choices[0][1].chosen == "compiled":
                models[f"compiled, {dtype}"], only[f"compiled, {dtype}"] = pair.target, built
            else:
                print(
                    f"no compiled steps in the cache for {dtype}: run generate.py --target {args.target} "
                    f"--compile --gamma {args.compiled} --dtype {dtype} first",
                    file=sys.stderr,
                )
        widths = sorted(set(widths) | set(built))
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        calls = {
            key: max(3, int(0.2 / (ms_per_call(model, 1, 2) / 1e3)))
            for key, model in models.items()
        }
        for turn in range(args.rounds):
            for key in turn_order(list(models), turn):
                for width in only.get(key, widths):
                    ms = ms_per_call(models[key], width, calls[key])
                    best[key, width] = min(ms, best.get((key, width), ms))
            print(f"round {turn + 1} of {args.rounds}", file=sys.stderr, flush=True)
    lines = [
        f"Target `{args.target}`; {machine_line(args.threads)}. Milliseconds per call of w tokens after "
        f"{START} cached, the lowest of {args.rounds} rounds' medians (in one-token calls of the same set-up, "
        "after it):",
        "",
    ]
    rows = [
        [key]
        + [
            f"{best[key, w]:.2f} ({best[key, w] / best[key, 1]:.2f})" if (key, w) in best else "–"
            for w in widths
        ]
        for key in models
    ]
    lines += markdown_table(
        ["set-up"] + [f"w = {w}" for w in widths], rows, "l" + "r" * len(widths)
    )
    print("\n".join(lines))
    if args.out:
        write_page(
            args.out,
            "\n".join(
                page_head(
                    "A target's call by its width, under each set-up",
                    command_line("target_setups", argv),
                )
                + lines
            ),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
