"""Fast by default: start-up time and decode speed of eager, compiled and cached compiled steps,
in float32 and bfloat16, each in processes of its own.

    python benchmarks/startup.py                         # the table in docs/benchmarks.md
    python benchmarks/startup.py --dtypes float32 --max-new-tokens 64 --out ''

For every dtype, fresh processes (each a child of this script, started as generate.py would be):

* eager: the set-up of a default run without cached steps (stacked, prepacked where it pays);
* compiled: torch.compile in the process (model/compile.py, no store), first with an empty
  Inductor cache, then again with the cache the first left (a later process);
* cached: compiled steps built into an empty store (model/aot.py, weights/step_cache.py) by the
  first process, then loaded by the default set-up of a later one.

A dtype ``T/D`` runs the target in T and the draft in D (``bfloat16/float32``: a 16-bit target
with a float32 draft, whose small step is slower in bfloat16 on a CPU).

Start-up is the time from starting the process to its first decoded call (imports, loading,
set-up and compiling or loading the steps). Each process then decodes the story openings with
the target alone and with tiny-draft (gamma 4), greedy and at T = 1 (seed i for prompt i), each
run --repeats times, the fastest kept; tokens/s, alpha and c are medians over the prompts, and
greedy agreement is the share of each speculative greedy continuation equal to the eager
float32 target's before the first difference. Step times: one call at 1 and gamma + 1 tokens
(target) and 1 token (draft), median of 31; the bound is the target's weight bytes over the
measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

ROWS = (("eager", "eager"), ("compiled", "compiled, first process"), ("compiled-again", "compiled, later process"),
        ("cached-build", "cached compiled, first process (builds)"), ("cached", "cached compiled, later process"))


# ----------------------------------------------------------------------------- the child: one process, one set-up
def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from benchmark_prompts import STORY_OPENINGS
    from compiled import copy_bandwidth

    from model.compile import decode_widths
    from model.setup import step_ms
    from speculative import autoregressive_generate, speculative_generate
    from weights import StepCache, load_pair

    target_dtype, _, draft_dtype = args.dtype.partition("/")  # "bfloat16/float32": a bfloat16 target, float32 draft
    pair = load_pair(args.target, args.draft, dtype=getattr(torch, target_dtype), prepare_models=False)
    if draft_dtype:
        pair.draft.to(getattr(torch, draft_dtype))
    weights = sum(p.numel() * p.element_size() for p in pair.target.parameters())  # as loaded: before prepacking
    positions = 64 + args.max_new_tokens + args.gamma + 2
    widths = decode_widths(args.gamma, args.gamma)
    kind = args.child
    if kind == "eager":
        pair, setups = pair.set_up("default", widths, positions)
    elif kind.startswith("compiled"):
        pair, setups = pair.set_up("compiled", widths, positions)
    else:
        pair, setups = pair.set_up("compiled" if kind == "cached-build" else "default", widths, positions,
                                   store=StepCache(args.store))
    ready = time.time()
    prompts = [pair.tokenizer.encode(text) for text in STORY_OPENINGS[:args.prompts]]
    runs: dict[str, list[dict]] = {}
    with torch.inference_mode():
        for temperature in (0.0, 1.0):
            for i, prompt in enumerate(prompts):
                for name in ("alone", "speculative"):
                    best = None  # the fastest of the repeats: other work on the machine only ever slows a run
                    for _ in range(args.repeats):
                        out = autoregressive_generate(pair.target, prompt, args.max_new_tokens, temperature=temperature,
                                                      seed=i) if name == "alone" else \
                            speculative_generate(pair.target, pair.draft, prompt, args.max_new_tokens, gamma=args.gamma,
                                                 temperature=temperature, seed=i)
                        if best is None or out.stats.tokens_per_second > best.stats.tokens_per_second:
                            best = out
                    runs.setdefault(f"{name} T={temperature:g}", []).append(
                        {"tps": best.stats.tokens_per_second, "tokens": [int(t) for t in best.tokens],
                         "alpha": getattr(best.stats, "acceptance_rate", None),
                         "c": getattr(best.stats, "cost_ratio", None)})
        steps = {"target_1": step_ms(pair.target, (1,), False, calls=31),
                 f"target_{args.gamma + 1}": step_ms(pair.target, (args.gamma + 1,), False, calls=31),
                 "draft_1": step_ms(pair.draft, (1,), False, calls=31)}
    print(json.dumps({"ready": ready, "setup": setups.lines, "runs": runs, "steps": steps,
                      "bandwidth": copy_bandwidth(), "weights": weights}))


# ----------------------------------------------------------------------------- the parent
def spawn(args: argparse.Namespace, kind: str, dtype: str, store: str, inductor: str) -> dict:
    command = [sys.executable, __file__, "--child", kind, "--dtype", dtype, "--store", store,
               *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("target", "draft", "threads", "gamma",
                                                                         "max_new_tokens", "prompts", "repeats"))]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor, "OMP_NUM_THREADS": str(args.threads)}
    start = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"error: the {kind} {dtype} process failed: {proc.stderr.strip().splitlines()[-1:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["startup_s"] = result["ready"] - start
    print(f"{dtype} {kind}: start-up {result['startup_s']:.1f}s, " + ", ".join(
        f"{name} {statistics.median(r['tps'] for r in runs):.0f} tok/s" for name, runs in result["runs"].items()),
        file=sys.stderr, flush=True)
    return result


def agreement(tokens: list[int], reference: list[int]) -> float:
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return same / max(1, len(reference))


def table(args: argparse.Namespace, results: dict[tuple[str, str], dict]) -> list[str]:
    med = statistics.median
    lines = ["| dtype | set-up | start-up (s) | target alone, greedy | target alone, T=1 | speculative, greedy | "
             "speculative, T=1 | α / c (greedy) | greedy agreement with float32 |", "|---|---|---:|---:|---:|---:|"
             "---:|---|---:|"]
    reference = results.get(("float32", "eager"))
    for (dtype, kind), r in results.items():
        tps = {name: med([x["tps"] for x in runs]) for name, runs in r["runs"].items()}
        spec = r["runs"]["speculative T=0"]
        agree = "–"
        if reference is not None and r is not reference:
            pairs = zip(spec, reference["runs"]["alone T=0"])
            agree = f"{med([agreement(a['tokens'], b['tokens']) for a, b in pairs]):.0%}"
        lines.append(f"| {dtype} | {dict(ROWS)[kind]} | {r['startup_s']:.1f} | {tps['alone T=0']:.0f} | "
                     f"{tps['alone T=1']:.0f} | {tps['speculative T=0']:.0f} | {tps['speculative T=1']:.0f} | "
                     f"{med([x['alpha'] for x in spec]):.3f} / {med([x['c'] for x in spec]):.3f} | {agree} |")
    lines += ["", f"| dtype | set-up | target step, 1 token | target step, {args.gamma + 1} tokens | draft step | "
              "bandwidth bound / 1-token step |", "|---|---|---:|---:|---:|---:|"]
    for (dtype, kind), r in results.items():
        bound = 1e3 * r["weights"] / r["bandwidth"]
        steps = r["steps"]
        lines.append(f"| {dtype} | {dict(ROWS)[kind]} | {steps['target_1']:.2f} ms | "
                     f"{steps[f'target_{args.gamma + 1}']:.2f} ms | {steps['draft_1']:.2f} ms | "
                     f"{bound / steps['target_1']:.0%} (bound {bound:.2f} ms at {r['bandwidth'] / 1e9:.0f} GB/s) |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tiny-target")
    parser.add_argument("--draft", default="tiny-draft")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "bfloat16/float32"],
                        help="target dtypes; T/D: a target in T, the draft in D")
    parser.add_argument("--kinds", nargs="+", default=[kind for kind, _ in ROWS], choices=[kind for kind, _ in ROWS])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs per prompt and case; the fastest counts")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="page to update ('' for none)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    from benchmark import machine
    from benchmark_report import FAST_END, FAST_START, replace_block

    command = f"python benchmarks/startup.py {shlex.join(sys.argv[1:] if argv is None else argv)}".rstrip()
    load_before = os.getloadavg()
    results: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="startup-") as work:
        for dtype in args.dtypes:
            name = dtype.replace("/", "-")
            store, inductor = str(Path(work) / f"store-{name}"), str(Path(work) / f"inductor-{name}")
            for kind in args.kinds:
                results[dtype, kind] = spawn(args, kind, dtype, store, inductor)
    load_after = os.getloadavg()
    info, _ = machine([args.threads])
    lines = [FAST_START, "## Fast by default: start-up and decode speed", "",
             f"From `{command}` on {info.get('CPU', 'this CPU')}, {args.threads} threads, torch {info.get('torch')}, "
             f"{info.get('date')}; load average {load_before[0]:.1f} before the run and {load_after[0]:.1f} after it "
             f"({os.cpu_count()} cores: other work shared them). {args.prompts} story openings, "
             f"{args.max_new_tokens} new tokens, γ {args.gamma}; the design is in [compiled.md](compiled.md). "
             "Every row is processes of its own; start-up runs from starting the process to its first decoded call; "
             f"tokens/s are medians over the prompts of the fastest of {args.repeats} runs each (decoding only: "
             "other work on the machine only ever slows a run).", ""] + table(args, results) + ["", FAST_END]
    print("\n".join(lines))
    if args.out:
        page = Path(args.out)
        page.write_text(replace_block(page.read_text() if page.is_file() else "", "\n".join(lines), FAST_START,
                                      FAST_END))
        print(f"updated {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
