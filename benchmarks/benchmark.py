"""Tokens per second of speculative decoding against its baselines, in one run on one machine.

    python benchmarks/benchmark.py                                   # the full run: docs/benchmarks.md + PNG
    python benchmarks/benchmark.py --prompts 1 --repeats 1 --max-new-tokens 16 --gammas 1 2 \\
        --out /tmp/bench.md --plot /tmp/bench.png                    # a smoke run

For the same pair, the same prompts and the same number of new tokens (end-of-sequence
ignored), greedy and at temperature 1, it times:

* this project, target alone (``autoregressive_generate``): the baseline;
* this project, speculative with gamma = 1..8 and "auto" (``speculative_generate``);
* transformers' ``generate`` on the same HF-layout checkpoints, target alone, and with
  ``assistant_model`` (assisted generation) both with its defaults and with a constant
  gamma, the same algorithm as ours.

Every call is timed end to end with the wall clock (cache allocation and the prompt's
forward included, the same for every method). Runs are interleaved (repeat > prompt >
temperature > method) so that a change in machine load hits all methods alike; each
table cell is a median over prompts x repeats. The measured speedup is compared with the
paper's prediction (1 - a^(g+1)) / ((1 - a)(g c + 1)) from the measured alpha and c.

Do not run it while anything else loads the machine: it measures the machine.
transformers is used here only as a reference, never by the runtime code.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.fuse import prepare_for_decoding  # noqa: E402
from speculative import (  # noqa: E402
    autoregressive_generate,
    expected_speedup,
    expected_tokens_per_iteration,
    speculative_generate,
)
from weights import load_model, load_tokenizer, resolve  # noqa: E402

PROMPTS = [
    "Once upon a time",
    "One day, a little girl named Lily found a",
    "Tom and his dog went to the park. They",
    "The sun was shining and the birds were singing. Ben wanted to",
    "There was a big red ball in the garden.",
    "Mia had a small cat called Fluffy. Every morning,",
    "Once upon a time, in a land far away, there lived a wise old owl who",
    "The boy looked at the sky and said,",
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class Method:
    """One row of the table."""

    key: str  # "target", "spec", "hf-target", "hf-assisted", "hf-assisted-const"
    gamma: int | str | None = None
    label: str = ""


@dataclass
class Runs:
    """Every timed run of one method at one temperature."""

    tps: list[float] = field(default_factory=list)
    alpha: list[float] = field(default_factory=list)
    c: list[float] = field(default_factory=list)
    per_call: list[float] = field(default_factory=list)  # tokens per target call
    gamma: list[float] = field(default_factory=list)  # mean gamma (differs from the setting under auto)
    # where the time goes, in seconds: one autoregressive step; one draft step, one verification call and the
    # loop's own overhead (verification arithmetic, sampling, bookkeeping) per iteration
    ar_step: list[float] = field(default_factory=list)
    draft_step: list[float] = field(default_factory=list)
    verify_call: list[float] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> tokens of the first repeat


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ----------------------------------------------------------------------------- runners
def run_ours(method: Method, target: Any, draft: Any, prompt: list[int], new_tokens: int, temperature: float,
             seed: int) -> tuple[float, list[int], Any]:
    start = time.perf_counter()
    if method.key == "target":
        result = autoregressive_generate(target, prompt, new_tokens, temperature=temperature, seed=seed)
    else:
        result = speculative_generate(target, draft, prompt, new_tokens, gamma=method.gamma,
                                      temperature=temperature, seed=seed)
    return time.perf_counter() - start, result.tokens, result.stats


def run_hf(method: Method, hf_target: Any, hf_draft: Any, prompt: list[int], new_tokens: int, temperature: float,
           seed: int) -> tuple[float, list[int], Any]:
    kwargs: dict[str, Any] = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if method.key != "hf-target":
        config = hf_draft.generation_config
        if method.key == "hf-assisted-const":  # our algorithm: always gamma drafts, no early stop
            config.num_assistant_tokens, config.num_assistant_tokens_schedule = method.gamma, "constant"
            config.assistant_confidence_threshold = 0.0
        else:  # transformers' defaults
            config.num_assistant_tokens = config.num_assistant_tokens_schedule = None
            config.assistant_confidence_threshold = None
        kwargs["assistant_model"] = hf_draft
    input_ids = torch.tensor([prompt], device=hf_target.device)
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    seconds = time.perf_counter() - start
    return seconds, out[0, len(prompt):].tolist(), None


def load_hf(directory: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = LlamaForCausalLM.from_pretrained(str(directory), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # time exactly max_new_tokens, like ours
    model.generation_config.pad_token_id = 0
    return model


def record(runs: Runs, stats: Any, key: str) -> None:
    """Keep what the library measured inside one call."""
    if key == "target":
        runs.ar_step.append(stats.target_time_s / stats.target_calls)
        return
    for name, values in (("acceptance_rate", runs.alpha), ("cost_ratio", runs.c),
                         ("tokens_per_target_call", runs.per_call), ("gamma", runs.gamma)):
        value = getattr(stats, name)
        if value is not None:
            values.append(float(value))
    if stats.draft_calls:
        runs.draft_step.append(stats.draft_time_s / stats.draft_calls)
    runs.verify_call.append(stats.target_time_s / stats.target_calls)
    runs.overhead.append((stats.decode_time_s - stats.draft_time_s - stats.target_time_s) / stats.target_calls)


# ----------------------------------------------------------------------------- report
def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"CPU": cpu, "cores": str(os.cpu_count()), "torch threads": str(torch.get_num_threads()),
            "torch": torch.__version__, "python": platform.python_version(), "OS": platform.platform(),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else format(value, spec) + suffix


def report(args: argparse.Namespace, methods: list[Method], results: dict[tuple[float, str], Runs],
           info: dict[str, str], plot_name: str | None) -> tuple[str, list[str]]:
    lines = ["# Benchmarks", "",
             "Generated by `benchmarks/benchmark.py`; do not edit by hand. Command:", "",
             f"    python benchmarks/benchmark.py {' '.join(sys.argv[1:])}".rstrip(), "",
             "## Setup", "",
             f"Pair: draft `{args.draft}` → target `{args.target}`, {args.dtype} on {args.device}"
             f"{prepack_note(args)}. "
             f"{args.prompts} prompts × {args.repeats} repeats, {args.max_new_tokens} new tokens each "
             "(end-of-sequence ignored). tokens/s is the median over prompts and repeats of new tokens / wall "
             "time of the whole call (cache allocation and the prompt's forward included, for every method alike). "
             "α is the paper's acceptance rate (mean of Σ min(p, q) over verified positions), c the measured cost "
             "ratio (draft step / target call), both medians over runs; the prediction is "
             "(1 − α^(γ+1)) / ((1 − α)(γc + 1)) with the row's own α, c and γ.", "",
             "| machine | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    notes: list[str] = []
    for temperature in args.temperatures:
        base = median(results[(temperature, "target")].tps)
        hf_base = median(results[(temperature, "hf-target")].tps) if (temperature, "hf-target") in results else None
        title = "greedy (temperature 0)" if temperature == 0 else f"temperature {temperature:g}"
        lines += ["", f"## {title}", "",
                  "| method | γ | tokens/s | speedup vs target alone | α | c | tokens/target call | predicted "
                  "tokens/call | predicted speedup | measured / predicted |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for m in methods:
            runs = results.get((temperature, m.label))
            if runs is None or not runs.tps:
                continue
            tps = median(runs.tps)
            speedup = tps / base if base else None
            alpha, c, gamma = median(runs.alpha), median(runs.c), median(runs.gamma)
            pred_call = pred = None
            if alpha is not None and gamma is not None:
                pred_call = expected_tokens_per_iteration(alpha, gamma)
                pred = expected_speedup(alpha, gamma, c) if c is not None else None
            ratio = speedup / pred if speedup and pred else None
            shown_gamma = m.gamma if m.gamma != "auto" else f"auto (mean {fmt(gamma, '.1f')})"
            lines.append(f"| {m.label} | {shown_gamma if shown_gamma is not None else '–'} | {tps:.1f} | "
                         f"{fmt(speedup, '.2f', '×')} | {fmt(alpha, '.3f')} | {fmt(c, '.3f')} | "
                         f"{fmt(median(runs.per_call))} | {fmt(pred_call)} | {fmt(pred, '.2f', '×')} | "
                         f"{fmt(ratio, '.2f')} |")
        lines += decomposition(temperature, methods, results)
        if hf_base and base:
            lines += ["", f"This project's target alone runs at {base / hf_base:.2f}× the tokens/s of transformers' "
                          "`generate` on the same checkpoint."]
        notes += goals(args, temperature, results)
    if notes:
        lines += ["", "## Goals", ""] + [f"* {n}" for n in notes]
    agree = greedy_agreement(args, results)
    if agree:
        lines += ["", "## Sanity", "", agree]
    if plot_name:
        lines += ["", "## Measured speedup against the cost model", "", f"![speedup vs gamma]({plot_name})", "",
                  "Points: measured speedup over the target alone (median tokens/s ratio). Lines: the paper's "
                  "prediction from the α and c measured over all fixed-γ runs at that temperature."]
    return "\n".join(lines) + "\n", notes


def prepack_note(args: argparse.Namespace) -> str:
    fused = (f"q/k/v and gate/up stacked into one product each ({args.fused} groups, model/fuse.py)"
             if args.fused else "projections not stacked (--no-fuse)")
    if args.prepacked:
        return (f"; this project's runs, as generate.py: {fused}, and weights reordered once for oneDNN "
                f"({args.prepacked} linear layers, model/prepack.py); transformers' runs use PyTorch's defaults")
    return f"; this project's runs: {fused}, no weights prepacked (--no-prepack, or not a float32 CPU run)"


def refined_speedup(baseline: Runs, runs: Runs) -> float | None:
    """E[tokens per iteration] x (AR step) / (gamma x draft step + verify call + loop overhead), all measured."""
    values = (median(runs.alpha), median(runs.gamma), median(runs.draft_step), median(runs.verify_call),
              median(runs.overhead), median(baseline.ar_step))
    if any(v is None for v in values):
        return None
    alpha, gamma, draft, verify, overhead, ar = values
    return expected_tokens_per_iteration(alpha, gamma) * ar / (gamma * draft + verify + overhead)


def decomposition(temperature: float, methods: list[Method], results: dict[tuple[float, str], Runs]) -> list[str]:
    """Where an iteration's time goes, and the prediction with the measured times instead of the paper's
    assumption that verifying gamma + 1 tokens costs one autoregressive step."""
    ar = median(results[(temperature, "target")].ar_step)
    rows = []
    for m in methods:
        runs = results.get((temperature, m.label))
        if m.key != "spec" or runs is None or not runs.verify_call:
            continue
        draft, verify, overhead = median(runs.draft_step), median(runs.verify_call), median(runs.overhead)
        refined = refined_speedup(results[(temperature, "target")], runs)
        if refined is None or ar is None:
            continue
        rows.append(f"| {m.label} | {ar * 1e3:.2f} | {draft * 1e3:.2f} | {draft / ar:.3f} | {verify * 1e3:.2f} | "
                    f"{verify / ar:.2f} | {overhead * 1e3:.2f} | {refined:.2f}× |")
    if not rows:
        return []
    return ["", "Where the time goes (medians, milliseconds). The paper assumes a verification call on γ + 1 tokens "
            "costs one autoregressive step (verify / AR step = 1) and ignores the loop's own work; the last column "
            "predicts with the measured times instead: E[tokens] × AR step / (γ × draft step + verify call + "
            "overhead).", "",
            "| method | AR step | draft step | draft / AR step | verify call | verify / AR step | overhead per "
            "iteration | prediction from measured times |",
            "|---|---|---|---|---|---|---|---|"] + rows


def goals(args: argparse.Namespace, temperature: float, results: dict[tuple[float, str], Runs]) -> list[str]:
    """The repository's targets for the shipped pair, checked against this run."""
    base = median(results[(temperature, "target")].tps)
    spec = {label: median(r.tps) for (t, label), r in results.items() if t == temperature and label.startswith("spec")}
    if not spec or not base:
        return []
    best_label = max(spec, key=lambda k: spec[k])
    name = "greedy" if temperature == 0 else f"T={temperature:g}"
    out = []
    speedup = spec[best_label] / base
    if temperature == 0:
        out.append(f"{name}: best speculative ({best_label}) is {speedup:.2f}× the target alone "
                   f"(goal ≥ 2×: {'met' if speedup >= 2 else 'NOT met'}).")
    off: list[tuple[float, str, float]] = []
    off_refined: list[float] = []
    for (t, label), runs in results.items():
        if t != temperature or not label.startswith("spec γ="):
            continue
        alpha, c, gamma = median(runs.alpha), median(runs.c), median(runs.gamma)
        if alpha is None or c is None or gamma is None:
            continue
        ratio = (median(runs.tps) / base) / expected_speedup(alpha, gamma, c)
        off.append((abs(ratio - 1), label, ratio))
        refined = refined_speedup(results[(temperature, "target")], runs)
        if refined is not None:
            off_refined.append(abs((median(runs.tps) / base) / refined - 1))
    if off:
        worst = max(off)
        within = sum(1 for d, _, _ in off if d <= 0.10)
        out.append(f"{name}: measured speedup within 10% of the paper's prediction for {within} of {len(off)} fixed "
                   f"γ (worst: {worst[1]}, measured/predicted {worst[2]:.2f}).")
    if off_refined:
        within = sum(1 for d in off_refined if d <= 0.10)
        out.append(f"{name}: within 10% of the prediction from measured call times for {within} of "
                   f"{len(off_refined)} fixed γ (worst deviation {100 * max(off_refined):.0f}%).")
    for hf_label in ("hf assisted (defaults)", f"hf assisted (γ={args.hf_gamma}, constant)"):
        hf = results.get((temperature, hf_label))
        if hf and hf.tps:
            ratio = spec[best_label] / median(hf.tps)
            goal = " (goal ≥ 3×: " + ("met)" if ratio >= 3 else "NOT met)") if "defaults" in hf_label else ""
            out.append(f"{name}: best speculative is {ratio:.2f}× the tokens/s of transformers' {hf_label}{goal}.")
    return out


def greedy_agreement(args: argparse.Namespace, results: dict[tuple[float, str], Runs]) -> str:
    """Greedy speculative output must equal greedy target output (up to float ties)."""
    if 0.0 not in args.temperatures:
        return ""
    ref = results[(0.0, "target")].tokens
    parts = []
    for (t, label), runs in results.items():
        if t != 0.0 or label == "target":
            continue
        same = sum(runs.tokens.get(i) == ref.get(i) for i in ref)
        parts.append(f"{label} {same}/{len(ref)}")
    return ("Greedy outputs identical to this project's target alone, prompts out of "
            f"{len(ref)} (float32 near-ties may legitimately differ): " + "; ".join(parts) + ".")


def plot(path: Path, args: argparse.Namespace, results: dict[tuple[float, str], Runs]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    gammas = sorted(g for g in args.gammas)
    for temperature, color in zip(args.temperatures, ["tab:blue", "tab:orange", "tab:green", "tab:red"]):
        base = median(results[(temperature, "target")].tps)
        fixed = [results[(temperature, f"spec γ={g}")] for g in gammas]
        measured = [median(r.tps) / base for r in fixed]
        alpha = median([a for r in fixed for a in r.alpha])
        c = median([x for r in fixed for x in r.c])
        name = "greedy" if temperature == 0 else f"T={temperature:g}"
        ax.plot(gammas, measured, "o", color=color, label=f"{name}: measured")
        if alpha is not None and c is not None:
            dense = [g / 10 for g in range(10, 10 * max(gammas) + 1)]
            ax.plot(dense, [expected_speedup(alpha, g, c) for g in dense], "--", color=color,
                    label=f"{name}: predicted (α={alpha:.2f}, c={c:.3f})")
        refined = [refined_speedup(results[(temperature, "target")], r) for r in fixed]
        if all(v is not None for v in refined):
            ax.plot(gammas, refined, "x:", color=color, label=f"{name}: predicted from measured call times")
        auto = results.get((temperature, "spec auto"))
        if auto and auto.tps:
            ax.plot([median(auto.gamma)], [median(auto.tps) / base], "*", ms=12, color=color,
                    label=f"{name}: γ=auto (at its mean γ)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("γ (draft tokens per target call)")
    ax.set_ylabel("speedup over the target alone")
    ax.set_title(f"{args.draft} → {args.target}, {args.device} {args.dtype}, {torch.get_num_threads()} threads")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="tiny-target", help="target checkpoint (default tiny-target)")
    parser.add_argument("--draft", default="tiny-draft", help="draft checkpoint (default tiny-draft)")
    parser.add_argument("--device", default="cpu", help="device (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype (default float32)")
    parser.add_argument("--prompts", type=int, default=5, help=f"how many built-in prompts, 1..{len(PROMPTS)} "
                                                                 "(default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of every prompt (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per call (default 128)")
    parser.add_argument("--gammas", type=int, nargs="+", default=list(range(1, 9)), help="fixed gammas (default 1..8)")
    parser.add_argument("--no-auto", action="store_true", help="skip gamma=auto")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0],
                        help="temperatures (default 0 1)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    parser.add_argument("--no-prepack", action="store_true",
                        help="do not reorder this project's float32 CPU weights for oneDNN (model/prepack.py), as "
                             "generate.py --no-prepack")
    parser.add_argument("--no-fuse", action="store_true",
                        help="do not stack q/k/v and gate/up into one product each (model/fuse.py), as "
                             "generate.py --no-fuse")
    parser.add_argument("--hf-gamma", type=int, default=4,
                        help="gamma of the constant-gamma assisted-generation row (default 4)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help=f"torch CPU threads (default: all cores, {os.cpu_count()} here)")
    parser.add_argument("--seed", type=int, default=0, help="base seed for sampling (default 0)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="markdown report")
    parser.add_argument("--plot", default=str(ROOT / "docs" / "benchmark_speedup.png"), help="PNG plot ('' for none)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS) or args.repeats < 1 or args.max_new_tokens < 1 or args.threads < 1:
        sys.exit("error: --prompts must be in 1..8, --repeats, --max-new-tokens and --threads >= 1")
    if any(g < 1 for g in args.gammas) or any(t < 0 for t in args.temperatures):
        sys.exit("error: gammas must be >= 1 and temperatures >= 0")
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    target = load_model(args.target, device=args.device, dtype=dtype)
    draft = load_model(args.draft, device=args.device, dtype=dtype)
    counts = [prepare_for_decoding(model, stack=not args.no_fuse, prepack=not args.no_prepack)
              for model in (target, draft)]  # as generate.py
    args.fused, args.prepacked = (sum(column) for column in zip(*counts))
    tokenizer = load_tokenizer(args.target)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:args.prompts]]
    limit = min(target.config.max_seq_len, draft.config.max_seq_len)
    if max(len(p) for p in prompts) + args.max_new_tokens > limit:
        sys.exit(f"error: --max-new-tokens {args.max_new_tokens} does not fit in the {limit}-token context")

    methods = [Method("target", None, "target")]
    methods += [Method("spec", g, f"spec γ={g}") for g in args.gammas]
    if not args.no_auto:
        methods.append(Method("spec", "auto", "spec auto"))
    hf_target = hf_draft = None
    if not args.no_hf:
        hf_target = load_hf(resolve(args.target), dtype, args.device)
        hf_draft = load_hf(resolve(args.draft), dtype, args.device)
        methods += [Method("hf-target", None, "hf target"), Method("hf-assisted", None, "hf assisted (defaults)"),
                    Method("hf-assisted-const", args.hf_gamma, f"hf assisted (γ={args.hf_gamma}, constant)")]

    def call(m: Method, prompt: list[int], n: int, t: float, seed: int) -> tuple[float, list[int], Any]:
        if m.key.startswith("hf"):
            return run_hf(m, hf_target, hf_draft, prompt, n, t, seed)
        return run_ours(m, target, draft, prompt, n, t, seed)

    for m in methods:  # warm-up: first-call allocations and lazy initialisation stay out of the numbers
        for t in args.temperatures:
            call(m, prompts[0], min(8, args.max_new_tokens), t, args.seed)

    results: dict[tuple[float, str], Runs] = {(t, m.label): Runs() for t in args.temperatures for m in methods}
    total = args.repeats * len(prompts) * len(args.temperatures) * len(methods)
    done, start = 0, time.perf_counter()
    for r in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for t in args.temperatures:
                for m in methods:
                    seed = args.seed + 1000 * i + r
                    seconds, tokens, stats = call(m, prompt, args.max_new_tokens, t, seed)
                    runs = results[(t, m.label)]
                    runs.tps.append(len(tokens) / seconds)
                    if r == 0:
                        runs.tokens[i] = tokens
                    if stats is not None:
                        record(runs, stats, m.key)
                    done += 1
                    print(f"\r[{done}/{total}] {time.perf_counter() - start:.0f}s  T={t:g} prompt {i} repeat {r} "
                          f"{m.label}: {len(tokens) / seconds:.1f} tokens/s   ", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    plot_path = Path(args.plot) if args.plot else None
    if plot_path is not None:
        plot(plot_path, args, results)
    out = Path(args.out)
    rel = os.path.relpath(plot_path, out.parent) if plot_path is not None else None
    text, notes = report(args, methods, results, machine(), rel)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print("\n".join(notes))
    print(f"wrote {out}" + (f" and {plot_path}" if plot_path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
