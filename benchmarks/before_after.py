"""Decode speed of two checkouts of this project, measured in one run, in turns: the figure every
change to the decoding path reports ("measure before and after in one run").

Kept for the question every refactor still has to answer: is the speed unchanged? Issue 45
asks each of its changes for "speed unchanged, before and after, in turns", and this is the
tool that measures it (docs/results/benchmarks_convention.md and layout_before_after.md are
such records); it is not tied to any one past refactor.

    git worktree add /tmp/before <commit>
    python -m benchmarks.before_after /tmp/before . --out /tmp/before_after.md
    python -m benchmarks.before_after /tmp/before . --eager-only --repeats 1     # minutes, not tens
    python -m benchmarks.before_after /tmp/before . --warm --rounds 12           # the loops alone, warm

Two ways to measure the same cases (CASES, the shipped pair on the story openings, greedy
unless a case says T=1), into the same table:

* As commands (the default): a case is a generate.py command line, run by each checkout's own
  generate.py, one process per prompt (a batch case: one process for the batch, whose own figure
  counts, as its rows share their calls). The figure is the decode speed generate.py reports
  (tokens_per_second of --json: new tokens over the loop's time after its first iteration;
  compile time is not in it). A compiled case runs the first prompt only, --compiled-repeats
  times: every process compiles (minutes). Every figure also carries a process's start and its
  first calls.
* Warm (--warm), for a change to the loops alone: each checkout loads the shipped pair once, in a
  process of its own, the same way in both (weights.load_model, then the decoding set-up of
  generate.py, and weights.load_drafter for the feature head), warms every case up, and then
  waits; one decodes a round of every case while the other sleeps on its input. The speed is
  the loop's own tokens_per_second, eager; every call has a callback and eos_id, as
  generate.py's do. This mode also has the server's engine loop with one client
  (speculative.serving.loop.EngineLoop in the calling thread, as serve.py runs it, gamma 4: what
  a request to serve.py --speculation on decodes through), and no compiled cases. A case that a
  checkout's code cannot run (an older layout) is left out of its rounds, with a note.

Either way the checkouts take turns, repeat by repeat (round by round) and in alternating
order, so that a change in the machine's load hits both alike. "median" is the median over
prompts and repeats; "best" takes, per prompt, the fastest of its repeats and then the median
over prompts: a noisy machine only ever slows a run down, so the fastest repeat is the closest
to what the code costs. On a shared VM whose speed moves by 10-30% from minute to minute the
best columns are the figures to compare; run with --repeats 5 (or --rounds 12) or more for them.

Each checkout runs its own model/, speculative/ and weights/ with the same Python: the
environment this script is started from (the warm processes run this checkout's benchmarks/
on the other's packages: harness.checkout_env).

Do not run it while anything else loads the machine: it measures the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.benchmark_prompts import STORY_OPENINGS
from benchmarks.harness import (
    WarmProcess,
    answer_rounds,
    checkout_env,
    command_line,
    machine_line,
    markdown_table,
    median,
    network,
    per_prompt,
    prepare_networks,
    script_parser,
    take_turns,
    turn_order,
    write_page,
)

BATCH = STORY_OPENINGS[:4]  # the batch cases' rows, whatever --prompts
GAMMA = 4  # generate.py's and serve.py's default


@dataclass
class Case:
    """One row of the table, as a generate.py command line and as the calls a warm process makes."""

    flags: tuple[str, ...] | None  # generate.py's flags; None: warm only
    drafter: str | None = (
        "model"  # warm: "model" (tiny-draft), "eagle" (tiny-eagle) or None (the target alone)
    )
    options: dict[str, Any] = field(default_factory=dict)  # warm: the generation call's keywords
    batched: bool = False
    compiled: bool = False  # commands only
    server: bool = False  # warm only: through the server's engine loop

    def runs(self, warm: bool) -> bool:
        return not self.compiled if warm else self.flags is not None


CASES: dict[str, Case] = {
    "single, greedy": Case((), options={"temperature": 0.0}),
    "single, T=1": Case(("--temperature", "1", "--seed", "0"), options={"temperature": 1.0}),
    "single, feature head": Case(("--draft", "tiny-eagle"), "eagle", {"temperature": 0.0}),
    "batch 4, greedy": Case(("--batch-size", "4"), options={"temperature": 0.0}, batched=True),
    "tree 3,2,1,1, greedy": Case(
        ("--tree", "3,2,1,1"), options={"temperature": 0.0, "tree": (3, 2, 1, 1)}
    ),
    "target alone, greedy": Case(("--no-draft",), None, {"temperature": 0.0}),
    "server loop, 1 client, greedy": Case(None, server=True),
    "single, greedy, compiled": Case(("--compile", "force"), compiled=True),
    "batch 4, greedy, compiled": Case(
        ("--batch-size", "4", "--compile", "force"), batched=True, compiled=True
    ),
    "tree 3,2,1,1, greedy, compiled": Case(
        ("--tree", "3,2,1,1", "--compile", "force"), compiled=True
    ),
}


# ----------------------------------------------------------------------------- as commands
def command_speeds(
    root: Path, case: Case, tokens: int, threads: int, prompts: list[str]
) -> list[float]:
    """tokens/s of each prompt of one case, from one checkout's generate.py (one process per prompt)."""
    base = [
        sys.executable,
        str(root / "generate.py"),
        "--max-new-tokens",
        str(tokens),
        "--json",
        "--threads",
        str(threads),
        *case.flags,
    ]
    env = dict(os.environ, PYTHONPATH=str(root))

    def run(extra: list[str]) -> dict[str, Any]:
        out = subprocess.run(base + extra, capture_output=True, text=True, env=env, cwd=root)
        if out.returncode:
            raise SystemExit(f"error: {root}: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
        return json.loads(out.stdout)

    if case.batched:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write("\n".join(BATCH) + "\n")
            f.flush()
            return [run(["--prompts-file", f.name])["batch"]["tokens_per_second"]]
    return [run(["--prompt", prompt])["stats"]["tokens_per_second"] for prompt in prompts]


def as_commands(
    args: argparse.Namespace, roots: dict[str, Path], cases: list[str]
) -> dict[str, dict[str, list]]:
    """Every case's rounds per checkout: case by case, repeat by repeat, the checkouts in turns."""
    got: dict[str, dict[str, list]] = {case: {name: [] for name in roots} for case in cases}
    for repeat in range(max(args.repeats, args.compiled_repeats)):
        for case in cases:
            compiled = CASES[case].compiled
            if repeat >= (args.compiled_repeats if compiled else args.repeats):
                continue
            prompts = STORY_OPENINGS[: 1 if compiled else args.prompts]
            for name in turn_order(list(roots), repeat):
                speeds = command_speeds(
                    roots[name], CASES[case], args.max_new_tokens, args.threads, prompts
                )
                got[case][name].append(speeds)
                print(
                    f"repeat {repeat} {case} {name}: {median(speeds):.0f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    return got


# ----------------------------------------------------------------------------- warm
def warm_child(args: argparse.Namespace) -> None:
    """One checkout's process: load, warm every case up, then one round of every case per request."""
    # Imported here: only this child needs them, and it takes them from the checkout it measures
    import torch

    torch.set_num_threads(args.threads)
    from speculative import (
        autoregressive_generate,
        speculative_generate,
        speculative_generate_batch,
    )
    from weights import load_drafter, load_model, load_tokenizer

    target, draft = load_model("tiny-target"), load_model("tiny-draft")
    for model in (target, draft):
        prepare_networks(model)
    eagle = load_drafter("tiny-eagle", target)  # on the prepared target, as generate.py loads it
    if network(eagle) is not None:
        prepare_networks(network(eagle))
    tokenizer = load_tokenizer("tiny-target")
    eos = tokenizer.eos_id
    encoded = [tokenizer.encode(text) for text in STORY_OPENINGS[: args.prompts]]
    batch = [tokenizer.encode(text) for text in BATCH]
    engine = None

    def served(ids: list[int], seed: int) -> float:
        """One request through the server's engine loop, run in this thread as serve.py runs it."""
        nonlocal engine
        # Imported here, as above: from the checkout this child measures, whose layout may be older
        from speculative.engine import Engine

        try:
            from speculative.serving.loop import EngineLoop, Ticket
        except ImportError:  # before speculative/serving/ was a package
            from speculative.serving import EngineLoop, Ticket
        if engine is None:  # serve.py's: --max-batch 16 rows over the whole context
            engine = Engine(
                target,
                draft,
                gamma=GAMMA,
                max_rows=16,
                cache_len=min(target.config.max_seq_len, draft.config.max_seq_len),
            )
        loop = EngineLoop(engine).here()
        ticket = loop.submit(
            Ticket(ids, args.max_new_tokens, seed=seed, eos_id=eos, on_done=lambda _: loop.close())
        )
        loop.run()
        if ticket.error is not None:
            raise ticket.error
        return ticket.row.stats.tokens_per_second

    def case_speeds(name: str) -> list[float]:
        case = CASES[name]
        drafter = {"model": draft, "eagle": eagle}.get(case.drafter)
        if case.server:
            return [served(ids, i) for i, ids in enumerate(encoded)]
        if case.batched:
            out = speculative_generate_batch(
                target,
                drafter,
                batch,
                args.max_new_tokens,
                gamma=GAMMA,
                seed=0,
                eos_id=eos,
                **case.options,
            )
            return [out.stats.tokens_per_second]
        speeds = []
        for i, ids in enumerate(encoded):
            common = {"seed": i, "eos_id": eos, "callback": lambda *_: None, **case.options}
            out = (
                autoregressive_generate(target, ids, args.max_new_tokens, **common)
                if drafter is None
                else speculative_generate(
                    target, drafter, ids, args.max_new_tokens, gamma=GAMMA, **common
                )
            )
            speeds.append(out.stats.tokens_per_second)
        return speeds

    with torch.inference_mode():
        cases = []
        for name in args.cases:  # the warm-up, and which cases this checkout's code runs
            try:
                case_speeds(name)
                cases.append(name)
            except Exception as err:  # noqa: BLE001 - an older checkout may lack what a case calls
                print(
                    f"note: {name!r} does not run here: {type(err).__name__}: {err}",
                    file=sys.stderr,
                )
        answer_rounds(lambda: {name: case_speeds(name) for name in cases})


def warm(
    args: argparse.Namespace, roots: dict[str, Path], cases: list[str]
) -> dict[str, dict[str, list]]:
    """Every case's rounds per checkout, from two warm processes that take turns."""
    procs: dict[str, WarmProcess] = {}
    with ExitStack() as stack:
        for name, root in roots.items():  # one at a time: loading and warming up is not measured
            cwd, env = stack.enter_context(checkout_env(root))
            command = [
                sys.executable,
                "-m",
                "benchmarks.before_after",
                "--child",
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--threads",
                str(args.threads),
                "--prompts",
                str(args.prompts),
                "--cases",
                *cases,
            ]
            procs[name] = WarmProcess(
                name, command, cwd, {**env, "OMP_NUM_THREADS": str(args.threads)}
            )
            stack.callback(procs[name].close)

        def progress(r: int, got: dict[str, list]) -> None:
            print(
                f"round {r + 1} of {args.rounds}: "
                + ", ".join(
                    f"{name} {median(rounds[-1].get(cases[0], [0])):.0f}"
                    for name, rounds in got.items()
                ),
                file=sys.stderr,
                flush=True,
            )

        got = take_turns(procs, args.rounds, progress)
    return {
        case: {name: [r[case] for r in rounds if case in r] for name, rounds in got.items()}
        for case in cases
    }


# ----------------------------------------------------------------------------- the table
def table(got: dict[str, dict[str, list]], names: list[str]) -> list[str]:
    rows = []
    for case, figures in got.items():
        if not all(figures[name] for name in names):
            continue  # no repeats asked for, or a checkout that cannot run it
        med = [median(x for r in figures[name] for x in r) for name in names]
        best = [per_prompt(figures[name], max) for name in names]
        rows.append(
            [
                case,
                f"{med[0]:.0f}",
                f"{med[1]:.0f}",
                f"{med[1] / med[0]:.3f}",
                f"{best[0]:.0f}",
                f"{best[1]:.0f}",
                f"{best[1] / best[0]:.3f}",
            ]
        )
    return markdown_table(
        [
            "case",
            "median: before tok/s",
            "median: after tok/s",
            "median: after / before",
            "best: before tok/s",
            "best: after tok/s",
            "best: after / before",
        ],
        rows,
        "lrrrrrr",
    )


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("before_after", __doc__)
    parser.add_argument("before", type=Path, nargs="?")
    parser.add_argument("after", type=Path, nargs="?")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="measure the loops in two warm processes instead of generate.py commands",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="repeats of every eager case, as commands (default 2)",
    )
    parser.add_argument(
        "--compiled-repeats",
        type=int,
        default=1,
        help="repeats of the compiled cases, one prompt each (every process compiles: minutes)",
    )
    parser.add_argument("--eager-only", action="store_true", help="skip the compiled cases")
    parser.add_argument(
        "--rounds", type=int, default=12, help="rounds of every case with --warm (default 12)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="new tokens per prompt (default 200 as commands, 128 with --warm)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--prompts",
        type=int,
        default=4,
        help=f"story openings per case, 1..{len(STORY_OPENINGS)} (default 4; batches: always 4)",
    )
    parser.add_argument(
        "--cases", nargs="*", help="names of CASES to run (default: all that the mode has)"
    )
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 128 if args.warm or args.child else 200
    if (
        not 1 <= args.prompts <= len(STORY_OPENINGS)
        or min(args.repeats, args.compiled_repeats, args.rounds) < 0
    ):
        parser.error(f"--prompts must be in 1..{len(STORY_OPENINGS)}; repeats and rounds >= 0")
    if args.child:
        warm_child(args)
        return 0
    if args.after is None:
        parser.error("two checkouts are needed: BEFORE AFTER")
    mode = [
        c for c in CASES if CASES[c].runs(args.warm) and not (args.eager_only and CASES[c].compiled)
    ]
    unknown = [c for c in args.cases or [] if c not in mode]
    if unknown:
        parser.error(
            f"not a case {'with --warm' if args.warm else 'as commands'}: {', '.join(map(repr, unknown))} "
            f"(choose from {', '.join(map(repr, mode))})"
        )
    cases = [c for c in mode if not args.cases or c in args.cases]
    roots = {"before": args.before.resolve(), "after": args.after.resolve()}
    got = warm(args, roots, cases) if args.warm else as_commands(args, roots, cases)
    compiled = any(CASES[c].compiled for c in cases)
    if args.warm:
        how = f"warm processes, {args.rounds} rounds"
    else:
        how = f"generate.py commands, {args.repeats} repeats"
        if compiled:
            how += f" ({args.compiled_repeats} of the compiled cases)"
    lines = [
        f"Command: `{command_line('before_after', argv)}`",
        "",
        f"Before {roots['before']}, after {roots['after']}; {how}, {args.max_new_tokens} new tokens, "
        f"{args.prompts} story openings; {machine_line(args.threads)}.",
        "",
    ] + table(got, list(roots))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_page(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
