"""Generate text with speculative decoding: a small draft model proposes, the target verifies.

    python generate.py                                   # the shipped tiny pair, on the CPU
    python generate.py --draft 7b --target 70b --prompt "The capital of France is"
    python generate.py --no-draft                        # the target alone: the baseline
    python generate.py --compare                         # both, one after the other: the measured speedup
    echo "Once upon a time" | python generate.py --prompt - --json
    python generate.py --prompts-file prompts.txt        # one prompt per line, decoded together in a batch
    python generate.py -m 7b-chat --interactive          # a conversation: type a turn, /reset, /exit

(In a clone set up by the README's quick start: .venv/bin/python generate.py.)

The continuation streams to stdout, green where the target accepted drafted tokens and
yellow where it produced them itself (on a terminal); the header, warnings and the summary
go to stderr. The summary says why the run stopped (eos, max_new_tokens or max_seq_len);
acceptance_rate is the paper's alpha, empirical_acceptance the share of drafted tokens kept.

A flag that a run cannot use is not an error: it gets one ``warning: ...`` line on stderr
and the run goes on exactly as without it. A value that cannot be right (--gamma 0) is.

Exit status: 0 when the run is done; 1 when --plan finds that the pair does not fit; 2 for
bad input, with one ``error: ...`` line on stderr. docs/cli.md details every flag, the
batched runs of --prompts-file, --compare, --plan and every field of --json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from model.fast.prepack import packable
from model.fast.setup import SETUPS, Setups
from model.scale.memory import DEVICES, plan, plan_suggestion
from model.scale.tensor_parallel import broadcast_seed, init_distributed
from speculative import (
    autoregressive_generate,
    autoregressive_generate_batch,
    speculative_generate,
    speculative_generate_batch,
)
from speculative.cli import chat, costs, output, pricing, report
from speculative.cli import options as cmdline
from speculative.cli.options import (
    DTYPES,
    UsageError,
    add_dtype_flags,
    drafters_help,
    pick_device,
    pick_dtype,
    rules_help,
)
from speculative.draft.trees import TREE_MODES
from speculative.engine import DEFAULT_GAMMA
from speculative.engine.trees import AutoTree
from speculative.inputs import GAMMA_MAX
from speculative.serving.text import Output, continuation_text, encode_prompt
from speculative.verify import RULES
from speculative.verify.tree import branching_parents
from weights import NonFiniteWeightsError, Pair, StepCache
from weights.load import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    is_head,
    load_named_pair,
    named_draft,
    plan_configs,
    read_named_pair,
    registered,
    stored_dtype,
)
from weights.reading import settle_reading
from weights.step_cache import ENV, default_dir

DEFAULT_PROMPT = "Once upon a time"
DEFAULT_MAX_NEW_TOKENS = 128


def build_parser() -> cmdline.ArgumentParser:
    parser = cmdline.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument_group("models").add_argument
    add(
        "-m",
        "--target",
        default=DEFAULT_TARGET,
        help="7b, 70b, 7b-chat, ..., or a folder (default %(default)s)",
    )
    add(
        "--draft",
        default=None,
        help=f"{drafters_help()} (default: the target's shipped drafter, {DEFAULT_DRAFT} for "
        f"{DEFAULT_TARGET}: the fastest exact one measured, docs/drafters.md)",
    )
    add(
        "--no-draft", action="store_true", help="the target alone, one token per call: the baseline"
    )
    add(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda when available, else cpu)",
    )
    add_dtype_flags(add)
    add(
        "--quantize",
        choices=["int8", "int4", "file", "none"],
        default=None,
        help="int8 block weights; int4 in groups of 32 (a CPU, float32 or bfloat16): another target; file: a 4-bit "
        "GGUF's own codes through torch's int4 kernel; none: read as floats (default: a 4-bit GGUF on a CPU as "
        "measured faster here, once, of its codes and float32; any other checkpoint as stored)",
    )
    add(
        "--plan",
        action="store_true",
        help="print the memory per GPU and exit: 0 when it fits, 1 when not",
    )
    add(
        "--plan-device",
        default=None,
        help=f"--plan's GPU: {', '.join(DEVICES)} or auto (default: auto, or h200)",
    )
    add(
        "--tp",
        type=int,
        default=None,
        help="--plan's tensor-parallel size (default: WORLD_SIZE or 1)",
    )
    add(
        "--no-prepack", action="store_true", help="no float32 weights prepacked for oneDNN on a CPU"
    )
    add(
        "--setup",
        choices=("default", "measure", *SETUPS),
        default="default",
        help="a decode step's set-up",
    )
    add(
        "--compile",
        nargs="?",
        const="auto",
        choices=("auto", "force"),
        default=None,
        help="compiled decode steps",
    )
    add(
        "--compile-cache",
        nargs="?",
        const="list",
        choices=("list", "clear"),
        help="list or clear the compiled steps",
    )
    add(
        "--cache-dir",
        default=None,
        help=f"compiled steps' cache (default: ${ENV}, else {default_dir()})",
    )
    add("--no-fuse", action="store_true", help="no stacked q/k/v and gate/up products")
    add(
        "-t",
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice)",
    )
    add = parser.add_argument_group("prompt").add_argument
    add(
        "-p",
        "--prompt",
        default=DEFAULT_PROMPT,
        help="the text to continue, - for stdin (default %(default)r)",
    )
    add(
        "--chat",
        action="store_true",
        help="the prompt as a user's turn, in the target's own chat template",
    )
    add("--system", default=None, help="system prompt for --chat and --interactive (default: none)")
    add(
        "-i",
        "--interactive",
        action="store_true",
        help="a conversation in the target's chat template: type a turn, /reset, /exit",
    )
    add(
        "--prompts-file",
        default=None,
        metavar="FILE",
        help="one prompt per line (- for stdin), decoded as a batch",
    )
    add(
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help="rows per target call at most (default: all)",
    )
    add = parser.add_argument_group("decoding").add_argument
    add(
        "--gamma",
        type=cmdline.gamma_arg,
        default=DEFAULT_GAMMA,
        help="draft length, or auto (default %(default)s)",
    )
    add(
        "--guard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plain target steps wherever this "
        "run's timings say speculating loses (default: where costs measured once and recorded here say so)",
    )
    add(
        "--verify",
        choices=list(RULES),
        default=None,
        help=f"{rules_help()} (default: block sampling a chain)",
    )
    add(
        "--tree",
        type=cmdline.tree_arg,
        default=None,
        help="a token tree's branching per depth, e.g. 3,2,1,1",
    )
    add(
        "--tree-mode",
        choices=list(TREE_MODES),
        default="without_replacement",
        help="how a tree node's children are drawn when sampling",
    )
    add("--temperature", type=float, default=0.0, help="0 is greedy (default %(default)g)")
    add(
        "--top-k",
        type=int,
        default=None,
        help="sample among the k most likely tokens (default: all)",
    )
    add("--top-p", type=float, default=None, help="nucleus sampling, 0 < p <= 1 (default: all)")
    add(
        "-n",
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="stop after this many (default %(default)s)",
    )
    add(
        "--stop",
        action="append",
        metavar="STRING",
        help="end the text before this string once it is generated (repeatable; as llama.cpp's "
        "--reverse-prompt and OpenAI's stop)",
    )
    add(
        "-c",
        "--ctx-size",
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="the most tokens a sequence may hold, prompt and output (as llama.cpp's -c; default: the "
        "models' context)",
    )
    add(
        "--ignore-eos",
        action="store_true",
        help="decode all --max-new-tokens: no end-of-sequence id stops the run "
        "(for timing, as llama.cpp's --ignore-eos; the text goes on past the end of the answer)",
    )
    add("--seed", type=int, default=None, help="seed for sampling (default: a fresh one, shown)")
    add(
        "--compare",
        action="store_true",
        help="run again with the target alone: the measured speedup",
    )
    add = parser.add_argument_group("output").add_argument
    add("--json", action="store_true", help="one JSON object on stdout and nothing else")
    add("--no-color", action="store_true", help="no ANSI colours (used only on a terminal)")
    add(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress lines (load:, measure:; they are shown only on a terminal anyway)",
    )
    return parser


def given_flags(argv: list[str] | None) -> set[str]:
    """The options the command line set (dest names), even to their default value.

    Parsed a second time with every default that is not None replaced by a marker, because a
    parsed namespace alone cannot tell ``--gamma 4`` from no --gamma at all. A flag whose default
    is None is given when it is not None (no value of one is None), and keeps its None: --stop
    appends to it, which a marker would not take."""
    unset = object()
    probe = build_parser()
    defaults = vars(probe.parse_args([]))
    probe.set_defaults(**{dest: unset for dest, value in defaults.items() if value is not None})
    parsed = vars(probe.parse_args(argv))
    return {dest for dest, value in parsed.items() if value is not unset and value is not None}


def validate(args: argparse.Namespace, given: set[str]) -> None:
    """Reject impossible settings before anything is loaded."""
    if isinstance(args.gamma, int) and args.gamma < 1:
        raise UsageError(f"--gamma must be an integer >= 1 or 'auto', got {args.gamma}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError(
            f"--temperature must be a number >= 0 (0 is greedy), got {args.temperature}"
        )
    if args.top_p is not None and not (0 < args.top_p <= 1):
        raise UsageError(f"--top-p must lie in (0, 1], got {args.top_p}")
    args.stop = args.stop or []  # None when not given: given_flags tells it from an empty list
    if "" in args.stop:
        raise UsageError("--stop needs a string that is not empty")
    for name in ("top_k", "max_new_tokens", "threads", "tp", "ctx_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.tree is not None and args.verify == "block" and not args.no_draft:
        raise UsageError(
            "--verify block is block verification of a chain; a --tree is verified by its own walk"
        )
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be an integer >= 1, got {args.batch_size}")
    if args.compile and args.setup != "default":
        raise UsageError(
            f"--compile and --setup {args.setup} both choose the set-up: give one (--compile force is "
            "--setup compiled)"
        )
    if args.compile:  # --compile is the measurement with the compiled set-up among the candidates
        args.setup = "compiled" if args.compile == "force" else "measure-all"
    if args.setup != "default" and args.quantize == "int8":
        raise UsageError(
            f"{setup_flag(args)} does not apply to {args.quantize} layers, which have one set-up; drop "
            f"one of {setup_flag(args)} and --quantize"
        )
    if args.setup != "default" and (args.no_fuse or args.no_prepack):
        raise UsageError(
            f"--no-fuse and --no-prepack change the default set-up; with {setup_flag(args)} name the "
            "set-up you want instead (plain, stacked, prepacked, compiled)"
        )
    if args.prompts_file is not None and args.tree is not None and not args.no_draft:
        raise UsageError("token trees are not batched; drop --tree or --prompts-file")
    if args.prompts_file is not None and "prompt" in given:
        raise UsageError("give --prompt or --prompts-file, not both")
    if args.interactive:  # its turns are user turns in the chat template: --system applies
        chat.check_flags(given)
        args.chat = True


def setup_flag(args: argparse.Namespace) -> str:
    """How the command line asked for its set-up, for messages."""
    return {
        "measure-all": "--compile",
        "compiled": "--compile force" if args.compile else "--setup compiled",
    }.get(args.setup, f"--setup {args.setup}")


def print_plan(args: argparse.Namespace) -> int:
    """--plan: the per-GPU memory of this pair from configs only (model/scale/memory.py), and the
    cheapest change that fits when it does not (exit status 1)."""
    args.draft = named_draft(args.target, args.draft, args.no_draft)
    target, draft = plan_configs(args.target, args.draft)
    tp = args.tp or int(os.environ.get("WORLD_SIZE", "1"))
    device = args.plan_device or ("auto" if torch.cuda.is_available() else "h200")
    dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16
    result = plan(
        target,
        draft,
        dtype,
        tp_size=tp,
        quantize=args.quantize,
        device_name=device,
        target_name=args.target,
        draft_name=args.draft,
    )
    suggestion = plan_suggestion(target, draft, dtype, tp, args.quantize, device)
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            json.dumps({**result.to_dict(), "suggestion": suggestion})
            if args.json
            else result.render() + (f"\n  {suggestion}" if suggestion else "")
        )
    return 0 if result.fits else 1


def load(
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    world_size: int,
    prompts: list[str] | None,
) -> tuple[Pair, list[list[int]], Setups | None, list[str]]:
    """Read, check and load the pair; everything that can be refused is refused before the
    weights are read. Returns the pair (weights.load), the encoded prompts (the lines of
    --prompts-file, or [--prompt]), the set-ups chosen (None for the default set-up) and notes on
    the checkpoints (fields not classified, the model's own sampling defaults)."""
    named = read_named_pair(
        args.target,
        args.draft,
        args.gamma,
        no_draft=args.no_draft,
        gamma_given=args.gamma_given,
    )
    args.draft = named.draft  # the default draft, when none was named
    args.gamma = named.gamma  # a default head's own, when --gamma was not given
    spec = named.spec
    if args.interactive:
        chat.check_template(spec.tokenizer, args.target)
    if args.setup != "default" and world_size > 1:
        raise UsageError(
            f"{setup_flag(args)} is for one process: tensor-parallel shards keep the default set-up (a "
            f"compiled shard's all-reduces would run outside the graph); drop {setup_flag(args)} under "
            "torchrun"
        )
    if is_head(spec.kind) and world_size > 1:
        raise UsageError(
            f"--draft {args.draft} is a feature head, which reads the target's whole output head: not "
            "supported under tensor parallelism; use a draft model or --draft lookup"
        )
    if args.tree is not None and spec.kind == "lookup":
        raise UsageError(
            "--tree needs a drafter that can build trees (a draft model or a feature head); prompt "
            "lookup proposes one chain"
        )
    encoded = [
        encode_prompt(spec.tokenizer, text, args.chat, args.system)
        for text in prompts or [args.prompt]
    ]
    context = spec.context
    models = [args.target]
    kind = registered(spec.kind)
    if kind is not None and kind.bare:  # a draft model's context bounds the run as well
        models.append(args.draft)
    whose = f"of {' and '.join(models)}"
    if args.ctx_size is not None and args.ctx_size > context:
        raise UsageError(
            f"--ctx-size {args.ctx_size} is more than the {context}-token context {whose}"
        )
    if args.ctx_size is not None:
        context, whose = args.ctx_size, "that --ctx-size gives"
    for line, prompt_ids in enumerate(encoded, 1):
        if len(prompt_ids) >= context:
            where = f"--prompts-file line {line}: the prompt" if prompts else "the prompt"
            raise UsageError(
                f"{where} is {len(prompt_ids)} tokens, which leaves no room in the {context}-token "
                f"context {whose}"
            )
    shape = args.tree
    if args.tree == "auto":  # room for its largest
        shape = AutoTree().covering()
    ahead = drafted_ahead(args, shape)
    if args.tree and ahead + 1 >= context:
        raise UsageError(
            f"--tree {','.join(map(str, shape))} has {ahead} nodes, which cannot fit in the "
            f"{context}-token context (the target scores them all in one call)"
        )
    positions = min(
        context,
        max(map(len, encoded)) + args.max_new_tokens + (0 if spec.kind is None else ahead + 1),
    )
    if args.interactive:  # one conversation's caches grow to the whole context
        positions = context
    # the KV caches' rows
    rows = min(args.batch_size or len(encoded), len(encoded)) if prompts else 1
    # The set-up of each model: the default (compiled steps from the cache, else stacked and prepacked at once),
    # or measured or forced (--setup, --compile) for the calls this run makes.
    pair, setups = load_named_pair(
        named,
        device,
        dtype,
        positions=positions,
        rows=rows,
        gamma=args.gamma,
        gamma_max=GAMMA_MAX,
        cache_len=positions + 1,
        tree=shape,
        world_size=world_size,
        flag=setup_flag(args),
        draft_dtype=pick_dtype(args.draft_dtype, device) if args.draft_dtype else None,
        quantize=args.quantize,
        setup=args.setup,
        stack=not args.no_fuse,
        prepack=not args.no_prepack,
        cache_dir=args.cache_dir,
    )
    return (
        pair,
        encoded,
        setups,
        spec.notes + [line for line in [model_defaults_note(args, spec.sampling_defaults)] if line],
    )


def drafted_ahead(args: argparse.Namespace, shape: tuple[int, ...] | None) -> int:
    """The most tokens an iteration reads past a row's sequence: a tree's nodes, or the most
    gamma drafts (auto: GAMMA_MAX)."""
    if shape:
        return len(branching_parents(shape))
    if args.gamma == "auto":
        return GAMMA_MAX
    return args.gamma


def model_defaults_note(args: argparse.Namespace, defaults: dict[str, Any]) -> str | None:
    """One line naming the target's own sampling defaults (generation_config.json) where they differ
    from this run's: generate.py keeps its own defaults, which a flag changes (serve.py uses the model's)."""
    flags = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
    }
    differ = {key: value for key, value in defaults.items() if flags[key] != value}
    if not differ:
        return None
    named = ", ".join(f"--{key.replace('_', '-')} {value:g}" for key, value in differ.items())
    return (
        f"{args.target}'s generation_config.json suggests {named}; this run keeps generate.py's defaults "
        "unless those flags are given"
    )


def run(args: argparse.Namespace, given: set[str]) -> int:
    validate(args, given)
    # a default drafter may come with its own (weights.load.read_named_pair)
    args.gamma_given = "gamma" in given
    # Only rank 0 prints; the others compute silently.
    is_main = int(os.environ.get("RANK", "0")) == 0
    notes = cmdline.unused_flags(args, given)
    for note in notes if is_main else []:
        print(f"warning: {note}", file=sys.stderr)
    if args.temperature == 0:  # the warned-about flags are dropped, so that settings show what ran
        args.top_k = args.top_p = args.seed = None
    args.guard = cmdline.guarded(args.guard)
    args.verify = cmdline.verified(args.verify, args.temperature, args.tree)
    if args.plan:
        return print_plan(args)
    if args.compile_cache:
        return output.compile_cache(StepCache(args.cache_dir), args.compile_cache)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.interactive and world_size > 1:
        raise UsageError("--interactive is a conversation in one process, not under torchrun")
    texts = None  # the prompts of --prompts-file, decoded as one batch
    if args.prompts_file is not None:
        if world_size > 1:
            raise UsageError(
                "--prompts-file is not supported under torchrun: batches do not run tensor-parallel; "
                "run it in one process, or give one --prompt"
            )
        texts = cmdline.read_prompts(args.prompts_file)
    else:
        args.prompt = cmdline.read_prompt(args.prompt, world_size)
    # under torchrun: one process per GPU (cuda:LOCAL_RANK), NCCL; gloo on the CPU
    if world_size > 1:
        if (
            pick_device(args.device).type == "cuda"
            and args.device is not None
            and ":" in args.device
        ):
            raise UsageError(
                "under torchrun each rank uses GPU LOCAL_RANK: pass --device cuda, not a numbered one"
            )
        info = init_distributed(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        device = info.device
        is_main = info.is_main
    else:
        device = pick_device(args.device)
    # what the run waits for before its header, on a terminal: loading, costs measured once per set-up
    say = None
    if not args.json and not args.quiet and is_main and sys.stderr.isatty():
        say = output.say
        say(f"load: {args.target} ...")
    args.quantize, args.dtype, reading = settle_reading(
        args.target, args.quantize, args.dtype, device, args.cache_dir, world_size
    )
    dtype = pick_dtype(args.dtype, device, None if args.quantize else stored_dtype(args.target))
    if "no_prepack" in given and is_main and (device.type != "cpu" or not packable(dtype)):
        print(
            f"warning: --no-prepack has no effect on {device} in {str(dtype).removeprefix('torch.')}: weights are "
            "prepacked only on the CPU in float32 (and bfloat16 with native bf16)",
            file=sys.stderr,
        )
    pair, encoded, setups, load_notes = load(args, device, dtype, world_size, texts)
    if reading is not None:
        load_notes = [reading, *load_notes]
    for line in load_notes if not args.json and is_main else []:
        print(f"note: {line}", file=sys.stderr)
    # Every rank draws the same random numbers: one seed, rank 0's (also a fresh one, shown for repeating the run).
    seed = None  # greedy draws no random number
    if args.temperature > 0:
        seed = broadcast_seed(args.seed, device)
    speculative = pair.draft is not None
    compare = args.compare and speculative
    sampling = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=() if args.ignore_eos else pair.stop_ids,
        seed=seed,
    )
    guard_note = None
    one_row = texts is None and world_size == 1
    # A drafter that chooses its draft length by what an iteration costs here: costs measured
    # once on this machine and set-up (speculative.cli.pricing), before the guard measures it.
    with torch.inference_mode():
        price_note = pricing.price(
            args, pair, encoded[0], setups, StepCache(args.cache_dir), one_row, say
        )
    # The default guard: costs measured once on this machine and set-up (speculative.cli.costs).
    if args.guard.mode == "recorded":
        with torch.inference_mode():
            args.guard, guard_note = costs.default_guard(
                args,
                pair,
                encoded[0],
                setups,
                StepCache(args.cache_dir),
                one_row=one_row,
                say=say,
            )
    lines = setups.lines
    settings = output.run_settings(args, pair, lines, device, dtype, world_size, seed, compare)
    if not args.json and is_main:
        print(output.header_line(args, pair, device, dtype, world_size, seed), file=sys.stderr)
    if texts is not None:
        return run_batch(args, pair, texts, encoded, settings, sampling)

    prompt_ids, tokenizer = encoded[0], pair.tokenizer
    color = (
        not args.json
        and not args.no_color
        and sys.stdout.isatty()
        and not os.environ.get("NO_COLOR")
    )
    printing = not args.json and is_main
    if printing:
        for line in lines:
            print(f"setup: {line}", file=sys.stderr)
        for line in [
            *setups.notes,
            *filter(None, [cmdline.rule_note(args, given), price_note, guard_note]),
        ]:
            print(f"note: {line}", file=sys.stderr)
        if setups.compile_note(args.max_new_tokens):
            print(f"note: {setups.compile_note(args.max_new_tokens)}", file=sys.stderr)
        if color and speculative:
            print(output.LEGEND, file=sys.stderr)
    if args.interactive:  # turns from stdin, one engine for the whole conversation
        return chat.converse(args, pair, sampling, color)
    # The text as it comes: printed, and watched for --stop on every rank, so that all ranks stop
    # at the same iteration.
    streamer = None
    if printing or args.stop:
        streamer = output.Streamer(
            tokenizer,
            prompt_ids,
            sys.stdout if printing else None,
            color,
            prefix="" if args.chat else tokenizer.decode(prompt_ids),
            stops=args.stop,
        )
    ends = dict(context=args.ctx_size, stop=streamer.stopped if args.stop else None)
    step_clock = output.StepClock(streamer)
    # NonFiniteLogitsError (a ValueError) from either loop ends the run in main(): one error line, no tokens.
    with torch.inference_mode():
        if speculative:
            result = speculative_generate(
                pair.target,
                pair.draft,
                prompt_ids,
                args.max_new_tokens,
                gamma=None if args.tree else args.gamma,
                callback=step_clock,
                verify=args.verify,
                tree=args.tree,
                tree_mode=args.tree_mode,
                guard=args.guard,
                **ends,
                **sampling,
            )
        else:
            result = autoregressive_generate(
                pair.target,
                prompt_ids,
                args.max_new_tokens,
                callback=step_clock,
                **ends,
                **sampling,
            )
    tokens = [int(t) for t in result.tokens]
    text = None  # the continuation's text, when a stop string cut it
    if streamer is not None:
        streamer.finish()
    if streamer is not None and streamer.stopped():
        tokens, text = streamer.tokens, streamer.shown
    stats = report.stats_dict(result.stats, speculative)
    if printing:
        for line in report.summary_lines(stats, speculative, compare=compare) + [
            f"note: {setups.hint}"
        ] * bool(setups.hint):
            print(line, file=sys.stderr)
    sizes = list(getattr(result.stats, "gamma_history", [])) or [0] * len(step_clock.times)
    hint = output.busy_hint(step_clock.times, sizes, torch.get_num_threads(), device)
    comparison = None
    # the same prompt and settings, the target alone: every rank runs it, as it ran the first
    if compare:
        if printing:
            print(
                "compare: now the target alone, on the same prompt with the same settings ...",
                file=sys.stderr,
            )
        # a callback, as in the first run, so that both loops copy tokens alike
        watcher = output.Streamer(tokenizer, prompt_ids, None, False, stops=args.stop)
        with torch.inference_mode():
            baseline = autoregressive_generate(
                pair.target,
                prompt_ids,
                args.max_new_tokens,
                callback=output.StepClock(watcher),
                context=args.ctx_size,
                stop=watcher.stopped if args.stop else None,
                **sampling,
            )
        if watcher.stopped():  # its tokens cut as the first run's are
            baseline = replace(baseline, tokens=watcher.tokens)
        comparison = report.compare_stats(stats, baseline, tokens, args.temperature)
    if not is_main:
        return 0

    if args.json:
        doc = {
            "text": text if text is not None else continuation_text(tokenizer, prompt_ids, tokens),
            "tokens": tokens,
            "prompt_tokens": len(prompt_ids),
            "settings": settings,
            "stats": stats,
        }
        doc.update({"compare": comparison} if comparison is not None else {})
        print(json.dumps(report.jsonable({**doc, "notes": report.JSON_NOTES}), allow_nan=False))
    elif comparison is not None:
        print(report.compare_line(comparison), file=sys.stderr)
    if hint:
        print(hint, file=sys.stderr)
    return 0


def run_batch(
    args: argparse.Namespace,
    pair: Pair,
    texts: list[str],
    encoded: list[list[int]],
    settings: dict[str, Any],
    sampling: dict[str, Any],
) -> int:
    """--prompts-file: every prompt in one batched run (speculative_generate_batch), at most
    --batch-size rows per target call, prompt i sampling with seed + i. Nothing streams: the
    completions are printed after the run, in prompt order, then the batch's summary; with
    --compare the same batch runs again with the target alone."""
    speculative = pair.draft is not None
    compare = args.compare and speculative
    tokenizer = pair.tokenizer
    seed = sampling["seed"]
    rows = min(args.batch_size or len(encoded), len(encoded))
    if not args.json:
        where = "standard input" if args.prompts_file == "-" else args.prompts_file
        print(
            f"{len(encoded)} prompts from {where}, decoded as a batch of at most {rows} rows per target call",
            file=sys.stderr,
        )
    sampling = {**sampling, "batch_size": rows}
    # NonFiniteLogitsError (a ValueError) ends the run in main(): one error line, nothing on stdout.
    if speculative:
        result = speculative_generate_batch(
            pair.target,
            pair.draft,
            encoded,
            args.max_new_tokens,
            gamma=args.gamma,
            verify=args.verify,
            guard=args.guard,
            context=args.ctx_size,
            **sampling,
        )
    else:
        result = autoregressive_generate_batch(
            pair.target, encoded, args.max_new_tokens, context=args.ctx_size, **sampling
        )
    docs = []
    for i, (text, prompt_ids, row) in enumerate(zip(texts, encoded, result.results)):
        tokens, shown = cut_at_stop(tokenizer, prompt_ids, row.tokens, args.stop)
        if shown is not None:
            row.stats.stop_reason = "stop_string"
        docs.append(
            {
                "prompt_index": i,
                "line": i + 1,
                "prompt": text,
                "seed": None if seed is None else seed + i,
                "text": shown
                if shown is not None
                else continuation_text(tokenizer, prompt_ids, tokens),
                "tokens": tokens,
                "prompt_tokens": len(prompt_ids),
                "stats": report.stats_dict(row.stats, speculative),
            }
        )
    if not args.json:
        for doc, prompt_ids in zip(docs, encoded):
            seed_note = "" if doc["seed"] is None else f", seed {doc['seed']}"
            prefix = ""  # as the single run prints it: a chat's prompt is not echoed
            if not args.chat:
                prefix = tokenizer.decode(prompt_ids)
            print(
                f"--- prompt {doc['prompt_index']} (line {doc['line']}{seed_note}) ---\n{prefix}{doc['text']}"
            )
        sys.stdout.flush()
        for line in report.batch_summary_lines(result, speculative):
            print(line, file=sys.stderr)
    comparison = None
    if compare:
        if not args.json:
            print(
                "compare: now the target alone, on the same prompts in batches of the same size ...",
                file=sys.stderr,
            )
        baseline = autoregressive_generate_batch(
            pair.target, encoded, args.max_new_tokens, context=args.ctx_size, **sampling
        )
        comparison = report.compare_batch(result, baseline, args.temperature)
    if args.json:
        out = {
            "prompts": docs,
            "batch": result.stats.to_dict(),
            "settings": {**settings, "prompts_file": args.prompts_file, "batch_size": rows},
        }
        out.update({"compare": comparison} if comparison is not None else {})
        notes = {**report.JSON_NOTES, **report.BATCH_NOTES}
        print(json.dumps(report.jsonable({**out, "notes": notes}), allow_nan=False))
    elif comparison is not None:
        print(report.batch_compare_line(comparison), file=sys.stderr)
    return 0


def cut_at_stop(
    tokenizer: Any, prompt_ids: list[int], tokens: list[int], stops: list[str]
) -> tuple[list[int], str | None]:
    """A batch row's tokens up to the one that completed its first --stop string, and its text
    before that string (None: it met none, and the tokens are all kept). The rows of a batch are
    cut after the run: each runs on to its own end."""
    text = Output(tokenizer, prompt_ids, stops)
    text.add([int(t) for t in tokens])
    text.finish()
    if not text.stopped:
        return text.tokens, None
    return text.tokens, text.text


def main(argv: list[str] | None = None) -> int:
    # Under torchrun every rank meets the same bad input: rank 0 alone reports it. Damaged
    # weights are the exception: each rank reads only its own slice, so whichever rank finds
    # them says so.
    rank = int(os.environ.get("RANK", "0"))
    try:
        return run(build_parser().parse_args(argv), given_flags(argv))
    except NonFiniteWeightsError as err:
        print(
            f"error: {'' if rank == 0 else f'rank {rank}: '}{err}".splitlines()[0], file=sys.stderr
        )
        return 2
    except ValueError as err:  # UsageError, UnknownCheckpointError, CheckpointError, PairMismatchError, ConfigError...
        if rank == 0:
            print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError:
        print(
            "error: out of GPU memory; try a smaller pair, a smaller dtype or fewer --max-new-tokens",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `python generate.py | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
