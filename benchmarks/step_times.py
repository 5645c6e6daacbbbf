"""One decode step of the target and of the draft, in isolation, under each decoding set-up.

    python -m benchmarks.step_times                       # the shipped pair, float32, a markdown table
    python -m benchmarks.step_times --draft tiny-draft-undistilled --rows 1 5

The paper's c is the cost of a draft step relative to a target step; the shipped pair was
chosen so that a target step costs about 10x a draft step. This measures both, one token
at a time through the KV cache (and optionally several rows, as a verification feeds),
with generate.py's defaults (projections stacked by model/fast/fuse.py, large float32 weights
prepacked by model/fast/prepack.py) and with each turned off. The set-ups are timed in turns
and the medians reported, so that a busy moment of the machine hits them all alike.
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks.harness import (
    machine_line,
    markdown_table,
    median,
    script_parser,
    time_call,
    turn_order,
)
from model.call import CacheCall
from model.fast.fuse import prepare_for_decoding
from weights import load_model

SETUPS = {  # name: (stack projections, prepack weights)
    "defaults (stacked, prepacked)": (True, True),
    "--no-fuse": (False, True),
    "--no-fuse --no-prepack": (False, False),
}
START = 100  # cache position of the timed calls: a prompt's worth of context before them


def ms_per_call(model: torch.nn.Module, rows: int, calls: int) -> float:
    """Milliseconds per call over ``calls`` calls, each at the next position (64 apart at most)."""
    tokens = torch.full((1, rows), 5)
    step = iter(range(calls))
    return (
        time_call(
            lambda: model(
                tokens, CacheCall.of(torch.arange(rows).unsqueeze(0) + START + next(step) % 64)
            ),
            calls,
            together=True,
        ).median
        * 1e3
    )


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("step_times", __doc__)
    parser.add_argument(
        "--target", default="tiny-target", help="registry name or path (default tiny-target)"
    )
    parser.add_argument(
        "--draft", default="tiny-draft", help="registry name or path (default tiny-draft)"
    )
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1], help="tokens per call (default 1)"
    )
    parser.add_argument(
        "--rounds", type=int, default=15, help="timed rounds per set-up (default 15)"
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.threads < 1 or any(not 1 <= r <= 64 for r in args.rows):
        sys.exit("error: --rounds and --threads must be >= 1, --rows in 1..64")
    torch.set_num_threads(args.threads)

    models = {}
    for setup, (stack, prepack) in SETUPS.items():
        for role, name in (("target", args.target), ("draft", args.draft)):
            model = load_model(name, dtype=torch.float32)
            prepare_for_decoding(model, stack=stack, prepack=prepack)
            model.setup_cache(1, START + 64 + max(args.rows))
            models[setup, role] = model
    # About 0.2 s per timing whatever the model: calibrated on one untimed call each.
    times: dict[tuple[str, str, int], list[float]] = {}
    with torch.inference_mode():
        calls = {
            key: max(5, int(0.2 / (ms_per_call(model, 1, 3) / 1e3)))
            for key, model in models.items()
        }
        for turn in range(args.rounds):
            for setup, role in turn_order(list(models), turn):
                model = models[setup, role]
                for rows in args.rows:
                    times.setdefault((setup, role, rows), []).append(
                        ms_per_call(model, rows, calls[setup, role])
                    )

    print(
        f"{machine_line(args.threads)}; float32, milliseconds per call (median of {args.rounds} rounds)\n"
    )
    rows = []
    for setup in SETUPS:
        for width in args.rows:
            target, draft = (median(times[setup, role, width]) for role in ("target", "draft"))
            rows.append([setup, width, f"{target:.3f}", f"{draft:.3f}", f"{target / draft:.1f}"])
    print(
        "\n".join(
            markdown_table(["set-up", "rows", "target", "draft", "target / draft"], rows, "lrrrr")
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
