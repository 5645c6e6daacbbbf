"""What the command line takes in (generate.py, and serve.py where they apply): the parser
that turns a bad flag into one ``error:`` line, --gamma and --tree values, the device and
dtype, the rule for flags a run cannot use, and reading prompts (docs/cli.md is their
reference)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from model.host import describe_cpu
from speculative.draft import DRAFTERS
from speculative.engine.gamma_policy import OFF, RECORDED, TIMED, Guard
from speculative.verify import RULES
from speculative.verify.registry import SAMPLED_CHAIN_RULE, default_rule


class UsageError(ValueError):
    """Bad command-line input; reported as one ``error:`` line with exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a parse error becomes a UsageError (one line, no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def add_flags(
    parser: argparse.ArgumentParser,
    table: dict[str, Any],
    flags: list[str],
    changes: dict[str, dict] | None = None,
) -> None:
    """Add ``flags`` to ``parser`` from a table that names every flag once: ``(type, default, help[,
    choices])`` or argparse's keywords, with ``changes`` (a flag's own default or help) laid over
    them. A help that does not give its default gets " (default X)"."""
    for flag in flags:
        option = (
            table[flag]
            if isinstance(table[flag], dict)
            else dict(zip(("type", "default", "help", "choices"), table[flag]))
        )
        option = {**option, **(changes or {}).get(flag, {})}
        if not (option.get("required") or option.get("action") or "default" in option["help"]):
            option["help"] += f" (default {option['default']})"
        parser.add_argument(flag, **option)


def gamma_arg(text: str) -> int | str:
    """--gamma: an integer (checked >= 1 by generate.validate) or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1 or 'auto', got {text!r}"
        ) from None


def guarded(asked: bool | None) -> Guard:
    """--guard (the run's own timings), --no-guard (none), or by default the recorded guard: costs
    measured once on this machine and set-up (speculative.cli.costs), which a sampled run needs
    because the run's timings would make its tokens follow the clock as well as its seed, and which
    spare a greedy one the timed switch's probes. Its costs are read once the pair is loaded
    (costs.default_guard); where none apply, :func:`unrecorded` is the guard."""
    if asked is None:
        return RECORDED
    if asked:
        return TIMED
    return OFF


def unrecorded(temperature: float) -> Guard:
    """The guard where recorded costs do not apply (a batch, torchrun, gamma or tree "auto", nothing
    drafted): timed when greedy, where the output is the target's greedy tokens whatever the switch
    does; none when sampled, where it would follow the clock."""
    if temperature == 0:
        return TIMED
    return OFF


SAMPLED_RULE = SAMPLED_CHAIN_RULE  # serve.py's --verify default: the library's (speculative.verify)


def verified(asked: str | None, temperature: float, tree: object) -> str:
    """--verify, or by default the library's rule (speculative.verify.default_rule: block
    verification of a sampled chain, a tree's own walk). Greedy, every rule compares argmaxes, and
    the run is named for the token-wise rule."""
    if asked:
        return asked
    if temperature == 0:
        return "token"
    return default_rule(tree)


def tree_arg(text: str) -> tuple[int, ...] | str:
    """--tree: the branching per depth, integers >= 1 joined by commas, or auto."""
    if text == "auto":
        return text
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"must be the branching per depth as integers >= 1 joined by commas, e.g. "
            f"3,2,1,1, or auto; got {text!r}"
        )
    return shape


def rules_help() -> str:
    """--verify's help: the registered rules (speculative.verify.RULES)."""
    return "; ".join(f"{r.name}: {r.description}" for r in RULES.values())


def drafters_help() -> str:
    """--draft's help: a checkpoint or feature head by name or folder, or a kind that needs no file."""
    named = [k.name for k in DRAFTERS.values() if not k.needs_files]
    return f"a draft model, a parallel draft or a feature head (a name or a folder), or {' or '.join(named)}"


# ----------------------------------------------------------------------------- device and dtype
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch is built without CUDA"
                if torch.version.cuda is None
                else "no CUDA GPU is visible"
            )
            raise UsageError(
                f"--device {name} asked for, but CUDA is not available ({why}); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {name} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name} asked for, but MPS is not available")
    elif device.type not in ("cpu", "mps"):
        raise UsageError(f"device type {device.type!r} is not supported; use cpu, cuda or cuda:N")
    return device


DTYPE_HELP = (
    "default: bfloat16 (float16) on a GPU; on a CPU the checkpoint's own bfloat16 where the CPU computes "
    "it natively (AVX512-BF16, AMX), else float32"
)


DRAFT_DTYPE_HELP = (
    "the drafter's (default: its checkpoint's own bfloat16 on a CPU that computes it natively, else "
    "the target's; the output is the target's whatever the drafter's numerics)"
)


def add_dtype_flags(add: Callable[..., Any]) -> None:
    """--dtype and --draft-dtype, as generate.py and serve.py take them."""
    add("--dtype", default=None, choices=sorted(DTYPES), help=DTYPE_HELP)
    add("--draft-dtype", default=None, choices=sorted(DTYPES), help=DRAFT_DTYPE_HELP)


def pick_dtype(name: str | None, device: torch.device, stored: str | None = None) -> torch.dtype:
    """``--dtype`` or, when not given, the fastest dtype that keeps the checkpoint's numerics: bfloat16
    (else float16) on a GPU; on a CPU the checkpoint's own bfloat16 (``stored``, its torch_dtype) where
    the CPU computes bfloat16 natively (docs/results/drafters_smollm2_bf16.md), else float32."""
    # native: Ampere and newer
    bf16 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8
    if name is None:
        if device.type in ("cuda", "mps"):
            return torch.bfloat16 if bf16 else torch.float16
        return (
            torch.bfloat16 if stored == "bfloat16" and describe_cpu().native_bf16 else torch.float32
        )
    dtype = DTYPES[name]  # argparse choices already rejected unknown names
    if device.type == "cuda" and dtype == torch.bfloat16 and not bf16:
        raise UsageError(
            f"--dtype bfloat16 needs a GPU with compute capability 8.0 or newer; "
            f"{torch.cuda.get_device_name(device)} has not got native bfloat16: use --dtype float16"
        )
    if device.type == "mps" and dtype == torch.float64:
        raise UsageError("--dtype float64 is not supported on mps; use float32 or float16")
    return dtype


# ----------------------------------------------------------------------------- flags a run cannot use
# What --plan does not read: it plans from the configs, the dtype, --quantize and --tp alone.
RUN_ONLY = (
    "prompt",
    "prompts_file",
    "batch_size",
    "chat",
    "system",
    "gamma",
    "guard",
    "verify",
    "tree",
    "tree_mode",
    "temperature",
    "top_k",
    "top_p",
    "max_new_tokens",
    "ignore_eos",
    "stop",
    "ctx_size",
    "seed",
    "compare",
    "threads",
    "device",
    "no_prepack",
    "no_fuse",
    "setup",
    "compile",
    "no_color",
)


def flag(dest: str) -> str:
    """An option's name on the command line: top_k -> --top-k."""
    return "--" + dest.replace("_", "-")


def unused_flags(args: argparse.Namespace, given: set[str]) -> list[str]:
    """One warning for each group of flags given on the command line that this run cannot use.

    The rule (generate.py's docstring): a flag that changes nothing is a warning, never an
    error and never silence, so that a run does what it would do without it and says so."""
    warnings = []

    def unused(dests: Sequence[str], why: str) -> None:
        names = [flag(dest) for dest in dests if dest in given]
        if names:
            joined = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
            warnings.append(f"{joined} {'has' if len(names) == 1 else 'have'} no effect {why}")

    if args.plan:
        unused(RUN_ONLY, "with --plan, which reads only the configs")
        if args.no_draft:
            unused(["draft"], "with --no-draft")
    else:
        unused(
            ["tp", "plan_device"],
            "without --plan; to run on N GPUs, launch with torchrun --nproc-per-node N "
            "generate.py ...",
        )
        if args.temperature == 0:
            unused(
                ["top_k", "top_p", "seed"],
                "at temperature 0: greedy decoding takes the most likely token",
            )
        if args.no_draft:
            unused(
                ["draft", "gamma", "guard", "compare", "verify", "tree", "tree_mode"],
                "with --no-draft: the target decodes alone",
            )
        elif args.tree is not None:
            unused(["gamma"], "with --tree: the tree's depth is its gamma")
        else:
            unused(["tree_mode"], "without --tree")
        if not args.no_draft and "auto" in (args.gamma, args.tree):
            unused(
                ["guard"],
                "with --gamma auto or --tree auto, which turn speculation off where it loses themselves",
            )
        if not args.chat:
            unused(["system"], "without --chat")
        if args.prompts_file is None:
            unused(["batch_size"], "without --prompts-file: a single prompt is one row")
    if args.json:
        unused(["no_color"], "with --json, which prints no colours")
    elif args.prompts_file is not None and not args.plan:
        unused(["no_color"], "with --prompts-file, which prints no colours")
    return warnings


def rule_note(args: argparse.Namespace, given: set[str]) -> str | None:
    """What a rule named by --verify does at temperature 0, where it is registered to give way to
    the comparison of argmaxes (speculative.verify.registry): said once, after the header."""
    rule = RULES[args.verify]
    if (
        "verify" in given
        and args.temperature == 0
        and not args.no_draft
        and args.tree is None
        and rule.greedy
    ):
        return f"at temperature 0, --verify {rule.name} is {rule.at_temperature_0}"
    return None


# ----------------------------------------------------------------------------- prompts
def read_prompt(text: str, world_size: int) -> str:
    """--prompt as given, or standard input for ``-`` (its trailing newlines dropped: ``echo`` adds one).
    An empty one is refused here, before anything is loaded."""
    if text == "":
        raise UsageError(
            '--prompt is empty: give the text to continue, e.g. --prompt "Once upon a time" (or leave '
            "--prompt out for the default one)"
        )
    if text != "-":
        return text
    if world_size > 1:
        raise UsageError(
            "--prompt - is not supported under torchrun, which does not give every rank the same "
            "standard input; pass the text itself"
        )
    prompt = sys.stdin.read().rstrip("\r\n")
    if not prompt:
        raise UsageError(
            "--prompt -: standard input is empty; pipe the prompt in, e.g. echo 'Once upon a time' | "
            "generate.py --prompt -"
        )
    return prompt


def read_prompts(path: str) -> list[str]:
    """--prompts-file: one prompt per line of the file (or of standard input for ``-``).

    The empty string after a final newline is not a line; any other empty or whitespace-only
    line is an error naming its number, as is a file that cannot be read or holds no prompt.
    A line's closing ``\\r`` (a Windows file) is dropped; nothing else is stripped."""
    where = "- (standard input)" if path == "-" else path
    try:
        text = (
            sys.stdin.read() if path == "-" else Path(path).expanduser().read_text(encoding="utf-8")
        )
    except UnicodeDecodeError as err:
        raise UsageError(
            f"--prompts-file {where} is not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None
    except OSError as err:
        raise UsageError(f"--prompts-file {where} cannot be read: {err.strerror or err}") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    if not lines:
        raise UsageError(f"--prompts-file {where} holds no prompts: write one prompt per line")
    prompts = [line.removesuffix("\r") for line in lines]
    for number, prompt in enumerate(prompts, 1):
        if not prompt.strip():
            raise UsageError(
                f"--prompts-file {where}: line {number} is empty; every line must hold a prompt"
            )
    return prompts


# ----------------------------------------------------------------------------- streamed output


# ----------------------------------------------------------------------------- what a run was
