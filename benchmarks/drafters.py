"""Drafters side by side on held-out story openings: acceptance by draft position, tokens per
target call, the drafter's cost, and tokens/s against the target alone, in one run.

    python -m benchmarks.drafters --drafters tiny-draft tiny-eagle tiny-eagle3 --gamma 5
    python -m benchmarks.drafters --drafters tiny-eagle runs/e3/1-fused/hf ... --labels EAGLE-1 "+ fused" ... \\
        --out docs/results/drafters_eagle3.md       # the ablation table of docs/drafters.md
    python -m benchmarks.drafters --target SmolLM2-135M-Instruct.Q4_1.gguf --chat --drafters lookup \
        smollm2-eagle3 --gamma auto 5 --prompts 4 --rounds 2  # docs/results/drafters_smollm2.md

The prompts are the first ``--prompt-tokens`` tokens of held-out TinyStories validation stories
(never trained on; weights.corpus.held_out_prompts, as train.py measures acceptance), or with
``--chat`` requests about those stories in the target's chat template
(weights.corpus.chat_prompts, as ``train.py --data chat`` measures it). Every drafter and the
target alone decode the same prompts, greedy and at temperature 1 (prompt i with seed i), end of
sequence ignored, in the set-up generate.py takes by default (model.fast.setup.default_setups:
compiled steps where an earlier ``--compile`` measured them faster on this machine, else stacked
and prepacked at once; ``--no-cache``: never compiled), verified as generate.py verifies by default
(block-wise at temperature 1: speculative.cli.options.verified). Rounds take turns so that a change in
machine load hits every method alike; tokens/s is the median over rounds of each round's total,
and the speed-up is over the target alone in the same round.

Columns: alpha at draft position i is accepted / verified at position i (the earlier ones
all accepted), greedy; alpha, the paper's: the mean of sum_x min(p, q) over the verified
positions, greedy and at temperature 1; tokens per target call; c, the drafting time per position drafted
ahead over the time of a target call (the cost model's c); tokens/s and the speed-up.

Why this is a script beside benchmark.py and not one of its flags: the two answer different
questions. benchmark.py asks how fast speculative decoding is against the target alone and
against transformers' generate, over gamma 1..8 and auto, thread counts and two prompt sets
(story openings, retell), and whether the cost model predicts it; it runs one fixed set-up
(stacked and prepacked, never compiled) and times every call end to end. This script asks
which drafter, or which training change of one (``--labels``: the EAGLE-3 ablation of
docs/drafters.md), accepts more, draft position by draft position, on text no drafter was
trained on, and what that buys in the set-up a user gets (generate.py's default, compiled
where measured faster). Its prompts are those train.py measures acceptance on
(weights.corpus.held_out_prompts), so that its alpha compares with a training run's; its
figures are the loop's own statistics (alpha by position, drafting time per iteration), which
benchmark.py does not report. Folded in, benchmark.py would carry a second prompt source, a
second set-up and a second table, none of which its own question needs.

Do not run it while anything else loads the machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import (
    command_line,
    machine_line,
    markdown_table,
    median,
    script_parser,
    turn_order,
)
from model.fast.compile import decode_widths
from speculative import autoregressive_generate, speculative_generate
from speculative.cli import costs
from speculative.cli.options import gamma_arg, unrecorded, verified
from speculative.engine.gamma_policy import OFF, TIMED, Guard
from speculative.inputs import GAMMA_MAX
from speculative.verify import RULES
from weights import StepCache, load_tokenizer, read_pair
from weights.corpus import chat_prompts, held_out_prompts

ROOT = Path(__file__).resolve().parents[1]
# --guard: "default" is generate.py's (recorded costs); "greedy" its default before 2026-12-05 (timed when greedy)
GUARDS = ("on", "off", "recorded", "default", "greedy")  # run_all's guard_for
VALID = ROOT.parent / "shared" / "data" / "tinystories" / "tinystories_v1_valid_head.txt"


def load(
    target: str,
    draft: str | None,
    gamma: int | str,
    positions: int,
    cache: bool,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    """The target and drafter in generate.py's default set-up for these calls (the drafter in its own
    dtype beside the target's: weights.load.PairSpec.draft_dtype)."""
    spec = read_pair(target, draft)
    pair = spec.load(dtype=dtype, prepare_models=False, draft_dtype=spec.draft_dtype("cpu", dtype))
    widths = decode_widths(gamma, GAMMA_MAX) if draft else (1,)
    pair, _ = pair.set_up("default", widths, positions, store=StepCache() if cache else None)
    return pair.target, pair.draft


def guard_for(guard: str, temperature: float, recorded: tuple[float, ...] | None) -> Guard:
    """run_all's ``guard`` as the engine's Guard."""
    if guard == "on" or (guard == "greedy" and temperature == 0):
        return TIMED
    if guard == "off":
        return OFF
    # "recorded", "default", and "greedy" when sampled: generate.py's guard by recorded costs
    if recorded:
        return Guard("recorded", recorded)
    return unrecorded(temperature)


def run_all(
    target: Any,
    drafter: Any,
    prompts: list[list[int]],
    new_tokens: int,
    gamma: int | str,
    temperature: float,
    guard: str = "default",
    verify: str = "default",
    recorded: tuple[float, ...] | None = None,
) -> dict[str, Any]:
    """Every prompt once; the totals of its stats. ``guard``: "on" (timed), "off", "recorded" (the costs
    ``recorded``, measured at this temperature), "default" (generate.py's: ``recorded``), or "greedy" (timed
    when greedy, ``recorded`` when sampled); ``verify``: "token", "block", or "default" (generate.py's: block
    when sampled)."""
    rule = verified(None if verify == "default" else verify, temperature, None)
    switch = guard_for(guard, temperature, recorded)
    most = GAMMA_MAX if gamma == "auto" else gamma
    total: dict[str, Any] = {
        "new": 0,
        "calls": 0,
        "wall": 0.0,
        "draft_s": 0.0,
        "target_s": 0.0,
        "ahead": 0,
        "overlap": 0.0,
        "verified": 0,
        "accepted": [0] * most,
        "tried": [0] * most,
    }
    for i, prompt in enumerate(prompts):
        if drafter is None:
            out = autoregressive_generate(
                target, prompt, new_tokens, temperature=temperature, seed=i
            )
        else:
            out = speculative_generate(
                target,
                drafter,
                prompt,
                new_tokens,
                gamma=gamma,
                temperature=temperature,
                seed=i,
                guard=switch,
                verify=rule,
            )
        s = out.stats
        total["new"] += s.new_tokens
        total["wall"] += s.wall_time_s
        if drafter is not None:
            total["calls"] += s.target_calls
            total["draft_s"] += s.draft_time_s
            total["target_s"] += s.target_time_s
            total["ahead"] += sum(s.gamma_history)
            total["overlap"] += s.overlap_sum
            total["verified"] += s.verified_positions
            for j in range(min(most, len(s.tried_per_position))):
                total["accepted"][j] += s.accepted_per_position[j]
                total["tried"][j] += s.tried_per_position[j]
    return total


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("drafters", __doc__)
    parser.add_argument("--target", default="tiny-target")
    parser.add_argument("--drafters", nargs="+", required=True, help="drafter names or folders")
    parser.add_argument(
        "--labels", nargs="*", default=None, help="a label per drafter (default: the names)"
    )
    parser.add_argument(
        "--gamma",
        type=gamma_arg,
        nargs="+",
        default=[5],
        help="tokens drafted per target call, or auto; several: every drafter at each (default 5)",
    )
    parser.add_argument(
        "--guard",
        nargs="+",
        choices=list(GUARDS),
        default=["default"],
        help="plain steps where speculating loses (Engine's guard): on (timed), off, recorded (costs "
        "measured before the rounds at each temperature, speculative.cli.costs), default "
        "(generate.py's: recorded), or greedy (timed when greedy, recorded when sampled); several: "
        "every drafter with each (default: default, what generate.py runs)",
    )
    parser.add_argument(
        "--verify",
        nargs="+",
        choices=["default", *RULES],
        default=["default"],
        help="how a sampled chain is verified: generate.py's default (block), token or block; several: "
        "every drafter with each",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="chat requests about held-out stories in the target's "
        "template (weights.corpus.chat_prompts), not story openings",
    )
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (default 16)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=8, help="tokens per prompt (default 8)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens per generation (default 128)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds in turns (default 3)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="both models' (default float32; bfloat16 is another target, asked for by name)",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="never the compiled steps: stacked and prepacked"
    )
    parser.add_argument("--out", default=None, help="write the table (markdown) here too")
    args = parser.parse_args(argv)
    labels = args.labels or args.drafters
    if len(labels) != len(args.drafters):
        parser.error("--labels takes one label per drafter")
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.target)
    ahead = max(GAMMA_MAX if g == "auto" else g for g in args.gamma)
    if args.chat:  # train.py --data chat's held-out prompts (its --eval-corpus, seed 0)
        room = read_pair(args.target).target_config.max_seq_len - args.max_new_tokens - ahead - 2
        prompts = chat_prompts([str(VALID)], tokenizer, args.prompts, 0, room)
    else:
        prompts = held_out_prompts([str(VALID)], tokenizer, args.prompts, args.prompt_tokens, 0)
    positions = max(map(len, prompts)) + args.max_new_tokens + ahead + 2
    dtype = getattr(torch, args.dtype)
    methods = {
        "target alone": (
            *load(args.target, None, 1, positions, not args.no_cache, dtype),
            1,
            "off",
            "default",
        )
    }
    for label, name in zip(labels, args.drafters):
        for gamma in args.gamma:
            loaded = load(args.target, name, gamma, positions, not args.no_cache, dtype)
            for guard, verify in ((g, v) for g in args.guard for v in args.verify):
                key = (
                    label
                    + (f", γ = {gamma}" if len(args.gamma) > 1 else "")
                    + (f", guard {guard}" if len(args.guard) > 1 else "")
                    + (f", {verify}" if len(args.verify) > 1 else "")
                )
                methods[key] = (*loaded, gamma, guard, verify)
    results: dict[tuple[str, float], list[dict[str, Any]]] = {}
    with torch.inference_mode():
        for target, drafter, gamma, guard, verify in methods.values():  # warm-up: one prompt each
            run_all(target, drafter, prompts[:1], 16, gamma, 0.0, guard, verify)
        recorded = {
            (name, t): costs.measure(
                m[0],
                m[1],
                prompts[0],
                dict(  # the guard's costs: as generate.py's
                    gamma=m[2],
                    tree=None,
                    tree_mode="without_replacement",
                    verify=verified(None if m[4] == "default" else m[4], t, None),
                    temperature=t,
                    top_k=None,
                    top_p=None,
                ),
            )
            for name, m in methods.items()
            if m[1] is not None and m[3] in ("recorded", "default", "greedy")
            for t in (0.0, 1.0)
            if t > 0 or m[3] != "greedy"
        }
        measured = ", ".join(
            f"{name} T={t:g} " + " / ".join(f"{seconds * 1e3:.2f}" for seconds in costs_of)
            for (name, t), costs_of in recorded.items()
        )
        print(
            f"recorded costs (ms a plain step / a speculating iteration / more for the first after plain steps): "
            f"{measured}",
            file=sys.stderr,
        )
        for r in range(args.rounds):
            for name in turn_order(list(methods), r):
                target, drafter, gamma, guard, verify = methods[name]
                for temperature in (0.0, 1.0):
                    results.setdefault((name, temperature), []).append(
                        run_all(
                            target,
                            drafter,
                            prompts,
                            args.max_new_tokens,
                            gamma,
                            temperature,
                            guard,
                            verify,
                            recorded.get((name, temperature)),
                        )
                    )
            print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    rows, figures = [], {}
    for name in methods:
        row: list[Any] = [name]
        figure: dict[str, Any] = {}
        for temperature in (0.0, 1.0):
            runs = results[name, temperature]
            speeds = [run["new"] / run["wall"] for run in runs]
            base = [run["new"] / run["wall"] for run in results["target alone", temperature]]
            first = runs[0]
            alphas = [
                a / t for a, t in zip(first["accepted"], first["tried"]) if t
            ]  # the positions drafted
            tau = first["new"] / first["calls"] if first["calls"] else 1.0
            c = (
                (first["draft_s"] / first["ahead"]) / (first["target_s"] / first["calls"])
                if first["ahead"]
                else 0.0
            )
            per_iteration = first["draft_s"] / first["target_s"] if first["target_s"] else 0.0
            key = "greedy" if temperature == 0 else "t1"
            alpha = first["overlap"] / first["verified"] if first["verified"] else float("nan")
            figure[key] = {
                "alpha_by_position": alphas,
                "alpha": alpha,
                "tokens_per_call": tau,
                "c": c,
                "draft_per_iteration": per_iteration,
                "tokens_per_s": median(speeds),
                "speedup": median(s / b for s, b in zip(speeds, base)),
            }
        figures[name] = figure
        g, t = figure["greedy"], figure["t1"]
        row += [
            " ".join(f"{a:.2f}" for a in g["alpha_by_position"])
            if methods[name][1] is not None
            else "",
            f"{g['alpha']:.3f} / {t['alpha']:.3f}" if methods[name][1] is not None else "",
            f"{g['tokens_per_call']:.2f}",
            f"{t['tokens_per_call']:.2f}",
            f"{g['c']:.3f}" if g["c"] else "",
            f"{g['draft_per_iteration']:.3f}" if g["c"] else "",
            f"{g['tokens_per_s']:.0f}",
            f"{g['speedup']:.2f}×",
            f"{t['tokens_per_s']:.0f}",
            f"{t['speedup']:.2f}×",
        ]
        rows.append(row)
    header = [
        "drafter",
        "α by position 1..γ (greedy)",
        "α greedy / T=1",
        "tokens/call greedy",
        "tokens/call T=1",
        "c (draft step / target call)",
        "drafting / iteration (target calls)",
        "tok/s greedy",
        "speed-up greedy",
        "tok/s T=1",
        "speed-up T=1",
    ]
    lengths = sorted(map(len, prompts))
    kind = (
        f"chat requests of {lengths[0]}-{lengths[-1]} tokens"
        if args.chat
        else f"prompts of {args.prompt_tokens} tokens"
    )
    lines = [
        f"Command: `{command_line('drafters', argv)}`",
        "",
        f"Machine: {machine_line(args.threads)}",
        "",
        f"{len(prompts)} held-out {kind}, {args.max_new_tokens} new tokens "
        f"each (EOS ignored), γ = {', '.join(map(str, args.gamma))}, guard {', '.join(args.guard)} (on: timed; "
        f"default: recorded costs, generate.py's; greedy: timed when greedy, recorded when sampled), verification "
        f"{', '.join(args.verify)} (default: generate.py's, "
        "block-wise at temperature 1), "
        f"{args.rounds} rounds in turns; set-up: "
        f"{'stacked and prepacked' if args.no_cache else 'the default (compiled where measured faster)'}, "
        f"{args.dtype}.",
        "",
        f"Recorded costs of the guard, measured before the rounds (ms a plain "
        f"step / a speculating iteration / more for the first after plain steps): {measured}.",
        "",
        *markdown_table(header, rows, "l" + "r" * (len(header) - 1)),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
