"""Fast by default: start-up time and decode speed of eager, compiled and cached compiled steps,
in float32 and bfloat16.

    python -m benchmarks.startup                         # the table in docs/results/benchmarks.md
    python -m benchmarks.startup --dtypes float32 --max-new-tokens 64 --out ''
    python -m benchmarks.startup --dtypes float32 float16 --kinds eager --out ''   # some set-ups only

Start-up, in processes of their own (children of this script), for every dtype:

* eager: the set-up of a default run without cached steps (stacked, prepacked where it pays);
* compiled: torch.compile in the process (model/fast/compile.py, no store), first with an empty
  Inductor cache, then again with the cache the first left (a later process);
* cached: compiled steps built into an empty store (model/fast/aot.py, weights/step_cache.py) by a
  first process, then loaded by the default set-up of a later one.

Start-up is the time from starting the process to the end of its first decoded call (imports,
loading, set-up, compiling or loading the steps, one token); a later process is started 3
times and the fastest counts. Decode speed, in one process that
holds every set-up of every dtype (the compiled ones compiled again, the cached ones loaded
from the stores the start-up processes built) and takes them in turns, round after round, so
that other work on the machine falls on all alike: the story openings with the target alone
and with tiny-draft (gamma 4), greedy and at T = 1 (seed i for prompt i); per prompt the
fastest of the rounds (other work only ever slows a run), then the median over the prompts
for tokens/s, alpha and c. Greedy agreement: the share of each speculative greedy continuation
equal to the eager float32 target's before the first difference. Step times: one call at 1 and
gamma + 1 tokens (target) and 1 token (draft), the fastest of the rounds' medians; the bound is
the target's weight bytes over the measured copy bandwidth.

A dtype ``T/D`` runs the target in T and the draft in D (``bfloat16/float32``: a 16-bit target
with a float32 draft, whose small step is slower in bfloat16 on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Only what the standard library has, here and in the harness: a start-up child's imports count in its time
from benchmarks.harness import (
    DOCS,
    RESULTS,
    ROOT,
    command_line,
    copy_bandwidth,
    describe_machine,
    link,
    load_average,
    median,
    page_head,
    script_parser,
    turn_order,
    write_page,
)

TITLE = "Fast by default: start-up and decode speed"

STARTS = (
    ("eager", "eager"),
    ("compiled", "compiled, first process"),
    ("compiled-again", "compiled, later process"),
    ("cached-build", "cached compiled, first process (builds)"),
    ("cached", "cached compiled, later process"),
)
SPEEDS = (
    ("eager", "eager"),
    ("compiled", "compiled (in the process)"),
    ("cached", "cached compiled (loaded)"),
)
# each set-up of SPEEDS: the start-up processes (STARTS) timed for it, first and later
STARTED_AS = {
    "eager": ("eager", "eager"),
    "compiled": ("compiled", "compiled-again"),
    "cached": ("cached-build", "cached"),
}
CASES = (("alone", 0.0), ("alone", 1.0), ("speculative", 0.0), ("speculative", 1.0))


def set_up(args: argparse.Namespace, dtype: str, kind: str, store: str) -> tuple:
    """The pair in ``dtype`` ("T" or "T/D") set up as ``kind`` says, and the target's weight bytes."""
    import torch  # deferred: a child's import time is part of the start-up this script measures

    from model.fast.compile import decode_widths
    from weights import StepCache, load_pair

    target_dtype, _, draft_dtype = dtype.partition("/")
    pair = load_pair(
        args.target, args.draft, dtype=getattr(torch, target_dtype), prepare_models=False
    )
    if draft_dtype:
        pair.draft.to(getattr(torch, draft_dtype))
    # the target's weight bytes as loaded: before prepacking
    weights = sum(p.numel() * p.element_size() for p in pair.target.parameters())
    positions = 64 + args.max_new_tokens + args.gamma + 2
    widths = decode_widths(args.gamma, args.gamma)
    if kind == "eager":
        return (*pair.set_up("default", widths, positions), weights)
    if kind.startswith("compiled"):
        return (*pair.set_up("compiled", widths, positions), weights)
    setup = "compiled" if kind == "cached-build" else "default"
    pair, setups = pair.set_up(setup, widths, positions, store=StepCache(store))
    if not setups.lines:
        raise SystemExit(f"error: the {dtype} steps were not in the store: {setups.notes}")
    return pair, setups, weights


# ----------------------------------------------------------------------------- children
def start_child(args: argparse.Namespace) -> None:
    """One process, one set-up: ready when its first call has decoded a token."""
    import torch  # deferred, as in set_up: the start-up measured includes it

    torch.set_num_threads(args.threads)
    from speculative import speculative_generate

    pair, setups, _ = set_up(args, args.dtype, args.child, args.store)
    with torch.inference_mode():
        speculative_generate(
            pair.target, pair.draft, pair.tokenizer.encode("Once upon a time"), 1, temperature=0
        )
    # The epoch clock, which the parent reads too: a process's start-up is timed across two processes
    print(json.dumps({"ready": time.time(), "setup": setups.lines}))


def speed_child(args: argparse.Namespace) -> None:
    """Every set-up of every dtype in one process, taken in turns."""
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.benchmark_prompts import STORY_OPENINGS
    from model.fast.setup import step_ms
    from speculative import autoregressive_generate, speculative_generate

    pairs = {}
    for dtype in args.dtypes:
        for kind in args.kinds:
            pair, _, weights = set_up(
                args, dtype, kind, str(Path(args.work) / f"store-{dtype.replace('/', '-')}")
            )
            pairs[dtype, kind] = (pair, weights)
            print(f"{dtype} {kind}: set up", file=sys.stderr, flush=True)
    prompts = [
        next(iter(pairs.values()))[0].tokenizer.encode(text)
        for text in STORY_OPENINGS[: args.prompts]
    ]
    runs: dict[str, dict] = {}
    steps: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for round_ in range(args.rounds):
            for dtype, kind in turn_order(list(pairs), round_):
                pair = pairs[dtype, kind][0]
                label = f"{dtype} {kind}"
                for name, temperature in CASES:
                    for i, prompt in enumerate(prompts):
                        out = (
                            autoregressive_generate(
                                pair.target,
                                prompt,
                                args.max_new_tokens,
                                temperature=temperature,
                                seed=i,
                            )
                            if name == "alone"
                            else speculative_generate(
                                pair.target,
                                pair.draft,
                                prompt,
                                args.max_new_tokens,
                                gamma=args.gamma,
                                temperature=temperature,
                                seed=i,
                            )
                        )
                        key = f"{name} T={temperature:g}"
                        best = runs.setdefault(label, {}).setdefault(key, [None] * len(prompts))
                        if best[i] is None or out.stats.tokens_per_second > best[i]["tps"]:
                            best[i] = {
                                "tps": out.stats.tokens_per_second,
                                "tokens": [int(t) for t in out.tokens],
                                "alpha": getattr(out.stats, "acceptance_rate", None),
                                "c": getattr(out.stats, "cost_ratio", None),
                            }
                timed = {
                    "target_1": step_ms(pair.target, (1,), False, calls=31),
                    f"target_{args.gamma + 1}": step_ms(
                        pair.target, (args.gamma + 1,), False, calls=31
                    ),
                    "draft_1": step_ms(pair.draft, (1,), False, calls=31),
                }
                for k, ms in timed.items():
                    steps.setdefault(label, {})[k] = min(ms, steps.get(label, {}).get(k, ms))
            print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "runs": runs,
                "steps": steps,
                "bandwidth": copy_bandwidth(),
                "weights": {f"{d} {k}": w for (d, k), (_, w) in pairs.items()},
            }
        )
    )


# ----------------------------------------------------------------------------- the parent
def spawn(
    args: argparse.Namespace, child: str, dtype: str, store: str, inductor: str
) -> tuple[float, dict]:
    command = [
        sys.executable,
        "-m",
        "benchmarks.startup",
        "--child",
        child,
        "--dtype",
        dtype,
        "--store",
        store,
        "--work",
        args.work,
        "--dtypes",
        *args.dtypes,
        "--kinds",
        *args.kinds,
        *(
            f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in ("target", "draft", "threads", "gamma", "max_new_tokens", "prompts", "rounds")
        ),
    ]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor, "OMP_NUM_THREADS": str(args.threads)}
    start = time.time()  # the epoch clock: the child reads it at its first token (start_child)
    proc = subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=None if child == "speed" else subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"error: the {child} {dtype} process failed: {(proc.stderr or '').strip()[-500:]}"
        )
    return start, json.loads(proc.stdout.strip().splitlines()[-1])


def agreement(tokens: list[int], reference: list[int]) -> float:
    same = next(
        (i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b),
        min(len(tokens), len(reference)),
    )
    return same / max(1, len(reference))


def tables(
    args: argparse.Namespace, starts: dict[tuple[str, str], float], speed: dict
) -> list[str]:
    med = median
    lines = [
        "| dtype | set-up | start-up, first process | start-up, later process | target alone, greedy | "
        "target alone, T=1 | speculative, greedy | speculative, T=1 | α / c (speculative, greedy) | "
        "greedy agreement with float32 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    reference = speed["runs"].get("float32 eager", {}).get("alone T=0")
    for dtype in args.dtypes:
        for kind, name in SPEEDS:
            if kind not in args.kinds:
                continue
            runs = speed["runs"][f"{dtype} {kind}"]
            tps = {case: med([x["tps"] for x in results]) for case, results in runs.items()}
            spec = runs["speculative T=0"]
            agree = (
                "–"
                if reference is None or (dtype, kind) == ("float32", "eager")
                else f"{med([agreement(a['tokens'], b['tokens']) for a, b in zip(spec, reference)]):.0%}"
            )
            first, later = STARTED_AS[kind]
            lines.append(
                f"| {dtype} | {name} | {starts[dtype, first]:.1f} s | "
                f"{starts[dtype, later]:.1f} s | {tps['alone T=0']:.0f} | {tps['alone T=1']:.0f} | "
                f"{tps['speculative T=0']:.0f} | {tps['speculative T=1']:.0f} | "
                f"{med([x['alpha'] for x in spec]):.3f} / {med([x['c'] for x in spec]):.3f} | {agree} |"
            )
    lines += [
        "",
        f"| dtype | set-up | target step, 1 token | target step, {args.gamma + 1} tokens | draft step | "
        "bandwidth bound / 1-token step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for dtype in args.dtypes:
        for kind, name in SPEEDS:
            if kind not in args.kinds:
                continue
            label = f"{dtype} {kind}"
            bound = 1e3 * speed["weights"][label] / speed["bandwidth"]
            steps = speed["steps"][label]
            lines.append(
                f"| {dtype} | {name} | {steps['target_1']:.2f} ms | "
                f"{steps[f'target_{args.gamma + 1}']:.2f} ms | {steps['draft_1']:.2f} ms | "
                f"{bound / steps['target_1']:.0%} (bound {bound:.2f} ms) |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("startup", __doc__)
    parser.add_argument("--target", default="tiny-target")
    parser.add_argument("--draft", default="tiny-draft")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16", "bfloat16/float32"],
        help="target dtypes; T/D: a target in T, the draft in D",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=[kind for kind, _ in SPEEDS],
        choices=[k for k, _ in SPEEDS],
        help="set-ups to measure (default: all)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument(
        "--rounds", type=int, default=8, help="turns of every set-up; the fastest counts per prompt"
    )
    parser.add_argument(
        "--out", default=str(RESULTS / "benchmarks_startup.md"), help="page to write ('' for none)"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--work", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "speed":
        speed_child(args)
        return 0
    if args.child:
        start_child(args)
        return 0
    command = command_line("startup", argv)
    load_before = load_average() or (0.0,)
    starts: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="startup-") as work:
        args.work = work
        for dtype in args.dtypes:
            name = dtype.replace("/", "-")
            store, inductor = (
                str(Path(work) / f"store-{name}"),
                str(Path(work) / f"inductor-{name}"),
            )
            for kind, _ in STARTS:
                if not any(kind in STARTED_AS[asked] for asked in args.kinds):
                    continue
                # a first process is first once; a later one is timed 3 times and the fastest kept
                for _ in range(1 if kind in ("compiled", "cached-build") else 3):
                    began, result = spawn(args, kind, dtype, store, inductor)
                    seconds = result["ready"] - began
                    starts[dtype, kind] = min(seconds, starts.get((dtype, kind), seconds))
                    print(
                        f"{dtype} {kind}: start-up {seconds:.1f}s ({'; '.join(result['setup'])})",
                        file=sys.stderr,
                        flush=True,
                    )
        _, speed = spawn(
            args, "speed", args.dtypes[0], "", str(Path(work) / f"inductor-{args.dtypes[0]}")
        )
    load_after = load_average() or (0.0,)
    info, _ = describe_machine(args.threads)
    compiled_md = link(args.out or RESULTS / "benchmarks_startup.md", DOCS / "compiled.md")
    lines = [
        f"On {info.get('CPU', 'this CPU')}, {args.threads} threads, torch {info.get('torch')}, "
        f"{info.get('date')}; load average {load_before[0]:.1f} before the run and {load_after[0]:.1f} after it "
        f"({os.cpu_count()} cores; the run's own threads count in it). {args.prompts} story openings, "
        f"{args.max_new_tokens} new tokens, γ {args.gamma}; the design is in [compiled.md]({compiled_md}). "
        "Start-up: from starting a process of its own to its first decoded token (loading, set-up, compiling or "
        "loading the steps; a later process: the fastest of 3). Tokens/s (decoding only): one process "
        "holding every set-up, taken in turns for "
        f"{args.rounds} rounds; per prompt the fastest round, then the median over the prompts. The bandwidth "
        "bound is the target's weight bytes over a 1 GiB copy's bandwidth (bytes read and written): a step "
        "only reads, and part of its weights can stay in the last-level cache between steps, so a step can "
        "come in under it (over 100%).",
        "",
    ]
    lines += tables(args, starts, speed) + [""]
    print("\n".join(lines))
    if args.out:
        write_page(args.out, "\n".join(page_head(TITLE, command) + lines))
        print(f"updated {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
