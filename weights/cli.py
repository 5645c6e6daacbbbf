"""The command line's helpers (generate.py, and serve.py where they apply) that are no library
concern, kept in weights/ with the other text and file I/O: the rule for flags a run cannot use,
reading prompts, the streamed and coloured output, the step clock with its busy-CPU hint,
and the header and settings that describe a run (docs/cli.md is their reference).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter
from typing import Any, TextIO

import torch

from speculative.tree import branching_parents
from weights import Tokenizer
from weights.text import TextStream, marked_for_chat

GREEN, YELLOW, RESET = "\033[32m", "\033[33m", "\033[0m"
LEGEND = (f"colours: {GREEN}draft tokens accepted by the target{RESET}, {YELLOW}tokens produced by the target{RESET} "
          "(after a rejection, or the bonus token)")


class UsageError(ValueError):
    """Bad command-line input; reported as one ``error:`` line with exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a parse error becomes a UsageError (one line, no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def gamma_arg(text: str) -> int | str:
    """--gamma: an integer (checked >= 1 by generate.validate) or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}") from None


def tree_arg(text: str) -> tuple[int, ...]:
    """--tree: the branching per depth, integers >= 1 joined by commas."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"must be the branching per depth as integers >= 1 joined by commas, e.g. "
                                         f"3,2,1,1; got {text!r}")
    return shape


# ----------------------------------------------------------------------------- flags a run cannot use
# What --plan does not read: it plans from the configs, the dtype, --quantize and --tp alone.
RUN_ONLY = ("prompt", "prompts_file", "batch_size", "chat", "system", "gamma", "verify", "tree", "tree_mode",
            "temperature", "top_k", "top_p", "max_new_tokens", "seed",
            "compare", "threads", "device", "no_prepack", "no_fuse", "setup", "compile", "no_color")


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
        unused(["tp", "plan_device"], "without --plan; to run on N GPUs, launch with torchrun --nproc-per-node N "
                                      "generate.py ...")
        if args.temperature == 0:
            unused(["top_k", "top_p", "seed"], "at temperature 0: greedy decoding takes the most likely token")
        if args.no_draft:
            unused(["draft", "gamma", "compare", "verify", "tree", "tree_mode"],
                   "with --no-draft: the target decodes alone")
        elif args.tree is not None:
            unused(["gamma"], "with --tree: the tree's depth is its gamma")
        else:
            unused(["tree_mode"], "without --tree")
        if not args.chat:
            unused(["system"], "without --chat")
        if args.prompts_file is None:
            unused(["batch_size"], "without --prompts-file: a single prompt is one row")
    if args.json:
        unused(["no_color"], "with --json, which prints no colours")
    elif args.prompts_file is not None and not args.plan:
        unused(["no_color"], "with --prompts-file, which prints no colours")
    return warnings


def chat_warning(name: str) -> str | None:
    """A warning for --chat when nothing marks the target as trained for chat
    (weights.text.marked_for_chat): a base model does not follow the template, it continues
    the text after [/INST], often mid-sentence or by writing more of the prompt."""
    if marked_for_chat(name):
        return None
    return (f"--chat: the target {name} is not marked as a chat model (no 'chat' or 'instruct' in its name or "
            "config, no chat_template): a base model does not follow the template, and its output may start "
            "mid-sentence")


# ----------------------------------------------------------------------------- prompts
def read_prompt(text: str, world_size: int) -> str:
    """--prompt as given, or standard input for ``-`` (its trailing newlines dropped: ``echo`` adds one)."""
    if text != "-":
        return text
    if world_size > 1:
        raise UsageError("--prompt - is not supported under torchrun, which does not give every rank the same "
                         "standard input; pass the text itself")
    prompt = sys.stdin.read().rstrip("\r\n")
    if not prompt:
        raise UsageError("--prompt -: standard input is empty; pipe the prompt in, e.g. echo 'Once upon a time' | "
                         "generate.py --prompt -")
    return prompt


def read_prompts(path: str) -> list[str]:
    """--prompts-file: one prompt per line of the file (or of standard input for ``-``).

    The empty string after a final newline is not a line; any other empty or whitespace-only
    line is an error naming its number, as is a file that cannot be read or holds no prompt.
    A line's closing ``\\r`` (a Windows file) is dropped; nothing else is stripped."""
    where = "- (standard input)" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).expanduser().read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"--prompts-file {where} is not UTF-8 text ({err.reason} at byte {err.start})") from None
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
            raise UsageError(f"--prompts-file {where}: line {number} is empty; every line must hold a prompt")
    return prompts


# ----------------------------------------------------------------------------- streamed output
class Streamer:
    """The loop's callback: the text of each batch of new tokens to ``out`` as soon as it is
    complete (weights.text.TextStream), drafted tokens the target accepted in green and its
    own in yellow when ``color``.

    ``prefix`` (the prompt's text) is written together with the first new text, not before
    the run: a run that fails before its first token (an error such as non-finite logits)
    leaves stdout empty."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], out: TextIO, color: bool,
                 prefix: str = "") -> None:
        self.text, self.out, self.color, self.prefix = TextStream(tokenizer, prompt_ids), out, color, prefix

    def __call__(self, new_ids: Sequence[int], from_draft: Sequence[bool]) -> None:
        runs: list[tuple[bool, str]] = []  # consecutive pieces of one colour, merged
        for token, drafted in zip(new_ids, from_draft):
            piece = self.text.add(token)
            if piece and runs and runs[-1][0] == drafted:
                runs[-1] = (drafted, runs[-1][1] + piece)
            elif piece:
                runs.append((drafted, piece))
        if runs and self.color:
            self.write("".join(f"{GREEN if drafted else YELLOW}{text}{RESET}" for drafted, text in runs))
        elif runs:
            self.write("".join(text for _, text in runs))

    def write(self, text: str) -> None:
        """``text`` to ``out`` at once, after the prefix if it has not been written yet."""
        self.out.write(self.prefix + text)
        self.prefix = ""
        self.out.flush()

    def finish(self) -> None:
        """The end of the text, and a newline."""
        self.write(self.text.finish() + "\n")  # whatever was held back (a truly broken byte sequence)


class StepClock:
    """The loop's callback, timed: ``times`` holds when each call came (one per iteration of
    the speculative loop, one per token without a draft), then the call is passed on.

    This is how generate.py sees per-iteration times without asking the loop for them; the
    gaps include the streamer's printing, which is small next to a model step."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self.times: list[float] = []

    def __call__(self, new_ids: Sequence[int], from_draft: Sequence[bool]) -> None:
        self.times.append(perf_counter())
        if self.inner is not None:
            self.inner(new_ids, from_draft)


BUSY_SPREAD = 3.0  # 90th / 10th percentile of the step times above which the CPU looks contended


def busy_hint(times: Sequence[float], sizes: Sequence[int], threads: int, device: torch.device) -> str | None:
    """One hint to try --threads 1, when steps of one size took very different times on a CPU.

    ``times``: when each iteration ended (StepClock); ``sizes``: the tokens each drafted
    (all 0 without a draft). Only decode iterations of the most common size are compared:
    the first also read the prompt, and iterations that drafted fewer tokens are cheaper.
    With several threads each operator waits for all of them, so when other processes hold
    the cores most steps wait for a descheduled thread: measured on 2 cores with 2 spinning
    processes, the shipped pair's iterations took 7.5 ms (10th percentile) to 556 ms (90th)
    with 2 threads, 11 tokens/s, against 8.1 to 9.7 ms and 401 tokens/s with --threads 1; on
    the idle machine, 7.0 to 8.6 ms with 2 threads. Needs 10 such iterations; else None.
    """
    if device.type != "cpu" or threads <= 1:
        return None
    steps = [(b - a, size) for a, b, size in zip(times, times[1:], sizes[1:])]
    if not steps:
        return None
    modal = max(set(size for _, size in steps), key=[size for _, size in steps].count)
    same = sorted(seconds for seconds, size in steps if size == modal)
    if len(same) < 10:
        return None
    fast, slow = same[len(same) // 10], same[(9 * len(same)) // 10]
    if slow < BUSY_SPREAD * fast:
        return None
    return (f"hint: decode steps took {fast * 1e3:.1f} ms to {slow * 1e3:.1f} ms (10th to 90th percentile): other "
            f"processes seem to be using the CPU, and each of the {threads} threads waits for the slowest; "
            "--threads 1 is often many times faster then")


# ----------------------------------------------------------------------------- what a run was
def header_line(args: argparse.Namespace, pair: Any, device: torch.device, dtype: torch.dtype, world_size: int,
                seed: int | None) -> str:
    """The run's first line on stderr: the pair, where it runs, and the whole decoding setup."""
    speculative = pair.draft is not None
    dtype_name = str(dtype).removeprefix("torch.") + (" with int8 weights" if args.quantize else "")
    tuning = [f"{pair.fused} projection groups stacked"] if pair.fused else []
    tuning += [f"{pair.prepacked} layers oneDNN-prepacked"] if pair.prepacked else []
    if tuning:
        dtype_name += f" ({', '.join(tuning)})"
    if world_size > 1:
        dtype_name += f", tensor-parallel over {world_size} ranks"
    names = f"draft {args.draft} -> target {args.target}" if speculative else f"target {args.target} alone"
    return (f"{names} on {device} in {dtype_name} (loaded in {pair.load_s:.1f}s), "
            f"{sampling_setup(args, seed, speculative)}")


def sampling_setup(args: argparse.Namespace, seed: int | None, speculative: bool) -> str:
    """The header's decoding settings, all of them: what was given and what was defaulted."""
    if args.temperature == 0:
        text = "greedy (temperature 0)"
    else:
        notes = [] if args.seed is not None else ["fresh; --seed repeats it"]
        notes += ["prompt i uses seed + i"] if args.prompts_file is not None else []
        text = (f"temperature {args.temperature:g}, top-k {args.top_k or 'off'}, top-p {args.top_p or 'off'}, "
                f"seed {seed}" + (f" ({'; '.join(notes)})" if notes else ""))
    if not speculative:
        return text
    if args.tree:
        shape = ",".join(map(str, args.tree))
        return text + f", tree {shape} ({len(branching_parents(args.tree))} nodes, children {args.tree_mode})"
    return text + f", gamma {args.gamma}, {args.verify}-wise verification"


def run_settings(args: argparse.Namespace, pair: Any, setups: list[str], device: torch.device, dtype: torch.dtype,
                 world_size: int, seed: int | None, compare: bool) -> dict[str, Any]:
    """--json's ``settings``: what the run used (top_k, top_p and seed are None when greedy)."""
    speculative = pair.draft is not None
    return {"target": args.target, "draft": None if args.no_draft else args.draft, "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "gamma": args.gamma if speculative else None,
            "verify": args.verify if speculative else None, "tree": args.tree if speculative else None,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens, "seed": seed, "chat": args.chat,
            "quantize": args.quantize, "tensor_parallel": world_size,
            "prepacked_layers": pair.prepacked, "fused_groups": pair.fused, "setup": setups or args.setup,
            "threads": torch.get_num_threads(), "compare": compare}
