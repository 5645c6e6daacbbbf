"""Eager against compiled decoding on this machine: step times, c and tokens/s per drafter.

    python -m benchmarks.compiled            # 1 and 2 threads: docs/results/benchmarks_compiled.md
    python -m benchmarks.compiled --threads 2 --max-new-tokens 64

For every thread count: the eager set-up of generate.py (projections stacked, float32
weights prepacked for oneDNN) and the compiled one (model/fast/compile.py, stacked, Inductor),
timed apart (one step of the target at widths 1 and gamma + 1, one step of each drafter's
network) and in whole runs: the target alone, and speculative decoding with tiny-draft,
tiny-eagle (compiled: the head and its target, compiled with hidden states) and prompt
lookup, greedy and at T = 1, gamma fixed. "compiled" here is the compiled step whatever it
measured (`--compile force`); `--compile` would keep the faster one per model. The page ends
with a summary table and the compile times.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from benchmarks.benchmark_prompts import STORY_OPENINGS
from benchmarks.harness import (
    DOCS,
    NAN,
    RESULTS,
    command_line,
    copy_bandwidth,
    describe_machine,
    link,
    machine_lines,
    median,
    page_head,
    script_parser,
    write_page,
)
from model.fast.compile import compile_for_decoding, decode_widths
from model.fast.fuse import fuse_projections, prepare_for_decoding
from model.fast.setup import step_ms
from speculative import PromptLookupDrafter, autoregressive_generate, speculative_generate
from weights import load_drafter, load_model, load_tokenizer


def setups(args: argparse.Namespace) -> dict[str, dict]:
    """The models of both set-ups: eager (stacked + prepacked) and compiled (stacked, compiled)."""
    cache_len = 64 + args.max_new_tokens + args.gamma + 2
    out = {}
    for name in ("eager", "compiled"):
        target, draft = load_model(args.target), load_model("tiny-draft")
        target_h = copy.deepcopy(target)
        head = load_drafter("tiny-eagle", target_h)
        compile_s = 0.0
        if name == "eager":
            for net in (target, draft, target_h, head.head):
                prepare_for_decoding(net, stack=True, prepack=True)
        else:
            for net in (target, draft, target_h, head.head):
                fuse_projections(net)
            widths = decode_widths(args.gamma, args.gamma)
            compile_s += compile_for_decoding(target, widths, cache_len=cache_len).compile_s
            compile_s += compile_for_decoding(draft, (1, 2), cache_len=cache_len).compile_s
            compile_s += compile_for_decoding(
                target_h, widths, cache_len=cache_len, hidden=True
            ).compile_s
            compile_s += compile_for_decoding(head.head, widths, cache_len=cache_len).compile_s
        out[name] = {
            "target": target,
            "tiny-draft": draft,
            "target_h": target_h,
            "tiny-eagle": head,
            "compile_s": compile_s,
            "cache_len": cache_len,
        }
    return out


def step_times(models: dict, args: argparse.Namespace) -> dict[str, float]:
    target, draft = models["target"], models["tiny-draft"]
    for net in (target, draft):
        net.setup_cache(1, models["cache_len"])
    return {
        "target_1": step_ms(target, (1,), False),
        f"target_{args.gamma + 1}": step_ms(target, (args.gamma + 1,), False),
        "draft_1": step_ms(draft, (1,), False),
    }


def runs(
    models: dict, prompts: list[list[int]], args: argparse.Namespace, temperature: float
) -> dict[str, dict]:
    out: dict[str, dict] = {}
    alone = [
        autoregressive_generate(
            models["target"], p, args.max_new_tokens, temperature=temperature, seed=i
        ).stats.tokens_per_second
        for i, p in enumerate(prompts)
    ]
    out["target alone"] = {"tps": median(alone, NAN)}
    drafters = {
        "tiny-draft": (models["target"], models["tiny-draft"]),
        "tiny-eagle": (models["target_h"], models["tiny-eagle"]),
        "lookup": (models["target"], PromptLookupDrafter()),
    }
    for name, (target, drafter) in drafters.items():
        stats = [
            speculative_generate(
                target,
                drafter,
                p,
                args.max_new_tokens,
                gamma=args.gamma,
                temperature=temperature,
                seed=i,
            ).stats
            for i, p in enumerate(prompts)
        ]
        out[name] = {
            "tps": median([s.tokens_per_second for s in stats], NAN),
            "c": median([s.cost_ratio for s in stats if s.cost_ratio is not None], NAN),
            "alpha": median([s.acceptance_rate or 0.0 for s in stats], NAN),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("compiled", __doc__)
    parser.add_argument("--target", default="tiny-target")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "benchmarks_compiled.md"))
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.target)
    prompts = [tokenizer.encode(text) for text in STORY_OPENINGS[: args.prompts]] * args.repeats
    info, flags = describe_machine(args.threads)
    command = command_line("compiled", argv)
    lines = page_head("Eager against compiled decoding", command)
    lines += [f"The design is in [compiled.md]({link(args.out, DOCS / 'compiled.md')}).", ""]
    lines += machine_lines(info, flags)
    lines += [
        "",
        f"Target `{args.target}`, float32, γ {args.gamma}, {args.prompts} story openings × {args.repeats}, "
        f"{args.max_new_tokens} new tokens each; tokens/s and c are medians over the runs (decode speed, the "
        "prompt's pass excluded). Eager: projections stacked and weights prepacked for oneDNN (generate.py's "
        "default); compiled: stacked and compiled by model/fast/compile.py's CPU default (Inductor, max-autotune "
        "with freezing), whatever it measured (`--compile force`); the feature head is compiled too. "
        "The bandwidth bound of a target step is its weight bytes over the measured copy bandwidth "
        "(read + write bytes of a 1 GiB copy, median of 5): the step cannot be faster unless the weights sit "
        "in cache (here 58 MB against a 32 MB L3).",
        "",
    ]
    summary = ["| threads | | eager | compiled | compiled / eager |", "|---|---|---|---|---|"]
    compile_seconds: list[float] = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        built = setups(args)
        compile_seconds.append(built["compiled"]["compile_s"])
        steps = {name: step_times(models, args) for name, models in built.items()}
        bandwidth = copy_bandwidth()
        weights = sum(p.numel() * p.element_size() for p in built["eager"]["target"].parameters())
        weights += sum(
            4 * m.in_features * m.out_features
            for m in built["eager"]["target"].modules()
            if hasattr(m, "packed")
        )
        bound_ms = 1e3 * weights / bandwidth
        lines += [
            f"## {threads} thread(s)",
            "",
            f"Compile time of the four compiled models (target, draft, the head's target, the head): "
            f"{built['compiled']['compile_s']:.1f}s. Copy bandwidth "
            f"{bandwidth / 1e9:.1f} GB/s; the target's {weights / 1e6:.0f} MB of weights give a bound of "
            f"{bound_ms:.2f} ms per step.",
            "",
            "| step (ms) | eager | compiled | compiled / eager | bound / eager | bound / compiled |",
            "|---|---|---|---|---|---|",
        ]
        for key, label in (
            ("target_1", "target, 1 token"),
            (f"target_{args.gamma + 1}", f"target, {args.gamma + 1} tokens"),
            ("draft_1", "tiny-draft, 1 token"),
        ):
            e, c = steps["eager"][key], steps["compiled"][key]
            fractions = (
                f"{bound_ms / e:.0%} | {bound_ms / c:.0%}" if key.startswith("target") else " | "
            )
            lines.append(f"| {label} | {e:.3f} | {c:.3f} | {c / e:.2f} | {fractions} |")
            bound = (
                f" ({bound_ms / e:.0%} / {bound_ms / c:.0%} of the bandwidth bound)"
                if key.startswith("target")
                else ""
            )
            summary.append(
                f"| {threads} | {label} step{bound} | {e:.2f} ms | {c:.2f} ms | {c / e:.2f} |"
            )
        for temperature in (0.0, 1.0):
            results = {
                name: runs(models, prompts, args, temperature) for name, models in built.items()
            }
            label = "greedy" if temperature == 0 else f"T = {temperature:g}"
            lines += [
                "",
                f"### {label}",
                "",
                "| | eager tok/s | compiled tok/s | compiled / eager | c eager | c compiled | α |",
                "|---|---|---|---|---|---|---|",
            ]
            for name in results["eager"]:
                e, c = results["eager"][name], results["compiled"][name]
                summary.append(
                    f"| {threads} | {name}, {label}: tokens/s"
                    + (f" (c {e['c']:.3f} / {c['c']:.3f})" if "c" in e else "")
                    + f" | {e['tps']:.0f} | {c['tps']:.0f} | {c['tps'] / e['tps']:.2f} |"
                )
                ce = f"{e['c']:.3f}" if "c" in e else ""
                cc = f"{c['c']:.3f}" if "c" in c else ""
                alpha = f"{e['alpha']:.3f}" if "alpha" in e else ""
                lines.append(
                    f"| {name} | {e['tps']:.0f} | {c['tps']:.0f} | {c['tps'] / e['tps']:.2f} | {ce} | {cc} | "
                    f"{alpha} |"
                )
            print(
                f"threads {threads} {label}: "
                + ", ".join(
                    f"{n} {results['compiled'][n]['tps'] / results['eager'][n]['tps']:.2f}x"
                    for n in results["eager"]
                ),
                file=sys.stderr,
                flush=True,
            )
        lines.append("")
    compile_times = ", ".join(
        f"{t} thread(s) {s:.0f} s" for t, s in zip(args.threads, compile_seconds)
    )
    lines += [
        "## Summary",
        "",
        "Eager: stacked + prepacked (the default set-up); compiled: model/fast/compile.py's "
        "default. Compile time of target, draft, the head's target and the head: "
        f"{compile_times}.",
        "",
    ]
    lines += summary
    write_page(args.out, "\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
