"""Where a compiled one-token target step spends its time: torch.profiler over its kernels.

    python benchmarks/step_profile.py                          # tiny-target, bfloat16, 2 threads
    python benchmarks/step_profile.py --dtype float32 --repo /tmp/before   # another checkout's model

The target is stacked (model/fast/fuse.py) and compiled in the process for one row of one token
(model/fast/compile.py's CPU default mode: max-autotune with freezing), with Inductor's kernel
profiling on, so that each generated kernel is an entry of its own beside the ATen operators
the graph still calls. Prints the step's median time over rounds and the profiler's operators
by their own time per step. ``--repo`` imports model/ and weights/ from another checkout
(a worktree of an earlier commit), to compare the same step before and after a change.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tiny-target")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50, help="steps profiled (default 50)")
    parser.add_argument("--top", type=int, default=12, help="operators listed (default 12)")
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="checkout to import from")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(args.repo).resolve()))

    import torch
    import torch._inductor.config as inductor_config
    from torch.profiler import profile

    from model.call import CacheCall
    from model.fast.compile import compile_for_decoding
    from model.fast.fuse import fuse_projections
    from model.fast.setup import step_ms
    from weights import load_model

    torch.set_num_threads(args.threads)
    target = load_model(args.target, dtype=getattr(torch, args.dtype))
    fuse_projections(target)
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        compile_for_decoding(target, (1,), cache_len=256)
    with torch.inference_mode():
        ms = statistics.median(step_ms(target, (1,), False, calls=51) for _ in range(5))
        tokens, call = torch.ones(1, 1, dtype=torch.long), CacheCall.of(torch.tensor([[40]]))
        for _ in range(5):
            target(tokens, call)
        with profile() as prof:
            for _ in range(args.steps):
                target(tokens, call)
    print(f"{args.target} in {args.dtype}, {args.threads} threads, from {args.repo}: one-token step {ms:.2f} ms "
          "(median of 5 medians of 51 calls)\n")
    print("| operator or kernel | own time per step | share | calls per step |\n|---|---:|---:|---:|")
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    for e in events[:args.top]:
        print(f"| `{e.key[:60]}` | {e.self_cpu_time_total / args.steps:.0f} µs | {e.self_cpu_time_total / total:.0%} | "
              f"{e.count / args.steps:g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
