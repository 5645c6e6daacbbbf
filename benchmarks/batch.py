"""Batched speculation against the batched target alone, batch sizes 1..32, and the cost
model extended to batches.

    python -m benchmarks.batch                                   # the shipped pair, 2 threads
    python -m benchmarks.batch --batch-sizes 1 4 16 --temperatures 0 --threads 1
    python -m benchmarks.batch --prompts-per-row 3 --batch-sizes 1 2 4 8 16 --gammas 2 3 4 6 --temperatures 0 \\
        --no-single --out docs/results/benchmarks_batch_continuous.md \\
        --plot docs/results/benchmark_batch_continuous.png          # continuous batching

For every batch size B: the batched target alone (autoregressive_generate_batch) and
speculative_generate_batch with the drafter at every γ of --gammas (the best one is
reported), greedy and at T = 1: total tokens/s (all rows' new tokens over the call's time)
and per-row tokens/s (a row's tokens over the time it spent in the batch). Runs are timed in
turns (target, then each γ) and repeated, and medians reported.

The cost model, per batch size, from calls timed apart (median of many): T(B, w), one
target call of B rows of w new tokens each at the benchmark's context; D(B), one draft call
of B rows of one token (also timed apart, for the table); V(B), the host work of an
iteration (verification, bookkeeping), read from the runs. With α from the runs at that B,
τ(α, γ) = (1 - α^(γ+1)) / (1 - α) and B' the mean number of rows per iteration (rows that
accept more finish sooner and leave; the target alone keeps all B rows in step):

    predicted speedup(B, γ) = (B' / B) · τ(α, γ) · S(B) / (γ · D(B) + T(B', γ+1) + V(B))

where S(B) is the target-alone step and D(B) the draft step as measured inside the runs
(sampling included); c(B) = D(B) / T(B, 1) and the verification cost T(B, γ+1) / T(B, 1)
are the two functions of B that decide the crossover.

The crossover is the smallest B where the best γ's speedup falls below 1. The report
(docs/results/benchmarks_batch.md) and the plot (docs/results/benchmark_batch.png) show both;
docs/batching.md explains them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.harness import (
    DOCS,
    NAN,
    RESULTS,
    command_line,
    describe_machine,
    link,
    machine_lines,
    median,
    network,
    page_head,
    prepare_networks,
    pyplot,
    save_figure,
    script_parser,
    time_call,
    write_page,
)
from model import call as cache_calls
from speculative import (
    autoregressive_generate_batch,
    speculative_generate,
    speculative_generate_batch,
)
from speculative.draft.protocol import trait
from speculative.engine.cost import expected_tokens_per_iteration
from weights import load_drafter, load_model, load_tokenizer

NAMES = ["Lily", "Tom", "Ben", "Mia", "Sue", "Max", "Anna", "Sam"]
THINGS = [
    "a red ball",
    "a small dog",
    "a big box",
    "a new kite",
    "a shiny key",
    "a little bird",
    "a blue car",
    "a funny hat",
]


def prompts_text(count: int) -> list[str]:
    """Story openings (names x things, 64 distinct, then repeated), as a user of the shipped pair types them."""
    distinct = [f"Once upon a time, {name} found {thing}." for thing in THINGS for name in NAMES]
    return [distinct[i % len(distinct)] for i in range(count)]


# ----------------------------------------------------------------------------- timed calls
@torch.inference_mode()
def call_time(model, rows: int, width: int, context: int, calls: int) -> float:
    """Median seconds of one call of ``rows`` rows of ``width`` new tokens at ``context``
    (rows at positions context, context+1, ... so that the per-row path runs, as in the loop)."""
    model.setup_cache(rows, context + width + rows + 1)
    tokens = torch.randint(0, model.config.vocab_size, (rows, context + rows))
    model(tokens, cache_calls.chain(0, context + rows, tokens.device, rows=rows))  # fill the cache
    starts = [context + b % 2 for b in range(rows)] if rows > 1 else [context]
    feed = torch.randint(0, model.config.vocab_size, (rows, width))
    return time_call(
        lambda: model(feed, cache_calls.ragged(starts, width, model.cache_len, feed.device)),
        calls,
        warmup=3,
    ).median


@torch.inference_mode()
def draft_call_time(drafter, target, rows: int, context: int, calls: int) -> float:
    """D(B): one drafter call for B rows of one token (a draft model's forward, or a feature
    head's forward plus the target's output head)."""
    net = network(drafter)
    if net is None:
        return 0.0
    if trait(drafter, "head") is not None:
        net.setup_cache(rows, context + 4)
        feats = torch.randn(rows, 1, net.config.dim)
        tokens = torch.randint(0, target.config.vocab_size, (rows, 1))
        starts = [context + b % 2 for b in range(rows)] if rows > 1 else [context]

        def step():
            call = cache_calls.ragged(starts, 1, net.cache_len, "cpu")
            return target.lm_head(net(feats, target.embed_tokens(tokens), call))

        return time_call(step, calls, warmup=3).median
    return call_time(net, rows, 1, context, calls)


# ----------------------------------------------------------------------------- runs
def run_target(target, prompts, args, temperature, seed, size):
    out = autoregressive_generate_batch(
        target, prompts, args.max_new_tokens, temperature=temperature, seed=seed, batch_size=size
    )
    return out.stats, out.results


def run_spec(target, drafter, prompts, args, temperature, gamma, seed, size):
    out = speculative_generate_batch(
        target,
        drafter,
        prompts,
        args.max_new_tokens,
        gamma=gamma,
        temperature=temperature,
        seed=seed,
        batch_size=size,
    )
    return out.stats, out.results


def row_rate(results) -> float:
    """Median over rows of a row's tokens over its time in the batch."""
    rates = []
    for r in results:
        seconds = getattr(r.stats, "decode_time_s", 0.0) or getattr(r.stats, "target_time_s", 0.0)
        if seconds:
            rates.append(len(r.tokens) / seconds)
    return median(rates, NAN)


def measure(args, target, drafters: dict, prompts) -> dict:
    """Every (temperature, batch size): the target alone, then every drafter at every gamma,
    in turns, --repeats times; medians."""
    out: dict = {"rows": []}
    for temperature in args.temperatures:
        for size in args.batch_sizes:
            batch = prompts[: size * args.prompts_per_row]
            cells: dict = {"target": [], "target_row": [], "step": []}
            keys = (
                "tps",
                "row",
                "alpha",
                "tau",
                "verify",
                "iters",
                "mean_batch",
                "draft_step",
                "call",
            )
            spec = {(name, g): {k: [] for k in keys} for name in drafters for g in args.gammas}
            for rep in range(args.repeats):
                seed = 1000 * rep
                stats, results = run_target(target, batch, args, temperature, seed, size)
                cells["target"].append(stats.tokens_per_second)
                cells["target_row"].append(row_rate(results))
                cells["step"].append(stats.target_time_s / max(stats.iterations, 1))
                for (name, g), cell in spec.items():
                    stats, results = run_spec(
                        target, drafters[name], batch, args, temperature, g, seed, size
                    )
                    cell["tps"].append(stats.tokens_per_second)
                    cell["row"].append(row_rate(results))
                    cell["alpha"].append(stats.acceptance_rate or 0.0)
                    cell["tau"].append(stats.tokens_per_row_iteration or 0.0)
                    cell["verify"].append(stats.verify_time_s / max(stats.iterations, 1))
                    cell["iters"].append(stats.iterations)
                    cell["mean_batch"].append(stats.mean_batch or 0.0)
                    cell["draft_step"].append(stats.draft_time_s / max(stats.draft_calls, 1))
                    cell["call"].append(stats.target_time_s / max(stats.iterations, 1))
            target_tps = median(cells["target"], NAN)
            row = {
                "temperature": temperature,
                "batch": size,
                "target_tps": target_tps,
                "target_step": median(cells["step"], NAN),
                "target_row_tps": median(cells["target_row"], NAN),
                "drafters": {},
            }
            for name in drafters:
                gammas = {
                    g: {k: median(v, NAN) for k, v in spec[name, g].items()} for g in args.gammas
                }
                for cell in gammas.values():
                    cell["speedup"] = cell["tps"] / target_tps
                best = max(gammas, key=lambda g: gammas[g]["tps"])
                row["drafters"][name] = {"gammas": gammas, "best_gamma": best}
                print(
                    f"T={temperature} B={size} {name}: target {target_tps:.0f} tok/s; best γ {best}: "
                    f"{gammas[best]['tps']:.0f} tok/s ({gammas[best]['speedup']:.2f}x), "
                    f"α {gammas[best]['alpha']:.3f}",
                    file=sys.stderr,
                    flush=True,
                )
            out["rows"].append(row)
    return out


def cost_model(args, target, drafters: dict, context: int) -> dict:
    model: dict = {}
    widths = sorted({1} | {g + 1 for g in args.gammas})
    for size in args.batch_sizes:
        model[size] = {
            "T": {w: call_time(target, size, w, context, args.calls) for w in widths},
            "D": {
                name: draft_call_time(d, target, size, context, args.calls)
                for name, d in drafters.items()
            },
        }
        print(
            f"B={size}: T(B,1) {model[size]['T'][1] * 1e3:.2f} ms, T(B,{max(widths)}) "
            f"{model[size]['T'][max(widths)] * 1e3:.2f} ms, D(B) "
            + ", ".join(f"{n} {v * 1e3:.2f} ms" for n, v in model[size]["D"].items()),
            file=sys.stderr,
            flush=True,
        )
    return model


def predicted(row: dict, costs: dict, name: str, gamma: int) -> float:
    """The cost model at batch B: tau(alpha, gamma) target steps' worth of tokens per row for
    gamma draft steps, one verification call of gamma+1 tokens per row and the host work.
    The target step and the draft step are as measured in the runs (they include sampling),
    the verification call is the isolated T(B, gamma+1)."""
    cell, size = row["drafters"][name]["gammas"][gamma], row["batch"]
    tau = expected_tokens_per_iteration(cell["alpha"], gamma)
    rows = cell["mean_batch"] or size
    call = interpolate(costs, rows, gamma + 1)
    return (
        (rows / size)
        * tau
        * row["target_step"]
        / (gamma * cell["draft_step"] + call + cell["verify"])
    )


def interpolate(costs: dict, rows: float, width: int) -> float:
    """T(rows, width), linear between the measured batch sizes (rows need not be an integer)."""
    sizes = sorted(costs)
    below = max([s for s in sizes if s <= rows], default=sizes[0])
    above = min([s for s in sizes if s >= rows], default=sizes[-1])
    if above == below:
        return costs[below]["T"][width]
    share = (rows - below) / (above - below)
    return (1 - share) * costs[below]["T"][width] + share * costs[above]["T"][width]


def single_path(args, target, drafter, prompts) -> dict:
    """Batch 1 against today's single-prompt loop, the same prompts, in turns (greedy)."""
    single, batched = [], []
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts[:8]):
            a = time_call(
                lambda prompt=prompt, i=i: speculative_generate(
                    target, drafter, prompt, args.max_new_tokens, gamma=4, temperature=0, seed=i
                )
            )
            single.append(len(a.result.tokens) / a.median)
            b = time_call(
                lambda prompt=prompt, i=i: speculative_generate_batch(
                    target, drafter, [prompt], args.max_new_tokens, gamma=4, temperature=0, seed=i
                )
            )
            batched.append(len(b.result.results[0].tokens) / b.median)
    return {
        "single_tps": median(single, NAN),
        "batch1_tps": median(batched, NAN),
        "ratio": median(batched, NAN) / median(single, NAN),
    }


# ----------------------------------------------------------------------------- report
def crossover(rows: list[dict], key) -> int | None:
    for row in rows:
        if key(row) < 1:
            return row["batch"]
    return None


def best(row: dict) -> tuple[str, int]:
    """The drafter and gamma with the most tokens/s in this row."""
    return max(
        ((n, d["best_gamma"]) for n, d in row["drafters"].items()),
        key=lambda ng: row["drafters"][ng[0]]["gammas"][ng[1]]["tps"],
    )


def render(args, info, flags, results, costs, single, command) -> str:
    stream = (
        f"{args.prompts_per_row} prompts per row ({args.prompts_per_row} × B prompts through a batch of B "
        "rows: continuous batching keeps it full)"
        if args.prompts_per_row > 1
        else "as many prompts as rows (rows that finish early leave a smaller batch behind)"
    )
    batching = link(args.out, DOCS / "batching.md")
    lines = page_head("Batched speculation on this machine", command)
    lines += [f"What the numbers mean: [batching.md]({batching}).", ""] + machine_lines(info, flags)
    lines += [
        "",
        f"Target `{args.target}`, drafters {', '.join(f'`{d}`' for d in args.drafters)}, float32, "
        f"{args.threads} thread(s); {args.max_new_tokens} new tokens per prompt (end-of-sequence ignored), "
        f"story openings, {stream}; γ ∈ {{{', '.join(map(str, args.gammas))}}}, the best reported; "
        f"{args.repeats} repeats in turns, medians. Total tokens/s: all rows' new tokens over the whole batched "
        "call (the prompts' reading included). Per-row tokens/s: a row's tokens over its time in the batch, "
        f"median over rows. T, D and V are explained in [batching.md]({batching}#what-batching-does-to-the-"
        "speedup); D is the draft step as measured in the runs (timed alone in brackets), c(B) = D / T(B,1).",
        "",
    ]
    if single:
        lines += [
            "## Batch 1 against the single-prompt loop",
            "",
            f"Greedy, γ 4, `{args.drafters[0]}`, 8 prompts in turns: single-prompt loop "
            f"{single['single_tps']:.0f} tokens/s, batched loop with one prompt {single['batch1_tps']:.0f} "
            f"tokens/s: **{single['ratio']:.3f}×**.",
            "",
        ]
    for temperature in args.temperatures:
        rows = [r for r in results["rows"] if r["temperature"] == temperature]
        name = "greedy" if temperature == 0 else f"T = {temperature:g}"
        lines += [
            f"## {name}",
            "",
            "| batch | target alone tok/s | per row | best: drafter, γ | tok/s | per row | "
            "speedup | predicted |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            n, g = best(r)
            cell = r["drafters"][n]["gammas"][g]
            lines.append(
                f"| {r['batch']} | {r['target_tps']:.0f} | {r['target_row_tps']:.1f} | `{n}`, γ {g} | "
                f"{cell['tps']:.0f} | {cell['row']:.1f} | **{cell['speedup']:.2f}×** | "
                f"{predicted(r, costs, n, g):.2f}× |"
            )
        for drafter in args.drafters:
            lines += [
                "",
                f"### `{drafter}`, {name}",
                "",
                "| batch | speedup (best γ) | predicted | α | τ per row-iteration | mean rows | T(B,1) ms | "
                "T(B,γ+1) ms | D(B) ms | c(B) | verify cost T(B,γ+1)/T(B,1) | V(B) ms |",
                "|" + "---|" * 12,
            ]
            for r in rows:
                g = r["drafters"][drafter]["best_gamma"]
                cell, c = r["drafters"][drafter]["gammas"][g], costs[r["batch"]]
                lines.append(
                    f"| {r['batch']} | **{cell['speedup']:.2f}×** (γ {g}) | {predicted(r, costs, drafter, g):.2f}× | "
                    f"{cell['alpha']:.3f} | {cell['tau']:.2f} | {cell['mean_batch']:.1f} | {c['T'][1] * 1e3:.2f} | "
                    f"{c['T'][g + 1] * 1e3:.2f} | {cell['draft_step'] * 1e3:.2f} ({c['D'][drafter] * 1e3:.2f}) | "
                    f"{cell['draft_step'] / c['T'][1]:.3f} | {c['T'][g + 1] / c['T'][1]:.2f} | "
                    f"{cell['verify'] * 1e3:.2f} |"
                )
            measured_x = crossover(
                rows,
                lambda r, d=drafter: r["drafters"][d]["gammas"][r["drafters"][d]["best_gamma"]][
                    "speedup"
                ],
            )
            predicted_x = crossover(
                rows, lambda r, d=drafter: max(predicted(r, costs, d, g) for g in args.gammas)
            )
            errors = [
                abs(
                    predicted(r, costs, drafter, g) / r["drafters"][drafter]["gammas"][g]["speedup"]
                    - 1
                )
                for r in rows
                for g in args.gammas
            ]
            beyond = f"none up to {rows[-1]['batch']}"
            lines += [
                "",
                f"Crossover (smallest batch where no γ pays): measured **{measured_x or beyond}**, "
                f"predicted by the cost model **{predicted_x or beyond}**; the prediction's error on the "
                f"speedup over every batch size and γ: largest {max(errors):.0%}, median "
                f"{median(errors, NAN):.0%}.",
                "",
                "<details><summary>every γ</summary>",
                "",
                "| batch | " + " | ".join(f"γ {g}" for g in args.gammas) + " |",
                "|---|" + "---|" * len(args.gammas),
            ]
            for r in rows:
                lines.append(
                    f"| {r['batch']} | "
                    + " | ".join(
                        f"{r['drafters'][drafter]['gammas'][g]['speedup']:.2f}× (pred "
                        f"{predicted(r, costs, drafter, g):.2f}×)"
                        for g in args.gammas
                    )
                    + " |"
                )
            lines += ["", "</details>", ""]
    if args.plot:
        lines += [
            f"![speedup against batch size]({link(args.out, args.plot)})",
            "",
            "Measured speedup over the batched target alone (points) and the cost model's prediction (lines), "
            "each drafter at its best γ, against the batch size; below 1 the target alone is faster.",
            "",
        ]
    return "\n".join(lines)


def plot(args, results, costs) -> None:
    try:
        plt = pyplot()
    except ImportError:
        print("note: matplotlib is not installed; no plot", file=sys.stderr)
        args.plot = None
        return
    fig, axes = plt.subplots(
        1, len(args.temperatures), figsize=(5.2 * len(args.temperatures), 4.0), squeeze=False
    )
    for ax, temperature in zip(axes[0], args.temperatures):
        rows = [r for r in results["rows"] if r["temperature"] == temperature]
        sizes = [r["batch"] for r in rows]
        for drafter, colour in zip(args.drafters, ("tab:blue", "tab:orange", "tab:green")):
            ax.plot(
                sizes,
                [
                    r["drafters"][drafter]["gammas"][r["drafters"][drafter]["best_gamma"]][
                        "speedup"
                    ]
                    for r in rows
                ],
                "o",
                color=colour,
                label=f"{drafter}, measured",
            )
            ax.plot(
                sizes,
                [max(predicted(r, costs, drafter, g) for g in args.gammas) for r in rows],
                "--",
                color=colour,
                label=f"{drafter}, cost model",
            )
        ax.axhline(1, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel("speedup over the batched target alone")
        ax.set_title(
            ("greedy" if temperature == 0 else f"T = {temperature:g}")
            + f", {args.threads} thread(s)"
        )
        ax.legend(fontsize=8)
    save_figure(fig, args.plot)


def build_parser() -> argparse.ArgumentParser:
    parser = script_parser("batch", __doc__)
    parser.add_argument("--target", default="tiny-target")
    parser.add_argument(
        "--drafters",
        nargs="+",
        default=["tiny-draft", "tiny-eagle"],
        help="draft models, feature heads or lookup (the first is also timed against the single loop)",
    )
    parser.add_argument(
        "--prompts-per-row",
        type=int,
        default=1,
        help="K x B prompts through a batch of B rows (continuous batching); default 1",
    )
    parser.add_argument(
        "--no-single", action="store_true", help="skip batch 1 against the single-prompt loop"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=40, help="timed calls per cost-model cell")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "benchmarks_batch.md"))
    parser.add_argument(
        "--plot", default=str(RESULTS / "benchmark_batch.png"), help="PNG ('' for none)"
    )
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.batch_sizes + args.gammas + [args.repeats, args.threads, args.prompts_per_row]) < 1:
        sys.exit("error: batch sizes, gammas, repeats, threads and prompts per row must be >= 1")
    torch.set_num_threads(args.threads)
    target = load_model(args.target)
    drafters = {name: load_drafter(name, target) for name in args.drafters}
    prepare_networks(target, drafters.values(), stack=True, prepack=True)
    tokenizer = load_tokenizer(args.target)
    prompts = [
        tokenizer.encode(text)
        for text in prompts_text(max(args.batch_sizes) * args.prompts_per_row)
    ]
    context = round(median([len(p) for p in prompts], NAN)) + args.max_new_tokens // 2
    single = (
        None if args.no_single else single_path(args, target, drafters[args.drafters[0]], prompts)
    )
    if single:
        print(f"batch 1 / single: {single['ratio']:.3f}", file=sys.stderr)
    results = measure(args, target, drafters, prompts)
    costs = cost_model(args, target, drafters, context)
    info, flags = describe_machine(args.threads)
    command = command_line("batch", argv)
    if args.plot:
        plot(args, results, costs)
    write_page(args.out, render(args, info, flags, results, costs, single, command))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"results": results, "costs": costs, "single": single}, indent=1)
        )
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
