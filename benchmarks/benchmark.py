"""Tokens per second of speculative decoding with each drafter against its baselines, in one run on one machine.

    python -m benchmarks.benchmark                     # the full run: docs/results/benchmarks.md + 2 PNGs
    python -m benchmarks.benchmark --prompts 1 --repeats 1 --max-new-tokens 16 --gammas 2 --threads 1 \\
        --drafters tiny-draft lookup --prompt-sets stories --no-hf --out /tmp/b.md --plot /tmp/b.png   # a smoke run

For the same target, the same prompts and the same number of new tokens (end-of-sequence
ignored), greedy and at temperature 1, with 1 and with all torch threads, it times:

* this project, target alone (``autoregressive_generate``): the baseline;
* this project, speculative (``speculative_generate``) with every drafter of ``--drafters``
  (a draft model, ``tiny-eagle``, a head that drafts from the target's features, and
  ``lookup``, prompt lookup; weights.drafters.load_drafter), at gamma = 1..8 and "auto";
* transformers' ``generate`` on the same HF-layout checkpoints, target alone, and with
  ``assistant_model`` (assisted generation, ``--hf-draft``) both with its defaults and with
  a constant gamma, the same algorithm as ours; on the story openings only.

Two prompt sets (benchmarks/benchmark_prompts.py): story openings, and an input-grounded
set (a held-out story, then "Retell the story:" and its first words) where copying from
the prompt pays, which is what prompt lookup is for.

Every call is timed end to end with the wall clock (cache allocation and the prompt's
forward included, the same for every method). Runs are interleaved (repeat > threads >
prompt set > prompt > temperature > method) so that a change in machine load hits all
methods alike; each table cell is a median over prompts x repeats. The measured speedup
is compared with the paper's prediction from the measured alpha and c.

Do not run it while anything else loads the machine: it measures the machine.
transformers is used here only as a reference, never by the runtime code.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.benchmark_prompts import (
    PROMPT_SETS,
    RETELL_CORPUS,
    STORY_OPENINGS,
    PromptSet,
    build_prompt_sets,
)
from benchmarks.benchmark_report import (
    Method,
    Report,
    Results,
    Runs,
    plot_cost_model,
    plot_drafters,
    render,
)
from benchmarks.harness import (
    RESULTS,
    Progress,
    command_line,
    describe_machine,
    link,
    prepare_networks,
    script_parser,
    time_call,
    write_page,
)
from speculative import autoregressive_generate, check_pair, speculative_generate
from speculative.inputs import GAMMA_MAX, check_finite
from weights import load_model, load_tokenizer, resolve
from weights.drafters import load_drafter

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
DRAFTERS = ["tiny-draft", "tiny-eagle", "lookup"]
# transformers' runs only on the story openings: they are a reference for this project's loop, which the
# second set would not tell more about, and they are the slowest calls of the run.
HF_PROMPT_SET = "stories"


@dataclass
class Models:
    target: Any
    drafters: dict[str, Any]  # --drafters name -> drafter
    hf_target: Any = None
    hf_draft: Any = None


# ----------------------------------------------------------------------------- runners
def run_ours(
    method: Method,
    models: Models,
    prompt: list[int],
    new_tokens: int,
    temperature: float,
    seed: int,
) -> tuple[float, list[int], Any]:
    if method.key == "target":
        timing = time_call(
            lambda: autoregressive_generate(
                models.target, prompt, new_tokens, temperature=temperature, seed=seed
            )
        )
    else:
        timing = time_call(
            lambda: speculative_generate(
                models.target,
                models.drafters[method.drafter],
                prompt,
                new_tokens,
                gamma=method.gamma,
                temperature=temperature,
                seed=seed,
            )
        )
    return timing.median, timing.result.tokens, timing.result.stats


def run_hf(
    method: Method,
    models: Models,
    prompt: list[int],
    new_tokens: int,
    temperature: float,
    seed: int,
) -> tuple[float, list[int], Any]:
    hf_target, hf_draft = models.hf_target, models.hf_draft
    kwargs: dict[str, Any] = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if method.key != "hf-target":
        config = hf_draft.generation_config
        if method.key == "hf-assisted-const":  # our algorithm: always gamma drafts, no early stop
            config.num_assistant_tokens, config.num_assistant_tokens_schedule = (
                method.gamma,
                "constant",
            )
            config.assistant_confidence_threshold = 0.0
        else:  # transformers' defaults
            config.num_assistant_tokens = config.num_assistant_tokens_schedule = None
            config.assistant_confidence_threshold = None
        kwargs["assistant_model"] = hf_draft
    input_ids = torch.tensor([prompt], device=hf_target.device)
    torch.manual_seed(seed)

    def generate() -> torch.Tensor:
        with torch.inference_mode():
            return hf_target.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), **kwargs
            )

    timing = time_call(generate, device=hf_target.device)
    return timing.median, timing.result[0, len(prompt) :].tolist(), None


def call(
    method: Method,
    models: Models,
    prompt: list[int],
    new_tokens: int,
    temperature: float,
    seed: int,
) -> tuple[float, list[int], Any]:
    runner = run_hf if method.key.startswith("hf") else run_ours
    return runner(method, models, prompt, new_tokens, temperature, seed)


def load_hf(directory: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import LlamaForCausalLM  # the test extra's oracle, heavy: only for --hf runs
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = LlamaForCausalLM.from_pretrained(str(directory), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # time exactly max_new_tokens, like ours
    model.generation_config.pad_token_id = 0
    return model


def load_drafters(
    names: list[str], target: Any, target_name: str
) -> tuple[dict[str, Any], list[str]]:
    """The drafters that load and fit the target, by label; a one-line note (printed, and kept for the report)
    for each that does not, so that a missing head (tiny-eagle before it ships) skips its rows instead of the
    run. ``LABEL=PATH`` names a drafter's rows (and its goals) apart from where it is loaded from."""
    drafters, notes = {}, []
    for name in names:
        label, source = name.split("=", 1) if "=" in name else (name, name)
        try:
            drafter = load_drafter(source, target, target_name)
            check_pair(target, drafter)
        except (
            ValueError,
            OSError,
        ) as err:  # CheckpointError, UnknownCheckpointError, PairMismatchError
            notes.append(f"drafter {label} skipped: {err}")
            print(f"note: {notes[-1]}", file=sys.stderr)
            continue
        drafters[label] = drafter
    return drafters, notes


def methods_for(prompt_set: str, drafters: list[str], args: argparse.Namespace) -> list[Method]:
    methods = [Method("target")]
    for name in drafters:
        methods += [Method("spec", g, name) for g in args.gammas]
        if not args.no_auto:
            methods.append(Method("spec", "auto", name))
    if not args.no_hf and prompt_set == HF_PROMPT_SET:
        methods += [
            Method("hf-target"),
            Method("hf-assisted"),
            Method("hf-assisted-const", args.hf_gamma),
        ]
    return methods


def check_finite_micros(
    rows: int, vocab: int, dtype: torch.dtype, device: str, calls: int = 2000
) -> float:
    """Median microseconds of one speculative.inputs.check_finite call on [rows, vocab] logits, timed one by
    one (the check ends with a host read, so each call has finished when it returns)."""
    # the models return float32 logits (float64 for a float64 model)
    logits = torch.randn(
        rows, vocab, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device
    )
    with torch.inference_mode():
        return time_call(lambda: check_finite(logits), calls).median * 1e6


def decoding_note(args: argparse.Namespace) -> str:
    fused = (
        f"q/k/v and gate/up stacked into one product each ({args.fused} groups, model/fast/fuse.py)"
        if args.fused
        else "projections not stacked (--no-fuse)"
    )
    if args.prepacked:
        return (
            f"this project's runs, as generate.py: {fused}, and weights reordered once for oneDNN "
            f"({args.prepacked} linear layers, model/fast/prepack.py), in the target and in every drafter's "
            f"network; "
            "transformers' runs use PyTorch's defaults"
        )
    return f"this project's runs: {fused}, no weights prepacked (--no-prepack, or not a float32 CPU run)"


# What this benchmark runs of generate.py's set-up, said on its page: the library's defaults are
# generate.py's verification rule, and its guard is the one thing left out (each fixed gamma is
# timed as asked, where generate.py's default guard may turn a losing one into plain steps).
VERIFICATION_AND_GUARD = (
    "Verification as generate.py's default: block-wise for sampled chains, argmaxes compared when "
    "greedy; no guard (as `generate.py --no-guard`: every fixed γ drafts every iteration)."
)


def setup_text(args: argparse.Namespace, drafters: list[str]) -> str:
    hf = (
        ""
        if args.no_hf
        else (
            f" transformers' assisted generation drafts with `{args.hf_draft}`, on the "
            f"{HF_PROMPT_SET} set only."
        )
    )
    return (
        f"Target `{args.target}`, {args.dtype} on {args.device}; drafters: "
        f"{', '.join(f'`{d}`' for d in drafters) or 'none'}; {decoding_note(args)}.{hf} "
        f"Fixed γ ∈ {{{', '.join(map(str, args.gammas))}}}{'' if args.no_auto else ' and γ = auto'}. "
        f"{VERIFICATION_AND_GUARD} "
        f"{args.prompts} prompts per set × {args.repeats} repeats, {args.max_new_tokens} new tokens each "
        "(end-of-sequence ignored). tokens/s is the median over prompts and repeats of new tokens / wall time of "
        "the whole call (cache allocation and the prompt's forward included, for every method alike); the "
        "speedup is the ratio of medians against the target alone in the same prompt set, decoding and thread "
        "count. α, τ and c are medians over runs. Prompt sets:"
    )


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = script_parser("benchmark", __doc__)
    parser.add_argument(
        "--target", default="tiny-target", help="target checkpoint (default tiny-target)"
    )
    parser.add_argument(
        "--drafters",
        nargs="+",
        default=DRAFTERS,
        help=f"drafters to compare, as generate.py --draft takes them: a draft checkpoint, a feature "
        f"head's folder or 'lookup', or LABEL=PATH to name its rows (tiny-eagle=runs/eagle/hf); "
        f"one that does not load is skipped with a note (default {' '.join(DRAFTERS)})",
    )
    parser.add_argument(
        "--prompt-sets",
        nargs="+",
        default=list(PROMPT_SETS),
        choices=PROMPT_SETS,
        help="stories: story openings; retell: a held-out story, then started again (default both)",
    )
    parser.add_argument(
        "--retell-corpus",
        type=Path,
        default=RETELL_CORPUS,
        help=f"held-out TinyStories text for the retell set, read in place (default {RETELL_CORPUS}; "
        "absent: the set is skipped with a note)",
    )
    parser.add_argument(
        "--hf-draft",
        default="tiny-draft",
        help="draft checkpoint of transformers' assisted generation (default tiny-draft)",
    )
    parser.add_argument("--device", default="cpu", help="device (default cpu)")
    parser.add_argument(
        "--dtype", default="float32", choices=sorted(DTYPES), help="dtype (default float32)"
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=5,
        help=f"prompts per set, 1..{len(STORY_OPENINGS)} (default 5)",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed repeats of every prompt (default 2)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="new tokens per call (default 128)"
    )
    parser.add_argument(
        "--gammas",
        type=int,
        nargs="+",
        default=list(range(1, 9)),
        help="fixed gammas (default 1..8)",
    )
    parser.add_argument("--no-auto", action="store_true", help="skip gamma=auto")
    parser.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0, 1.0],
        help="temperatures (default 0 1)",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    parser.add_argument(
        "--no-prepack",
        action="store_true",
        help="do not reorder this project's float32 CPU weights for oneDNN (model/fast/prepack.py), as "
        "generate.py --no-prepack",
    )
    parser.add_argument(
        "--no-fuse",
        action="store_true",
        help="do not stack q/k/v and gate/up into one product each (model/fast/fuse.py), as "
        "generate.py --no-fuse",
    )
    parser.add_argument(
        "--hf-gamma",
        type=int,
        default=4,
        help="gamma of the constant-gamma assisted-generation row (default 4)",
    )
    default_threads = sorted({1, os.cpu_count() or 1})
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=default_threads,
        help="torch CPU thread counts, each a full set of runs, interleaved with the others (default "
        f"{' '.join(map(str, default_threads))}: one, and all cores)",
    )
    parser.add_argument("--seed", type=int, default=0, help="base seed for sampling (default 0)")
    parser.add_argument("--out", default=str(RESULTS / "benchmarks.md"), help="markdown report")
    parser.add_argument(
        "--plot",
        default=str(RESULTS / "benchmark_speedup.png"),
        help="PNG: measured speedup against gamma and the cost model, per drafter ('' for none)",
    )
    parser.add_argument(
        "--drafter-plot",
        default=None,
        help="PNG: the drafters side by side (default: --plot's name with _drafters; '' for none)",
    )
    return parser


def validate(args: argparse.Namespace) -> None:
    if not 1 <= args.prompts <= len(STORY_OPENINGS) or args.repeats < 1 or args.max_new_tokens < 1:
        sys.exit(
            f"error: --prompts must be in 1..{len(STORY_OPENINGS)}, --repeats and --max-new-tokens >= 1"
        )
    if (
        any(n < 1 for n in args.threads)
        or any(g < 1 for g in args.gammas)
        or any(t < 0 for t in args.temperatures)
    ):
        sys.exit("error: --threads and --gammas must be >= 1 and --temperatures >= 0")
    # a count named twice would only be measured twice
    args.threads = list(dict.fromkeys(args.threads))
    args.drafters = list(dict.fromkeys(args.drafters))
    if args.drafter_plot is None:
        args.drafter_plot = (
            str(Path(args.plot).with_name(Path(args.plot).stem + "_drafters.png"))
            if args.plot
            else ""
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    validate(args)
    dtype = DTYPES[args.dtype]
    target = load_model(args.target, device=args.device, dtype=dtype)
    drafters, notes = load_drafters(args.drafters, target, args.target)
    args.fused, args.prepacked = prepare_networks(
        target, drafters.values(), stack=not args.no_fuse, prepack=not args.no_prepack
    )
    tokenizer = load_tokenizer(args.target)
    limit = min(
        [target.config.max_seq_len] + [d.max_seq_len for d in drafters.values() if d.max_seq_len]
    )
    # Room for the prompt and the output with every gamma at full length up to the last token (the loop
    # shrinks gamma near the context's end, which would change what is measured).
    room = limit - min(max(args.gammas), GAMMA_MAX) - 1
    sets = build_prompt_sets(
        args.prompt_sets, tokenizer, args.prompts, args.max_new_tokens, room, args.retell_corpus
    )
    for s in sets:
        if s.note:
            notes.append(s.note)
            print(f"note: {s.note}", file=sys.stderr)
    sets = [s for s in sets if s.prompts]
    if not sets:
        sys.exit("error: no prompt set has a prompt to run")
    if max(len(p) for s in sets for p in s.prompts) + args.max_new_tokens > room:
        sys.exit(
            f"error: --max-new-tokens {args.max_new_tokens} does not fit in the {limit}-token context"
        )

    models = Models(target, drafters)
    methods = {s.name: methods_for(s.name, list(drafters), args) for s in sets}
    if any(m.key.startswith("hf") for ms in methods.values() for m in ms):
        models.hf_target = load_hf(resolve(args.target), dtype, args.device)
        models.hf_draft = load_hf(resolve(args.hf_draft), dtype, args.device)

    results, finite = measure(args, models, sets, methods)

    info, flags = describe_machine(args.threads)
    command = command_line("benchmark", argv)
    rep = Report(
        command,
        setup_text(args, list(drafters)),
        info,
        flags,
        args.threads,
        args.temperatures,
        sets,
        list(drafters),
        notes,
        finite,
        max(args.gammas) + 1,
        args.hf_gamma,
        plots=[],
        page=args.out,
    )
    out = Path(args.out)
    title = f"{args.target}, {args.device} {args.dtype}"
    if args.plot and drafters:
        first = sets[0]
        plot_cost_model(
            Path(args.plot),
            f"{title}, {first.name} prompts",
            rep,
            methods[first.name],
            results,
            first.name,
        )
        rep.plots.append(
            (
                link(out, args.plot),
                f"Measured speedup against the cost model, {first.name} prompts. Points: measured speedup "
                "over the target alone (median tokens/s ratio). Dashed lines: the paper's prediction from "
                "the α and c measured over all fixed-γ runs of the drafter at that decoding; crosses: the "
                "prediction from the measured call times; stars: γ = auto at its mean γ.",
            )
        )
    if args.drafter_plot and drafters:
        plot_drafters(Path(args.drafter_plot), title, rep, methods, results)
        rep.plots.append(
            (
                link(out, args.drafter_plot),
                "Drafters side by side. Bars: speedup over the target alone at each drafter's best fixed γ "
                "(solid) and at γ = auto (hatched), per prompt set and decoding.",
            )
        )
    text, goal_lines = render(rep, methods, results)
    write_page(out, text)
    print("\n".join(goal_lines))
    print(
        f"wrote {out}"
        + "".join(f" and {p}" for p in (args.plot, args.drafter_plot) if p and drafters)
    )
    return 0


def measure(
    args: argparse.Namespace,
    models: Models,
    sets: list[PromptSet],
    methods: dict[str, list[Method]],
) -> tuple[Results, dict[int, float]]:
    """Every timed run, interleaved (see the module docstring), and check_finite's cost at each thread count."""
    results: Results = {
        (n, s.name, t): {m.label: Runs() for m in methods[s.name]}
        for n in args.threads
        for s in sets
        for t in args.temperatures
    }
    finite: dict[int, float] = {}
    per_repeat = sum(len(s.prompts) * len(methods[s.name]) for s in sets) * len(args.temperatures)
    progress = Progress(args.repeats * len(args.threads) * per_repeat)
    for r in range(args.repeats):
        for threads in args.threads:
            torch.set_num_threads(threads)
            # Untimed first calls: at the first repeat every method (first-call allocations, lazy
            # initialisation); later one short call, so that the thread pool is up after the switch.
            warm = (
                [(s, m) for s in sets for m in methods[s.name]]
                if r == 0
                else [(sets[0], Method("target"))]
            )
            for s, m in warm:
                for t in args.temperatures:
                    call(m, models, s.prompts[0], min(8, args.max_new_tokens), t, args.seed)
            if r == 0:
                finite[threads] = check_finite_micros(
                    max(args.gammas) + 1,
                    models.target.config.vocab_size,
                    DTYPES[args.dtype],
                    args.device,
                )
            for s in sets:
                for i, prompt in enumerate(s.prompts):
                    for t in args.temperatures:
                        for m in methods[s.name]:
                            seconds, tokens, stats = call(
                                m, models, prompt, args.max_new_tokens, t, args.seed + 1000 * i + r
                            )
                            results[(threads, s.name, t)][m.label].add(
                                seconds, tokens, stats, i, r == 0
                            )
                            progress.step(
                                f"{threads} threads, {s.name} {i}, T={t:g}, repeat {r}, {m.label}: "
                                f"{len(tokens) / seconds:.1f} tokens/s"
                            )
    progress.end()
    return results, finite


if __name__ == "__main__":
    sys.exit(main())
