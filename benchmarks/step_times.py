"""One decode step of the target and of the draft, in isolation, under each decoding set-up.

    python benchmarks/step_times.py                       # the shipped pair, float32, a markdown table
    python benchmarks/step_times.py --draft tiny-draft-undistilled --rows 1 5

The paper's c is the cost of a draft step relative to a target step; the shipped pair was
chosen so that a target step costs about 10x a draft step. This measures both, one token
at a time through the KV cache (and optionally several rows, as a verification feeds),
with generate.py's defaults (projections stacked by model/fast/fuse.py, large float32 weights
prepacked by model/fast/prepack.py) and with each turned off. The set-ups are timed in turns
and the medians reported, so that a busy moment of the machine hits them all alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.call import CacheCall  # noqa: E402
from model.fast.fuse import prepare_for_decoding  # noqa: E402
from weights import load_model  # noqa: E402

SETUPS = {  # name: (stack projections, prepack weights)
    "defaults (stacked, prepacked)": (True, True),
    "--no-fuse": (False, True),
    "--no-fuse --no-prepack": (False, False),
}
START = 100  # cache position of the timed calls: a prompt's worth of context before them


def ms_per_call(model: torch.nn.Module, rows: int, calls: int) -> float:
    tokens = torch.full((1, rows), 5)
    start = time.perf_counter()
    for i in range(calls):
        model(tokens, CacheCall.of(torch.arange(rows).unsqueeze(0) + START + i % 64))
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="tiny-target", help="registry name or path (default tiny-target)")
    parser.add_argument("--draft", default="tiny-draft", help="registry name or path (default tiny-draft)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="tokens per call (default 1)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per set-up (default 15)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
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
        calls = {key: max(5, int(0.2 / (ms_per_call(model, 1, 3) / 1e3))) for key, model in models.items()}
        for _ in range(args.rounds):
            for (setup, role), model in models.items():
                for rows in args.rows:
                    times.setdefault((setup, role, rows), []).append(ms_per_call(model, rows, calls[setup, role]))

    print(f"{args.threads} threads, torch {torch.__version__}, float32; milliseconds per call (median of "
          f"{args.rounds} rounds)\n")
    print("| set-up | rows | target | draft | target / draft |")
    print("|---|---:|---:|---:|---:|")
    for setup in SETUPS:
        for rows in args.rows:
            target = statistics.median(times[setup, "target", rows])
            draft = statistics.median(times[setup, "draft", rows])
            print(f"| {setup} | {rows} | {target:.3f} | {draft:.3f} | {target / draft:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
