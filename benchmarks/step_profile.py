"""Where a compiled one-token target step spends its time: torch.profiler over its kernels.

    python -m benchmarks.step_profile                          # tiny-target, bfloat16, 2 threads
    python -m benchmarks.step_profile --dtype float32 --repo /tmp/before   # another checkout's model

The target is stacked (model/fast/fuse.py) and compiled in the process for one row of one token
(model/fast/compile.py's CPU default mode: max-autotune with freezing), with Inductor's kernel
profiling on, so that each generated kernel is an entry of its own beside the ATen operators
the graph still calls. Prints the step's median time over rounds and the profiler's operators
by their own time per step. ``--repo`` runs the same measurement on another checkout's model/
and weights/ (a worktree of an earlier commit), to compare the same step before and after a
change: in a process of its own whose PYTHONPATH names that checkout (harness.checkout_env),
so nothing here changes where this process imports from.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.harness import ROOT, checkout_env, median, script_parser


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("step_profile", __doc__)
    parser.add_argument("--target", default="tiny-target")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50, help="steps profiled (default 50)")
    parser.add_argument("--top", type=int, default=12, help="operators listed (default 12)")
    parser.add_argument(
        "--repo",
        type=Path,
        default=None,
        help="the checkout whose model/ and weights/ to profile (default: this one)",
    )
    args = parser.parse_args(argv)
    if args.repo is not None and args.repo.resolve() != ROOT:
        with checkout_env(args.repo) as (cwd, env):
            return subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.step_profile",
                    "--target",
                    args.target,
                    "--dtype",
                    args.dtype,
                    "--threads",
                    str(args.threads),
                    "--steps",
                    str(args.steps),
                    "--top",
                    str(args.top),
                ],
                cwd=cwd,
                env=env,
                check=False,
            ).returncode

    # Imported here, after --repo has had its say: the checkout measured is the one they come from
    import torch
    import torch._inductor.config as inductor_config
    from torch.profiler import profile

    import model
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
        ms = median(step_ms(target, (1,), False, calls=51) for _ in range(5))
        tokens, call = torch.ones(1, 1, dtype=torch.long), CacheCall.of(torch.tensor([[40]]))
        for _ in range(5):
            target(tokens, call)
        with profile() as prof:
            for _ in range(args.steps):
                target(tokens, call)
    source = Path(model.__file__).resolve().parents[1]  # the checkout the code came from
    print(
        f"{args.target} in {args.dtype}, {args.threads} threads, from {source}: one-token step {ms:.2f} ms "
        "(median of 5 medians of 51 calls)\n"
    )
    print(
        "| operator or kernel | own time per step | share | calls per step |\n|---|---:|---:|---:|"
    )
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    for e in events[: args.top]:
        print(
            f"| `{e.key[:60]}` | {e.self_cpu_time_total / args.steps:.0f} µs | {e.self_cpu_time_total / total:.0%} | "
            f"{e.count / args.steps:g} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
