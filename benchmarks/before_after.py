"""Decode speed of two checkouts of this project, measured in one run: the figure every
wave-3 change reports ("measure before and after in one run").

    git worktree add /tmp/before <commit>
    python benchmarks/before_after.py /tmp/before . --out /tmp/before_after.md
    python benchmarks/before_after.py /tmp/before . --eager-only --repeats 1   # minutes, not tens

Each case is a generate.py command line on the shipped pair (story openings, greedy unless
it says T=1). The checkouts take turns, case by case and repeat by repeat, so that a change
in the machine's load hits both alike. A case's figure is the median over prompts and
repeats of the decode speed generate.py reports (tokens_per_second: new tokens over the loop's
time after its first iteration; compile time is not in it). A batch case is one figure per
run, the batch's own. A compiled case runs the first prompt only, --compiled-repeats times:
every process compiles (minutes). Each checkout runs with its own code and the same Python:
the environment this script is started from.

The "best" columns take, for each prompt, the fastest of its repeats, then the median over
prompts: a noisy machine only ever slows a run down, so the fastest repeat is the closest to
what the code costs. On a shared VM whose speed moves by 10-30% from minute to minute, they
are the figures to compare; run with --repeats 5 or more for them.

Do not run it while anything else loads the machine: it measures the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_prompts import STORY_OPENINGS  # noqa: E402

PROMPTS = STORY_OPENINGS[:4]
# name -> (extra flags, batched, compiled)
CASES: dict[str, tuple[list[str], bool, bool]] = {
    "single, greedy": ([], False, False),
    "single, T=1": (["--temperature", "1", "--seed", "0"], False, False),
    "single, feature head": (["--draft", "tiny-eagle"], False, False),
    "batch 4, greedy": (["--batch-size", "4"], True, False),
    "tree 3,2,1,1, greedy": (["--tree", "3,2,1,1"], False, False),
    "target alone, greedy": (["--no-draft"], False, False),
    "single, greedy, compiled": (["--compile", "force"], False, True),
    "batch 4, greedy, compiled": (["--batch-size", "4", "--compile", "force"], True, True),
    "tree 3,2,1,1, greedy, compiled": (["--tree", "3,2,1,1", "--compile", "force"], False, True),
}


def speeds(root: Path, flags: list[str], batched: bool, tokens: int, threads: int, prompts: list[str]) -> list[float]:
    """tokens/s of each prompt of one case, from one checkout (one process per prompt)."""
    base = [sys.executable, str(root / "generate.py"), "--max-new-tokens", str(tokens), "--json",
            "--threads", str(threads), *flags]
    env = dict(os.environ, PYTHONPATH=str(root))
    if batched:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("\n".join(PROMPTS) + "\n")  # a batch of 4, whatever ``prompts``
        out = subprocess.run(base + ["--prompts-file", f.name], capture_output=True, text=True, env=env, cwd=root)
        os.unlink(f.name)
        if out.returncode:
            raise RuntimeError(f"{root}: {out.stderr.strip().splitlines()[-1]}")
        # rows of one batch share their calls: the batch's own figure is the one to compare
        return [json.loads(out.stdout)["batch"]["tokens_per_second"]]
    result = []
    for prompt in prompts:
        out = subprocess.run(base + ["--prompt", prompt], capture_output=True, text=True, env=env, cwd=root)
        if out.returncode:
            raise RuntimeError(f"{root}: {out.stderr.strip().splitlines()[-1]}")
        result.append(json.loads(out.stdout)["stats"]["tokens_per_second"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager-only", action="store_true")
    parser.add_argument("--compiled-repeats", type=int, default=1,
                        help="repeats of the compiled cases, one prompt each (every process compiles: minutes)")
    parser.add_argument("--cases", nargs="*", help="names of CASES to run (default: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    roots = {"before": args.before.resolve(), "after": args.after.resolve()}
    cases = [c for c in CASES if (not args.cases or c in args.cases) and not (args.eager_only and CASES[c][2])]
    got: dict[tuple[str, str], list[float]] = {(c, r): [] for c in cases for r in roots}
    for repeat in range(max(args.repeats, args.compiled_repeats)):
        for case in cases:
            compiled = CASES[case][2]
            if repeat >= (args.compiled_repeats if compiled else args.repeats):
                continue
            order = list(roots) if repeat % 2 == 0 else list(roots)[::-1]
            for name in order:
                flags, batched, _ = CASES[case]
                prompts = PROMPTS[:1] if compiled else PROMPTS
                got[case, name] += speeds(roots[name], flags, batched, args.max_new_tokens, args.threads, prompts)
                print(f"repeat {repeat} {case} {name}: {got[case, name][-1]:.0f} tok/s", file=sys.stderr, flush=True)
    lines = [f"Command: `python benchmarks/before_after.py {args.before} {args.after} --repeats {args.repeats} "
             f"--compiled-repeats {args.compiled_repeats} --max-new-tokens {args.max_new_tokens} "
             f"--threads {args.threads}`", "",
             "| case | before tok/s | after tok/s | after / before | best: before | best: after | best: ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for case in cases:
        b, a = statistics.median(got[case, "before"]), statistics.median(got[case, "after"])
        k = 1 if CASES[case][1] or CASES[case][2] else len(PROMPTS)  # figures per repeat
        best_b, best_a = (statistics.median(max(got[case, name][i::k]) for i in range(k)) for name in roots)
        lines.append(f"| {case} | {b:.0f} | {a:.0f} | {a / b:.3f} | {best_b:.0f} | {best_a:.0f} "
                     f"| {best_a / best_b:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
