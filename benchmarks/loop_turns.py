"""The decoding loops of two checkouts, measured in turns inside two warm processes: the
in-process companion of before_after.py, for a change to speculative/ alone.

    git worktree add /tmp/before <commit>
    python benchmarks/loop_turns.py /tmp/before . --rounds 12

before_after.py times generate.py as a command, one process per prompt, so every figure also
carries a process's start, its first calls and whatever generate.py sets up; on a shared VM
whose speed drifts by 10-30% from minute to minute, that hides a few per cent. Here each
checkout loads the shipped pair once, in a process of its own (its own code, the same Python),
the same way in both (weights.load_model, model.fast.fuse.prepare_for_decoding, and
weights.load_drafter for the feature head), warms every case up, and then waits. The two
processes take turns, round by round and in alternating order: one decodes a round of every
case over the story openings while the other sleeps on its input, so the machine's drift
falls on both alike. Per case and prompt the fastest round counts (a busy machine only ever
slows a run), then the median over prompts; the "median" columns take the median over rounds
instead. The speed is the loop's own tokens_per_second (new tokens over the time after the
first iteration), eager; every call has a callback and eos_id, as generate.py's do.

Do not run it while anything else loads the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_prompts import STORY_OPENINGS  # noqa: E402

# name -> (drafter: "model", "eagle" or None, speculative_generate keywords, batched)
CASES: dict[str, tuple[str | None, dict, bool]] = {
    "single, greedy": ("model", {"temperature": 0.0}, False),
    "single, T=1": ("model", {"temperature": 1.0}, False),
    "single, feature head": ("eagle", {"temperature": 0.0}, False),
    "batch 4, greedy": ("model", {"temperature": 0.0}, True),
    "tree 3,2,1,1, greedy": ("model", {"temperature": 0.0, "tree": (3, 2, 1, 1)}, False),
    "target alone, greedy": (None, {"temperature": 0.0}, False),
}


def child(tokens: int, threads: int, prompts: int) -> None:
    """One checkout's process: load, warm up, then one round of every case per line of input."""
    import torch

    torch.set_num_threads(threads)
    from model.fast.fuse import prepare_for_decoding
    from speculative import autoregressive_generate, speculative_generate, speculative_generate_batch
    from weights import load_drafter, load_model, load_tokenizer

    target, draft = load_model("tiny-target"), load_model("tiny-draft")
    for model in (target, draft):
        prepare_for_decoding(model)
    eagle = load_drafter("tiny-eagle", target)
    if getattr(eagle, "head", None) is not None:
        prepare_for_decoding(eagle.head)
    tokenizer = load_tokenizer("tiny-target")
    encoded = [tokenizer.encode(text) for text in STORY_OPENINGS[:prompts]]

    def case(name: str) -> list[float]:
        kind, options, batched = CASES[name]
        drafter = {"model": draft, "eagle": eagle}.get(kind)
        if batched:
            out = speculative_generate_batch(target, drafter, encoded, tokens, gamma=4, seed=0, eos_id=2, **options)
            return [out.stats.tokens_per_second]
        speeds = []
        for i, ids in enumerate(encoded):
            common = {"seed": i, "eos_id": 2, "callback": lambda *_: None, **options}
            out = autoregressive_generate(target, ids, tokens, **common) if drafter is None else \
                speculative_generate(target, drafter, ids, tokens, gamma=4, **common)
            speeds.append(out.stats.tokens_per_second)
        return speeds

    with torch.inference_mode():
        for name in CASES:  # warm-up
            case(name)
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            print(json.dumps({name: case(name) for name in CASES}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, nargs="?")
    parser.add_argument("after", type=Path, nargs="?")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.max_new_tokens, args.threads, args.prompts)
        return
    if args.after is None:
        parser.error("two checkouts are needed: BEFORE AFTER")
    roots = {"before": args.before.resolve(), "after": args.after.resolve()}
    procs = {}
    for name, root in roots.items():  # one at a time: loading and warming up is not measured
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "--child", "--max-new-tokens", str(args.max_new_tokens),
             "--threads", str(args.threads), "--prompts", str(args.prompts)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root,
            env=dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS=str(args.threads)))
        if procs[name].stdout.readline().strip() != "ready":
            raise SystemExit(f"error: the {name} process did not start ({root})")
    got: dict[str, list[dict[str, list[float]]]] = {name: [] for name in roots}
    for r in range(args.rounds):
        for name in (list(roots) if r % 2 == 0 else list(roots)[::-1]):
            procs[name].stdin.write("go\n")
            procs[name].stdin.flush()
            got[name].append(json.loads(procs[name].stdout.readline()))
        print(f"round {r + 1} of {args.rounds}: " + ", ".join(
            f"{name} {statistics.median(got[name][-1]['single, greedy']):.0f}" for name in roots), file=sys.stderr)
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()

    def figure(name: str, case: str, pick) -> float:
        rounds = [run[case] for run in got[name]]
        return statistics.median(pick([speeds[i] for speeds in rounds]) for i in range(len(rounds[0])))

    lines = [f"Command: `python benchmarks/loop_turns.py {args.before} {args.after} --rounds {args.rounds} "
             f"--max-new-tokens {args.max_new_tokens} --threads {args.threads} --prompts {args.prompts}`", "",
             "| case | best: before tok/s | best: after tok/s | best: after / before | median: after / before |",
             "|---|---:|---:|---:|---:|"]
    for case in CASES:
        b, a = figure("before", case, max), figure("after", case, max)
        mb, ma = figure("before", case, statistics.median), figure("after", case, statistics.median)
        lines.append(f"| {case} | {b:.0f} | {a:.0f} | {a / b:.3f} | {ma / mb:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
