"""What ``python -m benchmarks.benchmark`` measured, and its report: markdown tables, goals and plots.

Results are kept per *cell*, (torch threads, prompt set, temperature), and within a cell
per method label. Every number in a table is a median over the cell's prompts x repeats;
a speedup is the ratio of the medians of tokens/s against the target alone in the same
cell.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, link, machine_lines, median, page_head, pyplot, save_figure
from speculative import AutoregressiveStats, expected_speedup

Cell = tuple[int, str, float]  # (torch threads, prompt set, temperature)


@dataclass(frozen=True)
class Method:
    """One row of a table: this project's target alone, one drafter at one gamma, or a transformers run."""

    key: str  # "target", "spec", "hf-target", "hf-assisted", "hf-assisted-const"
    gamma: int | str | None = None
    drafter: str | None = None  # the --drafters name, for "spec"

    @property
    def label(self) -> str:
        if self.key == "spec":
            return f"{self.drafter} " + ("auto" if self.gamma == "auto" else f"γ={self.gamma}")
        return {
            "target": "target",
            "hf-target": "hf target",
            "hf-assisted": "hf assisted (defaults)",
            "hf-assisted-const": f"hf assisted (γ={self.gamma}, constant)",
        }[self.key]

    @property
    def fixed(self) -> bool:
        return self.key == "spec" and self.gamma != "auto"


@dataclass
class Runs:
    """Every timed run of one method in one cell."""

    tps: list[float] = field(default_factory=list)
    alpha: list[float] = field(default_factory=list)
    c: list[float] = field(default_factory=list)
    tau: list[float] = field(default_factory=list)  # tokens per target call
    # mean gamma drafted (differs from the setting under auto)
    gamma: list[float] = field(default_factory=list)
    # the paper's eq. 1 and Theorem 3.8 over the gamma each iteration actually drafted (SpeculativeStats)
    predicted_tau: list[float] = field(default_factory=list)
    predicted_speedup: list[float] = field(default_factory=list)
    # where the time goes, in seconds: one autoregressive step (target alone); drafting per drafted token,
    # one verification call, the loop's own work (verification arithmetic, sampling, bookkeeping) and the
    # whole iteration (the sum of the three), per target call
    ar_step: list[float] = field(default_factory=list)
    draft_per_token: list[float] = field(default_factory=list)
    verify_call: list[float] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)
    iteration: list[float] = field(default_factory=list)
    # prompt index -> tokens of the first repeat
    tokens: dict[int, list[int]] = field(default_factory=dict)

    def add(
        self, seconds: float, tokens: list[int], stats: Any, prompt: int, first_repeat: bool
    ) -> None:
        """One call: its wall time and tokens, and what the library measured inside it (None for transformers)."""
        self.tps.append(len(tokens) / seconds)
        if first_repeat:
            self.tokens[prompt] = tokens
        if stats is None:
            return
        if isinstance(stats, AutoregressiveStats):  # the target alone
            self.ar_step.append(stats.target_time_s / stats.target_calls)
            return
        for name, values in (
            ("acceptance_rate", self.alpha),
            ("cost_ratio", self.c),
            ("tokens_per_target_call", self.tau),
            ("gamma", self.gamma),
            ("predicted_tokens_per_target_call", self.predicted_tau),
            ("predicted_speedup", self.predicted_speedup),
        ):
            value = getattr(stats, name)
            if value is not None:
                values.append(float(value))
        calls = stats.target_calls
        if stats.drafted_tokens:
            self.draft_per_token.append(stats.draft_time_s / stats.drafted_tokens)
        self.verify_call.append(stats.target_time_s / calls)
        self.overhead.append(
            (stats.decode_time_s - stats.draft_time_s - stats.target_time_s) / calls
        )
        self.iteration.append(stats.decode_time_s / calls)


Results = dict[Cell, dict[str, Runs]]


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else format(value, spec) + suffix


def temperature_name(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"T={temperature:g}"


def threads_name(threads: int) -> str:
    return f"{threads} thread" + ("s" if threads > 1 else "")


# ----------------------------------------------------------------------------- one row's numbers
@dataclass
class Row:
    """The medians of one method in one cell, and what they predict."""

    method: Method
    tps: float
    speedup: float | None
    alpha: float | None
    tau: float | None
    c: float | None
    gamma: float | None
    predicted_tau: float | None
    predicted: float | None

    @property
    def gamma_text(self) -> str:
        if self.method.gamma == "auto":
            return f"auto (mean {fmt(self.gamma, '.1f')})"
        return "–" if self.method.gamma is None else str(self.method.gamma)

    @property
    def ratio(self) -> float | None:
        return self.speedup / self.predicted if self.speedup and self.predicted else None


def row(cell: dict[str, Runs], method: Method) -> Row | None:
    runs = cell.get(method.label)
    if runs is None or not runs.tps:
        return None
    base = median(cell["target"].tps)
    tps = median(runs.tps)
    return Row(
        method,
        tps,
        tps / base if base else None,
        median(runs.alpha),
        median(runs.tau),
        median(runs.c),
        median(runs.gamma),
        median(runs.predicted_tau),
        median(runs.predicted_speedup),
    )


def best_fixed(cell: dict[str, Runs], methods: list[Method], drafter: str) -> Row | None:
    """The drafter's fixed gamma with the highest median tokens/s in this cell."""
    rows = [
        r
        for m in methods
        if m.fixed and m.drafter == drafter
        for r in [row(cell, m)]
        if r is not None
    ]
    return max(rows, key=lambda r: r.tps, default=None)


def refined_speedup(cell: dict[str, Runs], runs: Runs) -> float | None:
    """Predicted tokens per target call x (AR step) / (the measured time of one iteration): the
    paper's prediction with measured call times instead of its assumptions that verification
    costs one step and the loop's own work costs nothing."""
    values = median(runs.predicted_tau), median(cell["target"].ar_step), median(runs.iteration)
    if any(v is None for v in values):
        return None
    predicted_tau, ar, iteration = values
    return predicted_tau * ar / iteration


# ----------------------------------------------------------------------------- tables
def method_label(method: Method) -> str:
    """A summary row's name: the target alone, or a drafter at its best fixed gamma or at auto."""
    if method.key == "target":
        return "target alone"
    if method.fixed:
        return f"{method.drafter}, best γ"
    return f"{method.drafter}, γ = auto"


def summary_table(
    results: Results,
    threads: int,
    sets: list[Any],
    methods: dict[str, list[Method]],
    drafters: list[str],
    temperatures: list[float],
) -> list[str]:
    """Target alone, and every drafter at its best fixed gamma and at auto, in every prompt set and temperature."""
    lines = [
        "| prompt set | decoding | method | γ | tokens/s | speedup vs target alone | α | τ (tokens/target call) "
        "| c |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for prompt_set in sets:
        for temperature in temperatures:
            cell = results.get((threads, prompt_set.name, temperature))
            if not cell:
                continue
            rows = [row(cell, Method("target"))]
            for name in drafters:
                rows += [
                    best_fixed(cell, methods[prompt_set.name], name),
                    row(cell, Method("spec", "auto", name)),
                ]
            for r in rows:
                if r is None:
                    continue
                label = method_label(r.method)
                lines.append(
                    f"| {prompt_set.name} | {temperature_name(temperature)} | {label} | {r.gamma_text} | "
                    f"{r.tps:.1f} | {fmt(r.speedup, '.2f', '×')} | {fmt(r.alpha, '.3f')} | {fmt(r.tau)} | "
                    f"{fmt(r.c, '.3f')} |"
                )
    return lines


def detail_table(cell: dict[str, Runs], methods: list[Method]) -> list[str]:
    """Every method of one cell, with the paper's prediction from the row's own alpha, c and gammas."""
    lines = [
        "| method | γ | tokens/s | speedup vs target alone | α | c | τ (tokens/target call) | predicted τ | "
        "predicted speedup | measured / predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in methods:
        r = row(cell, m)
        if r is not None:
            lines.append(
                f"| {m.label} | {r.gamma_text} | {r.tps:.1f} | {fmt(r.speedup, '.2f', '×')} | "
                f"{fmt(r.alpha, '.3f')} | {fmt(r.c, '.3f')} | {fmt(r.tau)} | {fmt(r.predicted_tau)} | "
                f"{fmt(r.predicted, '.2f', '×')} | {fmt(r.ratio)} |"
            )
    return lines


def decomposition(cell: dict[str, Runs], methods: list[Method]) -> list[str]:
    """Where an iteration's time goes, and the prediction from the measured times."""
    ar = median(cell["target"].ar_step)
    rows = []
    for m in methods:
        runs = cell.get(m.label)
        if m.key != "spec" or runs is None or not runs.iteration or ar is None:
            continue
        draft, verify = median(runs.draft_per_token), median(runs.verify_call)
        draft_ms, draft_ratio = (None, None) if draft is None else (draft * 1e3, draft / ar)
        refined = refined_speedup(cell, runs)
        rows.append(
            f"| {m.label} | {ar * 1e3:.2f} | {fmt(draft_ms, '.3f')} | {fmt(draft_ratio, '.3f')} | "
            f"{verify * 1e3:.2f} | {verify / ar:.2f} | "
            f"{median(runs.overhead) * 1e3:.2f} | {fmt(refined, '.2f', '×')} |"
        )
    if not rows:
        return []
    return [
        "",
        "Where the time goes (medians, milliseconds). The paper assumes that a verification call on γ + 1 "
        "tokens costs one autoregressive step (verify / AR step = 1) and ignores the loop's own work; the last "
        "column predicts with the measured times instead: predicted τ × AR step / (measured time of one "
        "iteration = drafting + verify call + overhead).",
        "",
        "| method | AR step | drafting per drafted token | drafting / AR step | verify call | verify / AR step | "
        "overhead per iteration | prediction from measured times |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ] + rows


# ----------------------------------------------------------------------------- goals
@dataclass(frozen=True)
class Goal:
    """A speedup the repository aims at (issue 13 and the shipped pair's card), for one drafter."""

    drafter: str
    prompt_set: str
    temperature: float
    gamma: str  # "best" (its best fixed gamma) or "auto"
    speedup: float
    stretch: float | None = None
    alpha: float | None = None  # the least alpha asked for, if any

    def check(self, cell: dict[str, Runs], methods: list[Method]) -> str | None:
        r = (
            best_fixed(cell, methods, self.drafter)
            if self.gamma == "best"
            else row(cell, Method("spec", "auto", self.drafter))
        )
        if r is None or r.speedup is None:
            return None
        met = r.speedup >= self.speedup and (self.alpha is None or (r.alpha or 0) >= self.alpha)
        asked = f"≥ {self.speedup:g}×" + (
            f" with α ≥ {self.alpha:g}" if self.alpha is not None else ""
        )
        stretch = ""
        if self.stretch:
            stretch_met = "met" if r.speedup >= self.stretch else "not met"
            stretch = f"; stretch {self.stretch:g}×: {stretch_met}"
        return (
            f"{self.drafter} on {self.prompt_set}, {temperature_name(self.temperature)}, γ = {r.gamma_text}: "
            f"{r.speedup:.2f}× the target alone, α {fmt(r.alpha, '.3f')} (goal {asked}: "
            f"{'met' if met else 'NOT met'}{stretch})."
        )


GOALS = [
    Goal("tiny-draft", "stories", 0.0, "best", 2.0),
    Goal("tiny-eagle", "stories", 0.0, "best", 2.5, stretch=3.0, alpha=0.85),
    Goal("tiny-eagle", "stories", 1.0, "best", 2.0),
    Goal("lookup", "retell", 0.0, "best", 2.0),
    # "never more than 10% slower than the target alone" where there is little to copy: auto backs off
    Goal("lookup", "stories", 0.0, "auto", 0.9),
    Goal("lookup", "stories", 1.0, "auto", 0.9),
]


def prediction_agreement(cell: dict[str, Runs], methods: list[Method], drafter: str) -> str | None:
    """How many of a drafter's fixed gammas came within 10% of the two predictions."""
    off, off_refined = [], []
    for m in methods:
        r = row(cell, m) if m.fixed and m.drafter == drafter else None
        if r is None or r.ratio is None:
            continue
        off.append((abs(r.ratio - 1), m.label, r.ratio))
        refined = refined_speedup(cell, cell[m.label])
        if refined is not None and r.speedup is not None:
            off_refined.append(abs(r.speedup / refined - 1))
    if not off:
        return None
    worst = max(off)
    text = (
        f"within 10% of the paper's prediction for {sum(d <= 0.10 for d, _, _ in off)} of {len(off)} fixed γ "
        f"(worst: {worst[1]}, measured/predicted {worst[2]:.2f})"
    )
    if off_refined:
        text += (
            f"; of the prediction from measured call times for {sum(d <= 0.10 for d in off_refined)} of "
            f"{len(off_refined)} (worst deviation {100 * max(off_refined):.0f}%)"
        )
    return text


def goals(
    results: Results,
    threads: int,
    methods: dict[str, list[Method]],
    drafters: list[str],
    temperatures: list[float],
    hf_gamma: int,
) -> list[str]:
    out = []
    for goal in GOALS:
        cell = results.get((threads, goal.prompt_set, goal.temperature))
        line = (
            goal.check(cell, methods[goal.prompt_set])
            if cell and goal.drafter in drafters
            else None
        )
        if line:
            out.append(line)
    for temperature in temperatures:
        cell = results.get((threads, "stories", temperature))
        if not cell:
            continue
        best = max(
            (r for name in drafters for r in [best_fixed(cell, methods["stories"], name)] if r),
            key=lambda r: r.tps,
            default=None,
        )
        for hf_label in ("hf assisted (defaults)", f"hf assisted (γ={hf_gamma}, constant)"):
            hf = cell.get(hf_label)
            if best is None or not hf or not hf.tps:
                continue
            ratio = best.tps / median(hf.tps)
            goal = ""
            if "defaults" in hf_label:  # the goal is against transformers' own defaults
                goal = f" (goal ≥ 3×: {'met' if ratio >= 3 else 'NOT met'})"
            out.append(
                f"stories, {temperature_name(temperature)}: the best speculative run ({best.method.label}) "
                f"is {ratio:.2f}× the tokens/s of transformers' {hf_label}{goal}."
            )
    return out


def greedy_agreement(results: Results, threads: int, sets: list[Any]) -> list[str]:
    """Greedy speculative output must equal greedy target output (up to float32 near-ties)."""
    out = []
    for prompt_set in sets:
        cell = results.get((threads, prompt_set.name, 0.0))
        if not cell:
            continue
        ref = cell["target"].tokens
        differ = [
            f"{label} {sum(r.tokens.get(i) == ref.get(i) for i in ref)}/{len(ref)}"
            for label, r in cell.items()
            if label != "target" and any(r.tokens.get(i) != ref[i] for i in ref)
        ]
        others = len(cell) - 1
        out.append(
            f"{threads_name(threads)}, {prompt_set.name}: "
            + (
                f"all {others} methods gave the target's tokens on all {len(ref)} prompts."
                if not differ
                else f"{others - len(differ)} of {others} methods gave the target's tokens on all {len(ref)} prompts; "
                f"the others, prompts identical: {'; '.join(differ)} (float32 near-ties may legitimately differ)."
            )
        )
    return out


# ----------------------------------------------------------------------------- the report
@dataclass
class Report:
    """Everything the report says besides the measurements."""

    command: str
    setup: str  # the setup paragraph
    machine: dict[str, str]
    cpu_flags: str
    threads: list[int]
    temperatures: list[float]
    sets: list[Any]  # benchmark_prompts.PromptSet
    drafters: list[str]  # those that loaded
    notes: list[str]  # drafters skipped, prompt sets cut short
    finite_check: dict[int, float]  # threads -> median microseconds of check_finite per call
    finite_rows: int
    hf_gamma: int
    plots: list[tuple[str, str]]  # (relative path, caption)
    page: str = str(RESULTS / "benchmarks.md")  # where the report is written, for its links


def other_pages(page: str | Path) -> str:
    """The paragraph that points to the other questions' scripts, and to the index of their pages
    (linked from ``page`` wherever it is written): a results page reports one run on one machine, so
    it links no page of another run."""
    index = f"[docs/results/README.md]({link(page, RESULTS / 'README.md')})"
    return (
        "Other questions have scripts of their own: chains verified token by token and as a block, "
        "and token trees (`python -m benchmarks.trees`); batched speculation against the batched "
        "target alone, with the crossover (`python -m benchmarks.batch`); eager against compiled "
        "steps (`python -m benchmarks.compiled`); start-up (`python -m benchmarks.startup`); "
        f"llama.cpp (`python -m benchmarks.llama_cpp`). Their pages are indexed by question in {index}."
    )


def render(
    rep: Report, methods: dict[str, list[Method]], results: Results
) -> tuple[str, list[str]]:
    """The markdown report, and the goal lines (also printed)."""
    lines = page_head("Benchmarks", rep.command) + [
        other_pages(rep.page),
        "",
        "## Setup",
        "",
        rep.setup,
        "",
    ]
    lines += [f"* {s.name}: {s.description}, {len(s.prompts)} prompts." for s in rep.sets]
    lines += [f"* Note: {n}." for n in rep.notes]
    lines += [""] + machine_lines(rep.machine, rep.cpu_flags)
    lines += [
        "",
        "## Drafters side by side",
        "",
        "Each drafter at its best fixed γ (the γ with the highest median tokens/s in that prompt set, "
        "decoding and thread count) and at γ = auto. α: the paper's acceptance rate (mean of Σ min(p, q) over "
        "verified positions); τ: new tokens per target call; c: drafting time per drafted token / time of one "
        "target call.",
    ]
    for threads in rep.threads:
        lines += ["", f"### {threads_name(threads)}", ""]
        lines += summary_table(results, threads, rep.sets, methods, rep.drafters, rep.temperatures)
    lines += finite_check_lines(rep, results)
    notes: list[str] = []
    for threads in rep.threads:
        for goal in goals(results, threads, methods, rep.drafters, rep.temperatures, rep.hf_gamma):
            notes.append(f"{threads_name(threads)}: {goal}")
    if notes:
        lines += ["", "## Goals", ""] + [f"* {n}" for n in notes]
    sanity = [
        line for threads in rep.threads for line in greedy_agreement(results, threads, rep.sets)
    ]
    if sanity:
        lines += ["", "## Sanity", "", "Greedy outputs against this project's target alone:", ""]
        lines += [f"* {line}" for line in sanity]
    for path, caption in rep.plots:
        lines += ["", f"![{caption.split('.')[0]}]({path})", "", caption]
    lines += [
        "",
        "## Every configuration",
        "",
        "The paper's prediction per run is Σ (1 − α^(γᵢ+1)) / (1 − α) over Σ (γᵢ c + 1), with the run's own α "
        "and c and the γᵢ each iteration actually drafted (fewer than γ near the end of a run, or where a "
        "lookup finds no match).",
    ]
    for threads in rep.threads:
        for prompt_set in rep.sets:
            for temperature in rep.temperatures:
                cell = results.get((threads, prompt_set.name, temperature))
                if not cell:
                    continue
                lines += [
                    "",
                    f"### {threads_name(threads)}, {prompt_set.name}, {temperature_name(temperature)}",
                    "",
                ]
                lines += detail_table(cell, methods[prompt_set.name])
                agreement = [
                    f"* {name}: measured speedup {text}."
                    for name in rep.drafters
                    for text in [prediction_agreement(cell, methods[prompt_set.name], name)]
                    if text
                ]
                if agreement:
                    lines += ["", "Against the predictions:", ""] + agreement
                lines += decomposition(cell, methods[prompt_set.name])
                hf = cell.get("hf target")
                base = median(cell["target"].tps)
                if hf and hf.tps and base:
                    lines += [
                        "",
                        f"This project's target alone runs at {base / median(hf.tps):.2f}× the tokens/s "
                        "of transformers' `generate` on the same checkpoint.",
                    ]
    return "\n".join(lines) + "\n", notes


def finite_check_lines(rep: Report, results: Results) -> list[str]:
    """The cost of the run-time non-finite-logits check (speculative.inputs.check_finite, issue 12)."""
    if not rep.finite_check:
        return []
    lines = [
        "",
        "## Cost of the non-finite-logits check",
        "",
        f"`speculative.inputs.check_finite` runs once per target call, on the logits the loop is about to use. "
        f"Timed alone on a [{rep.finite_rows}, vocab] float32 tensor (the largest fixed γ + 1 rows), median "
        "per call, against the median autoregressive step of the target in the same run:",
        "",
        "| threads | check_finite per call | target step | fraction of a target step |",
        "|---:|---:|---:|---:|",
    ]
    for threads, micros in rep.finite_check.items():
        step = median(
            [
                s
                for (t, _, _), cell in results.items()
                if t == threads
                for s in cell["target"].ar_step
            ]
        )
        step_ms, fraction = (None, None) if step is None else (step * 1e3, micros * 1e-6 / step)
        lines.append(
            f"| {threads} | {micros:.1f} µs | {fmt(step_ms, '.2f', ' ms')} | {fmt(fraction, '.2%')} |"
        )
    return lines


# ----------------------------------------------------------------------------- plots
COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def plot_cost_model(
    path: Path, title: str, rep: Report, methods: list[Method], results: Results, prompt_set: str
) -> None:
    """Measured speedup against gamma, with the paper's prediction: one panel per thread count and drafter."""
    plt = pyplot()
    rows, cols = len(rep.threads), len(rep.drafters)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.8 * cols, 3.8 * rows), squeeze=False, sharey=True
    )
    for (threads, drafter), ax in zip(
        [(t, d) for t in rep.threads for d in rep.drafters], axes.flat
    ):
        for temperature, color in zip(rep.temperatures, COLORS):
            cell = results.get((threads, prompt_set, temperature))
            fixed = [m for m in methods if m.fixed and m.drafter == drafter]
            if not cell or not fixed:
                continue
            base = median(cell["target"].tps)
            gammas = [m.gamma for m in fixed]
            name = temperature_name(temperature)
            ax.plot(
                gammas,
                [median(cell[m.label].tps) / base for m in fixed],
                "o",
                color=color,
                label=f"{name}: measured",
            )
            alpha = median([a for m in fixed for a in cell[m.label].alpha])
            c = median([x for m in fixed for x in cell[m.label].c])
            if alpha is not None and c is not None:
                dense = [g / 10 for g in range(10, 10 * max(gammas) + 1)]
                ax.plot(
                    dense,
                    [expected_speedup(alpha, g, c) for g in dense],
                    "--",
                    color=color,
                    label=f"{name}: paper (α={alpha:.2f}, c={c:.3f})",
                )
            refined = [refined_speedup(cell, cell[m.label]) for m in fixed]
            if all(v is not None for v in refined):
                ax.plot(
                    gammas, refined, "x:", color=color, label=f"{name}: from measured call times"
                )
            auto = cell.get(Method("spec", "auto", drafter).label)
            if auto and auto.tps and auto.gamma:
                ax.plot(
                    [median(auto.gamma)],
                    [median(auto.tps) / base],
                    "*",
                    ms=12,
                    color=color,
                    label=f"{name}: γ=auto (at its mean γ)",
                )
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{drafter}, {threads_name(threads)}", fontsize=10)
        ax.set_xlabel("γ (tokens drafted per target call)")
        ax.set_ylabel("speedup over the target alone")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def bar_label(drafter: str, k: int, g: int) -> str | None:
    """The legend's name of a drafter's bar ``k`` (0: best fixed gamma, 1: auto) in group ``g``:
    named in the first group only, so that the legend lists each once."""
    if g != 0:
        return None
    if k == 0:
        return f"{drafter}, best γ"
    return f"{drafter}, γ = auto"


def plot_drafters(
    path: Path, title: str, rep: Report, methods: dict[str, list[Method]], results: Results
) -> None:
    """Bars: each drafter's speedup at its best fixed gamma (solid) and at auto (hatched), per prompt set and
    decoding; one panel per thread count, one above the other."""
    plt = pyplot()
    groups = [(s.name, t) for s in rep.sets for t in rep.temperatures]
    fig, axes = plt.subplots(
        len(rep.threads),
        1,
        figsize=(1.6 + 0.5 * len(groups) * len(rep.drafters) * 2, 3.6 * len(rep.threads)),
        squeeze=False,
        sharey=True,
    )
    width = 0.8 / (2 * max(1, len(rep.drafters)))
    for threads, ax in zip(rep.threads, axes.flat):
        for d, (drafter, color) in enumerate(zip(rep.drafters, COLORS)):
            for g, (set_name, temperature) in enumerate(groups):
                cell = results.get((threads, set_name, temperature))
                if not cell:
                    continue
                pair = [
                    best_fixed(cell, methods[set_name], drafter),
                    row(cell, Method("spec", "auto", drafter)),
                ]
                for k, r in enumerate(pair):
                    if r is None or r.speedup is None:
                        continue
                    x = g - 0.4 + (2 * d + k + 0.5) * width
                    ax.bar(
                        x,
                        r.speedup,
                        width,
                        color=color,
                        hatch="//" if k else None,
                        edgecolor="white",
                        label=bar_label(drafter, k, g),
                    )
                    ax.text(
                        x,
                        r.speedup,
                        "auto" if k else f"γ={r.method.gamma}",
                        ha="center",
                        va="bottom",
                        fontsize=6,
                    )
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(groups)), [f"{s}\n{temperature_name(t)}" for s, t in groups])
        ax.set_ylabel("speedup over the target alone")
        ax.set_title(threads_name(threads), fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
