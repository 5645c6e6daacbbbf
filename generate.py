"""Generate text with speculative decoding: a small draft model proposes, the target verifies.

    python generate.py                                   # the shipped tiny pair, on the CPU
    python generate.py --draft 7b --target 70b --prompt "The capital of France is"
    python generate.py --draft 7b-chat --target 70b-chat --chat --prompt "Write a haiku about the sea"
    python generate.py --no-draft                        # the target alone: the baseline
    python generate.py --compare                         # both, one after the other: the measured speedup
    python generate.py --json                            # one JSON object on stdout
    echo "Once upon a time" | python generate.py --prompt -
    python generate.py --prompts-file prompts.txt        # one prompt per line, decoded together in a batch

(From a clone set up by the README's quick start, run it as .venv/bin/python generate.py,
or activate the environment first: source .venv/bin/activate.)

The continuation streams to stdout as the target accepts it. On a terminal, draft tokens
the target accepted are green and tokens the target produced itself (the fix-up after a
rejection, and the bonus token after a fully accepted block) are yellow. Statistics and
the comparison with the paper's cost model go to stderr, so ``> out.txt`` keeps only text.

--prompts-file FILE (- for stdin) decodes one prompt per line as a batch: one target call
per iteration for all rows, at most --batch-size rows at a time (default: all). Prompt i
(from 0, line i + 1) samples with seed + i: its tokens are those of a run of --prompt
"<that line>" --seed <seed + i>, whatever the batch size. Nothing streams: after the run
each completion is printed in prompt order under a ``--- prompt i (line i + 1, seed s) ---``
line, then the batch's summary. Token trees (--tree) and tensor parallelism are not batched.

The summary says why the run stopped: "eos" (the model ended the text), "max_new_tokens"
(the --max-new-tokens limit) or "max_seq_len" (the context is full). It has two acceptance
numbers: acceptance_rate is the paper's alpha, the probability that the target accepts a
drafted token (the mean of sum_x min(p, q) over the positions it verified); it is the alpha
of the cost model. empirical_acceptance is the share of drafted tokens that were kept,
lower, because the tokens drafted after a rejection are never verified. docs/cli.md
describes every field of --json.

A flag that a run cannot use is not an error: it gets one ``warning: ...`` line on stderr
and the run goes on exactly as without it. For example --top-k, --top-p or --seed at
temperature 0; --draft, --gamma or --compare with --no-draft; --system without --chat;
--tp or --plan-device without --plan; the decoding flags with --plan; --no-color with
--json or --prompts-file; --batch-size without --prompts-file. A value that cannot be
right (--gamma 0, --top-p 2) is an error.

Exit status: 0 when the run is done; 1 when --plan finds that the pair does not fit (it
suggests the cheapest change that would); 2 for bad input (an unknown checkpoint, a
mismatched pair, impossible settings, damaged weights, a pair that does not fit in memory),
with one ``error: ...`` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

import torch
import torch.distributed as dist

from model import ConfigError, Llama, ModelConfig
from model.compile import compile_for_decoding, decode_widths
from model.fuse import prepare_for_decoding
from model.memory import DEFAULT_RESERVE, DEVICES, MemoryPlan, cheapest_fit, plan
from model.setup import SETUPS, SetupChoice, choose_setup
from model.tensor_parallel import broadcast_seed, init_distributed
from speculative import (
    BatchResult,
    PairMismatchError,
    autoregressive_generate,
    autoregressive_generate_batch,
    check_pair,
    speculative_generate,
    speculative_generate_batch,
)
from speculative.gamma import GAMMA_MAX
from speculative.tree import branching_parents
from weights import (
    CheckpointError,
    NonFiniteWeightsError,
    Tokenizer,
    UnknownCheckpointError,
    load_drafter,
    load_model,
    load_tokenizer,
    read_config,
    resolve,
)
from weights.drafters import LOOKUP, is_feature_head
from weights.registry import SHIPPED
from weights.sharded import load_model_tp, plan_config

DEFAULT_TARGET = "tiny-target"
DEFAULT_DRAFT = "tiny-draft"
DEFAULT_PROMPT = "Once upon a time"
DEFAULT_GAMMA = 4
DEFAULT_TEMPERATURE = 0.0
DEFAULT_MAX_NEW_TOKENS = 128
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# Llama-2 chat format (Meta's reference code): the system prompt sits inside the first [INST].
B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"

GREEN, YELLOW, RESET = "\033[32m", "\033[33m", "\033[0m"


class UsageError(ValueError):
    """Bad command-line input; reported as one ``error:`` line with exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a parse error becomes a UsageError (one line, no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


SETUP_CHOICES = ("default", "measure", *SETUPS)


def gamma_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}") from None


def tree_arg(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"must be the branching per depth as integers >= 1 joined by commas, e.g. "
                                         f"3,2,1,1; got {text!r}")
    return shape


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair = parser.add_argument_group("models")
    pair.add_argument("--target", default=DEFAULT_TARGET,
                      help="target model: 7b, 13b, 70b, 7b-chat, 13b-chat, 70b-chat, tiny-target, or a path to an "
                           f"HF-layout folder (default {DEFAULT_TARGET})")
    pair.add_argument("--draft", default=DEFAULT_DRAFT,
                      help="what proposes the tokens (docs/drafters.md): a draft model (the same choices as "
                           "--target, sharing its tokenizer; tiny-draft, or tiny-draft-undistilled, the same draft "
                           "before distillation), a feature head trained for the target (tiny-eagle, or a folder "
                           "written by train.py eagle), or 'lookup' (prompt lookup: copies what followed the "
                           f"latest earlier occurrence of the sequence's last 1-3 tokens) (default {DEFAULT_DRAFT})")
    pair.add_argument("--no-draft", action="store_true",
                      help="decode with the target alone, one token per call: the baseline to compare against")
    pair.add_argument("--device", default=None,
                      help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    pair.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                      help="weights and KV cache dtype (default: bfloat16 on cuda, float16 on a GPU without native "
                           "bfloat16, float32 on cpu). The cpu runs all four; bfloat16 on cuda needs compute "
                           "capability 8.0+; float64 (slow) makes greedy output free of rounding ties")
    pair.add_argument("--quantize", choices=["int8"], default=None,
                      help="store both models' transformer-block weights as int8 with one scale per output row "
                           "(weight-only: activations and the KV cache stay in --dtype): half the memory of "
                           "bfloat16, e.g. 7b -> 70b on one 80 GB GPU")
    pair.add_argument("--plan", action="store_true",
                      help="print the memory each GPU needs for this pair (weights, KV caches) and exit: status 0 "
                           "when it fits, 1 when it does not, with the cheapest change that would fit (--quantize "
                           "int8, more GPUs with --tp, a bigger --plan-device). Reads config.json only, or the "
                           "published Llama-2 shapes when the weights are not downloaded")
    pair.add_argument("--plan-device", default=None,
                      help=f"the GPU --plan plans for: {', '.join(DEVICES)}, or auto, the visible GPU (default: "
                           "auto when a GPU is visible, else h200)")
    pair.add_argument("--tp", type=int, default=None,
                      help="the tensor-parallel size --plan plans for (default: WORLD_SIZE under torchrun, else 1). "
                           "To run tensor-parallel, launch with: torchrun --nproc-per-node N generate.py ...")
    pair.add_argument("--no-prepack", action="store_true",
                      help="on cpu in float32, keep PyTorch's default matmul instead of weights reordered once for "
                           "oneDNN, which make verifying several tokens cost about one step (model/prepack.py)")
    pair.add_argument("--setup", choices=SETUP_CHOICES, default="default",
                      help="how the target and a draft model run a decode step: default (projections stacked, and "
                           "float32 weights prepacked for oneDNN on a CPU; a fixed choice, see model/setup.py), "
                           "measure (time plain, stacked and prepacked on this machine and keep the fastest per "
                           "model; printed on stderr), or one of plain, stacked, prepacked, compiled to force it")
    pair.add_argument("--compile", nargs="?", const="auto", choices=("auto", "force"), default=None,
                      help="compile the decode steps of the target and of a draft model (torch.compile: Inductor's "
                           "autotuned C++ kernels on a CPU, CUDA graphs on a GPU) for the call widths this run uses; "
                           "--compile times compiled against every eager set-up and keeps the fastest per model "
                           "(the choice is printed on stderr), --compile force keeps the compiled steps (the same "
                           "as --setup compiled). Compiling takes about a minute per model on a 2-core CPU, and a "
                           "note says when a run is too short to pay for it. Batches (--prompts-file) and token "
                           "trees get compiled shapes of their own, and a feature head is compiled with its "
                           "target. Not with --quantize or torchrun")
    pair.add_argument("--no-fuse", action="store_true",
                      help="keep q/k/v and gate/up as separate products instead of stacking each group into one "
                           "(model/fuse.py: fewer operators per decode step)")
    pair.add_argument("--threads", type=int, default=None,
                      help="torch CPU threads (default: torch's choice, normally all cores). On a machine where "
                           "other processes are busy, several threads wait on each other and decoding can be 10-40x "
                           "slower than with --threads 1; a run that sees it prints a hint")

    text = parser.add_argument_group("prompt")
    text.add_argument("--prompt", default=DEFAULT_PROMPT,
                      help=f"the text to continue, or - to read it from standard input (trailing newlines dropped) "
                           f"(default {DEFAULT_PROMPT!r})")
    text.add_argument("--chat", action="store_true",
                      help="wrap the prompt in the Llama-2 chat template '<s>[INST] <<SYS>>..<</SYS>> prompt [/INST]' "
                           "(for the -chat checkpoints; a warning says so when the target's name or config does not "
                           "mark it as a chat or instruct model)")
    text.add_argument("--system", default=None, help="system prompt for --chat (default: none)")
    text.add_argument("--prompts-file", default=None, metavar="FILE",
                      help="decode many prompts as one batch: FILE holds one prompt per line (UTF-8; each line is "
                           "encoded as a --prompt value would be, --chat and --system included; an empty or "
                           "whitespace-only line is an error), - reads them from standard input. Prompt i (from 0) "
                           "samples with seed + i. The completions are printed after the run, in order, each under "
                           "a '--- prompt i (line i+1, seed s) ---' line, then the batch's summary. Not with "
                           "--prompt, --tree or torchrun")
    text.add_argument("--batch-size", type=int, default=None, metavar="N",
                      help="with --prompts-file: at most N rows in one target call; a finished row's place goes to "
                           "the next waiting prompt (default: all the prompts at once)")

    sampling = parser.add_argument_group("decoding")
    sampling.add_argument("--gamma", type=gamma_arg, default=DEFAULT_GAMMA,
                          help=f"draft tokens proposed per target call, an integer >= 1, or 'auto' to choose it "
                               f"before every iteration from the measured acceptance rate and cost ratio (default "
                               f"{DEFAULT_GAMMA}: on the shipped pair 4 to 6 are about equally fast, auto a little "
                               "slower). Fewer are drafted where the output or the context is about to end")
    sampling.add_argument("--verify", choices=["token", "block"], default="token",
                          help="how a drafted chain is verified: token by token (Algorithm 1) or as a block (Sun "
                               "et al. 2025: the same output distribution, never fewer accepted tokens in "
                               "expectation; the same as token at temperature 0) (default token)")
    sampling.add_argument("--tree", type=tree_arg, default=None,
                          help="draft a token tree instead of a chain: the branching per depth, e.g. 3,2,1,1 (3 "
                               "candidates, 2 after each, then 1 and 1: 21 nodes scored in one target call); its "
                               "depth replaces --gamma. Needs a draft model or a feature head (default: a chain)")
    sampling.add_argument("--tree-mode", choices=["without_replacement", "iid", "deterministic"],
                          default="without_replacement",
                          help="how a tree node's children are drawn when sampling: distinct tokens from q, "
                               "independent draws from q, or q's top-k (greedy decoding always takes the top-k) "
                               "(default without_replacement)")
    sampling.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                          help="0 is greedy decoding: deterministic, and the output equals the target's own greedy "
                               "output; 1 samples from the target's distribution, as in the paper. Default 0: on "
                               "the shipped pair greedy has the higher acceptance rate and so shows the speedup best "
                               "(docs/benchmarks.md)")
    sampling.add_argument("--top-k", type=int, default=None,
                          help="sample only among the k most likely tokens (default: all; unused at temperature 0)")
    sampling.add_argument("--top-p", type=float, default=None,
                          help="nucleus sampling: the smallest set of tokens whose probability reaches p, 0 < p <= 1 "
                               "(default: all; unused at temperature 0)")
    sampling.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                          help=f"stop after this many new tokens, at end-of-sequence, or when the context is full "
                               f"(default {DEFAULT_MAX_NEW_TOKENS})")
    sampling.add_argument("--seed", type=int, default=None,
                          help="seed for sampling (default: a fresh one each run, shown in the header so that the "
                               "run can be repeated; greedy needs none)")
    sampling.add_argument("--compare", action="store_true",
                          help="run the same prompt twice in this process, with the draft and with the target alone, "
                               "and print the measured speedup (decode tokens/s of the one over the other) next to "
                               "the cost model's prediction. With --prompts-file: the batch twice, with the draft "
                               "and with the target alone (batched alike), and the ratio of their total tokens/s")

    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true",
                        help="print one JSON object {text, tokens, prompt_tokens, settings, stats, notes} on stdout "
                             "and nothing else (warnings still go to stderr; docs/cli.md lists every field). "
                             "stats.tokens_per_second is the decode speed: new tokens / time of the generation loop "
                             "after its first iteration, which also reads the prompt. stats.stop_reason is eos, "
                             "max_new_tokens or max_seq_len. stats.acceptance_rate is the paper's alpha (the "
                             "probability that a drafted token is accepted, the cost model's alpha); "
                             "stats.empirical_acceptance is accepted / drafted tokens, lower because tokens drafted "
                             "after a rejection are never verified; notes says the same. Without a draft, "
                             "acceptance_rate, gamma and predicted_speedup are null and draft_calls is 0. With "
                             "--compare, a compare object holds the baseline's stats and both speedups. With "
                             "--prompts-file, one object {prompts: [{prompt_index, line, prompt, seed, text, tokens, "
                             "prompt_tokens, stats}, ...], batch, settings, notes} (and compare with --compare)")
    output.add_argument("--no-color", action="store_true",
                        help="no ANSI colours (they are used only when stdout is a terminal and NO_COLOR is unset)")
    return parser


# ----------------------------------------------------------------------------- validation
def validate(args: argparse.Namespace) -> None:
    """Reject impossible settings before anything is loaded."""
    if isinstance(args.gamma, int) and args.gamma < 1:
        raise UsageError(f"--gamma must be an integer >= 1 or 'auto', got {args.gamma}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError(f"--temperature must be a number >= 0 (0 is greedy), got {args.temperature}")
    if args.top_p is not None and not (0 < args.top_p <= 1):
        raise UsageError(f"--top-p must lie in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {args.top_k}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.tp is not None and args.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {args.tp}")
    if args.tree is not None and args.verify == "block" and not args.no_draft:
        raise UsageError("--verify block is block verification of a chain; a --tree is verified by its own walk")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be an integer >= 1, got {args.batch_size}")
    if args.compile and args.setup != "default":
        raise UsageError(f"--compile and --setup {args.setup} both choose the set-up: give one (--compile force is "
                         "--setup compiled)")
    if args.compile:  # --compile is the measurement with the compiled set-up among the candidates
        args.setup = "compiled" if args.compile == "force" else "measure-all"
    if args.setup != "default" and args.quantize:
        raise UsageError(f"{setup_flag(args)} does not apply to int8 layers, which have one set-up; drop one of "
                         f"{setup_flag(args)} and --quantize")
    if args.setup != "default" and (args.no_fuse or args.no_prepack):
        raise UsageError(f"--no-fuse and --no-prepack change the default set-up; with {setup_flag(args)} name the "
                         "set-up you want instead (plain, stacked, prepacked, compiled)")
    if args.prompts_file is not None and args.tree is not None and not args.no_draft:
        raise UsageError("token trees are not batched; drop --tree or --prompts-file")


def setup_flag(args: argparse.Namespace) -> str:
    """How the command line asked for its set-up, for messages."""
    return {"measure-all": "--compile", "compiled": "--compile force" if args.compile else "--setup compiled"}.get(
        args.setup, f"--setup {args.setup}")


def given_flags(argv: list[str] | None) -> set[str]:
    """The options the command line set (dest names), even to their default value.

    Parsed a second time with every default replaced by a marker, because a parsed namespace
    alone cannot tell ``--gamma 4`` from no --gamma at all."""
    unset = object()
    probe = build_parser()
    probe.set_defaults(**{dest: unset for dest in vars(probe.parse_args([]))})
    return {dest for dest, value in vars(probe.parse_args(argv)).items() if value is not unset}


# What --plan does not read: it plans from the configs, the dtype, --quantize and --tp alone.
RUN_ONLY = ("prompt", "prompts_file", "batch_size", "chat", "system", "gamma", "verify", "tree", "tree_mode",
            "temperature", "top_k", "top_p", "max_new_tokens", "seed",
            "compare", "threads", "device", "no_prepack", "no_fuse", "setup", "compile", "no_color")


def unused_flags(args: argparse.Namespace, given: set[str]) -> list[str]:
    """One warning for each group of flags given on the command line that this run cannot use.

    The rule (the module docstring): a flag that changes nothing is a warning, never an error
    and never silence, so that a run does what it would do without it and says so."""
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


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


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
    A line's closing ``\r`` (a Windows file) is dropped; nothing else is stripped."""
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


CHAT_MARKERS = ("chat", "instruct")


def chat_warning(name: str) -> str | None:
    """A warning for --chat when nothing marks the target as trained for chat: no "chat" or
    "instruct" in its short name, folder name or config.json's _name_or_path, and no
    chat_template in a tokenizer_config.json. A base model does not follow the template: it
    continues the text after [/INST], often mid-sentence or by writing more of the prompt."""
    directory = resolve(name)
    labels = [Path(name).name, directory.name]  # the folders above say nothing about the model
    try:
        labels.append(str(json.loads((directory / "config.json").read_text()).get("_name_or_path", "")))
        tokenizer_config = directory / "tokenizer_config.json"
        if tokenizer_config.is_file() and "chat_template" in json.loads(tokenizer_config.read_text()):
            return None
    except (OSError, ValueError, AttributeError):
        pass  # read_config reports a broken config.json properly, later
    if any(marker in label.lower() for label in labels for marker in CHAT_MARKERS):
        return None
    return (f"--chat: the target {name} is not marked as a chat model (no 'chat' or 'instruct' in its name or "
            "config, no chat_template): a base model does not follow the template, and its output may start "
            "mid-sentence")


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise UsageError(f"--device {name} asked for, but CUDA is not available ({why}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError(f"--device {name} asked for, but MPS is not available")
    elif device.type != "cpu":
        raise UsageError(f"device type {device.type!r} is not supported; use cpu, cuda or cuda:N")
    return device


def cuda_bf16_supported(device: torch.device) -> bool:
    """Native bfloat16 (compute capability 8.0+, Ampere); emulated bf16 does not count."""
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        if device.type == "cuda":
            return torch.bfloat16 if cuda_bf16_supported(device) else torch.float16
        return torch.float16 if device.type == "mps" else torch.float32
    dtype = DTYPES[name]  # argparse choices already rejected unknown names
    if device.type == "cuda" and dtype == torch.bfloat16 and not cuda_bf16_supported(device):
        gpu = torch.cuda.get_device_name(device)
        raise UsageError(f"--dtype bfloat16 needs a GPU with compute capability 8.0 or newer; {gpu} has not got "
                         "native bfloat16: use --dtype float16")
    if device.type == "mps" and dtype == torch.float64:
        raise UsageError("--dtype float64 is not supported on mps; use float32 or float16")
    return dtype


# ----------------------------------------------------------------------------- memory
def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device right now (None if it cannot be told)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:  # not Linux: total physical memory is the best cheap bound
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_memory(target: tuple[str, ModelConfig], draft: tuple[str, ModelConfig] | None, positions: int,
                 dtype: torch.dtype, device: torch.device, tp_size: int = 1,
                 quantize: str | None = None, batch: int = 1) -> MemoryPlan | None:
    """Refuse, before loading anything, a pair that will not fit in the memory free right now.

    The plan (model/memory.py) counts parameters x dtype bytes for the weights (this rank's
    share under tensor parallelism, int8 blocks with --quantize) and
    2 x layers x kv_heads x head_dim x positions x dtype bytes for each KV cache (times
    ``batch``, its rows), plus, on a GPU, a reserve for the CUDA context and workspaces.
    """
    free = available_bytes(device)
    if free is None:
        return None
    if device.type == "cpu" and tp_size > 1:  # the ranks on this host share its memory
        free //= int(os.environ.get("LOCAL_WORLD_SIZE", str(tp_size)))
    reserve = DEFAULT_RESERVE if device.type == "cuda" else 0
    result = plan(target[1], draft[1] if draft else None, dtype, tp_size=tp_size, context=positions, batch=batch,
                  quantize=quantize, device_name=f"{device} (free)", reserve=reserve, target_name=target[0],
                  draft_name=draft[0] if draft else "draft", capacity_bytes=free)
    if not result.fits:
        names = f"{target[0]} + {draft[0]}" if draft else target[0]
        verb = "need" if draft else "needs"
        weights = "int8" if quantize else str(dtype).removeprefix("torch.")
        ranks = f" per device over {tp_size} ranks" if tp_size > 1 else ""
        extra = f" + {gb(result.workspace)} runtime reserve" if result.workspace else ""
        rows = f" x {batch} rows" if batch > 1 else ""
        raise UsageError(f"{names} {verb} about {gb(result.total)}{ranks} in {weights} (weights "
                         f"{gb(result.weights)} + KV cache {gb(result.kv_cache)} for {positions} positions{rows}"
                         f"{extra}) "
                         f"but {device} has {gb(free)} free; use a smaller dtype, a smaller pair, or a device "
                         "with more memory (see generate.py --plan)")
    return result


def print_plan(args: argparse.Namespace) -> int:
    """--plan: the per-GPU memory of this pair, from configs only; nothing is loaded.

    Exit status 1 when it does not fit, with the cheapest change that would (model/memory.py
    cheapest_fit): a script can test the status, and a reader sees what to do."""
    configs = {"target": plan_config(args.target)}
    draft = planned_draft(args, configs["target"])
    if draft is not None:
        configs["draft"] = draft
    tp = args.tp or int(os.environ.get("WORLD_SIZE", "1"))
    device_name = args.plan_device or ("auto" if torch.cuda.is_available() else "h200")
    dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16
    result = plan(configs["target"], configs.get("draft"), dtype, tp_size=tp, quantize=args.quantize,
                  device_name=device_name, target_name=args.target, draft_name=args.draft)
    suggestion = None
    if not result.fits:
        change = cheapest_fit(configs["target"], configs.get("draft"), dtype, tp_size=tp, quantize=args.quantize,
                              device_name=device_name)
        suggestion = (f"the cheapest change that fits: {change}" if change else
                      "no single change of --dtype, --quantize, --tp or --plan-device fits it: use a smaller pair")
    if int(os.environ.get("RANK", "0")) == 0:
        if args.json:
            print(json.dumps({**result.to_dict(), "suggestion": suggestion}))
        else:
            print(result.render() + (f"\n  {suggestion}" if suggestion else ""))
    return 0 if result.fits else 1


# ----------------------------------------------------------------------------- prompt
def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool, system: str | None) -> list[int]:
    if chat:
        if system:
            prompt = B_SYS + system.strip() + E_SYS + prompt.strip()
        return tokenizer.encode(f"{B_INST} {prompt.strip()} {E_INST}", bos=True)
    return tokenizer.encode(prompt, bos=True)


def continuation_text(tokenizer: Tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text the new tokens add to the prompt, with the spaces SentencePiece puts between them."""
    before = tokenizer.decode(prompt_ids)
    full = tokenizer.decode(prompt_ids + new_ids)
    return full[len(before):] if full.startswith(before) else tokenizer.decode(new_ids)


class Streamer:
    """Incremental detokenisation: decode the growing id list and print the new suffix.

    Decoding token by token would lose SentencePiece's word-boundary spaces and split
    multi-byte characters; decoding the whole sequence and printing what is new does
    neither. A suffix ending in U+FFFD is an incomplete UTF-8 sequence (byte-fallback
    tokens) and waits for the token that completes it.

    ``prefix`` (the prompt's text) is written together with the first new text, not before
    the run: a run that fails before its first token (an error such as non-finite logits)
    leaves stdout empty.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], out: TextIO, color: bool,
                 prefix: str = "") -> None:
        self.tokenizer, self.out, self.color = tokenizer, out, color
        self.ids = list(prompt_ids)
        self.printed = len(tokenizer.decode(self.ids))
        self.prefix = prefix

    def __call__(self, new_ids: Sequence[int], from_draft: Sequence[bool]) -> None:
        runs: list[tuple[bool, str]] = []  # consecutive pieces of one colour, merged
        for token, drafted in zip(new_ids, from_draft):
            self.ids.append(int(token))
            ready = self.tokenizer.decode(self.ids).rstrip("\ufffd")
            if len(ready) <= self.printed:
                continue
            piece, self.printed = ready[self.printed:], len(ready)
            if runs and runs[-1][0] == drafted:
                runs[-1] = (drafted, runs[-1][1] + piece)
            else:
                runs.append((drafted, piece))
        if runs:
            if self.color:
                text = "".join(f"{GREEN if d else YELLOW}{text}{RESET}" for d, text in runs)
            else:
                text = "".join(text for _, text in runs)
            self.out.write(self.prefix + text)
            self.prefix = ""
            self.out.flush()

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids)  # whatever was held back (a truly broken byte sequence)
        self.out.write(self.prefix + text[self.printed:] + "\n")
        self.prefix = ""
        self.out.flush()


class StepClock:
    """The loop's callback, timed: ``times`` holds when each call came (one per iteration of
    the speculative loop, one per token without a draft), then the call is passed on.

    This is how generate.py sees per-iteration times without asking the loop for them; the
    gaps include the streamer's printing, which is small next to a model step."""

    now = staticmethod(time.perf_counter)  # replaceable, for a test that needs a busy machine's times

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self.times: list[float] = []

    def __call__(self, new_ids: Sequence[int], from_draft: Sequence[bool]) -> None:
        self.times.append(self.now())
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


# ----------------------------------------------------------------------------- stats
@dataclass
class Loaded:
    target: Llama
    draft: Any  # a draft model, a drafter (speculative.drafter), or None for --no-draft
    tokenizer: Tokenizer
    load_s: float
    prepacked: int = 0  # linear layers reordered for oneDNN (model/prepack.py)
    fused: int = 0  # q/k/v and gate/up groups stacked into one product each (model/fuse.py)
    setups: list[str] = field(default_factory=list)  # --setup / --compile: what was timed and chosen, per model
    setup_notes: list[str] = field(default_factory=list)


def stats_dict(stats: Any, speculative: bool) -> dict[str, Any]:
    out = stats.to_dict() if hasattr(stats, "to_dict") else dict(vars(stats))
    if not speculative:  # fields of speculation that mean nothing for the target alone
        out.setdefault("draft_calls", 0)
        for key in ("acceptance_rate", "gamma", "predicted_speedup"):
            out[key] = None
    return out


STOP_REASONS = {"eos": "the model ended the text (end-of-sequence)",
                "max_new_tokens": "--max-new-tokens reached",
                "max_seq_len": "the context is full (max_seq_len)"}


def summary_lines(stats: dict[str, Any], speculative: bool, compare: bool = False) -> list[str]:
    """The run's numbers next to the paper's cost model (docs/cost_model.md)."""
    tps = stats.get("tokens_per_second")
    rate = f"{tps:.1f} tokens/s" if tps else "? tokens/s"
    reason = stats.get("stop_reason")
    lines = [f"{stats.get('new_tokens')} new tokens at {rate} (decoding: the prompt's pass and loading "
             f"excluded); {stats.get('target_calls')} target calls"
             + (f", {stats.get('draft_calls')} draft calls" if speculative else " (one per token)")
             + f"; stopped: {reason} ({STOP_REASONS.get(reason, 'unknown')})"]
    alpha, gamma, c = stats.get("acceptance_rate"), stats.get("gamma"), stats.get("cost_ratio")
    if speculative and alpha is not None and gamma is not None:
        measured, predicted = stats.get("tokens_per_target_call"), stats.get("predicted_tokens_per_target_call")
        drafted = stats.get("gamma_history") or []
        mean = sum(drafted) / len(drafted) if drafted else None
        # gamma is what was asked for (or auto's mean); near the end of the output or of the
        # context fewer are drafted, and the prediction uses what each iteration drafted.
        used = f" (drafted {mean:.2f} per iteration)" if mean is not None and abs(mean - gamma) > 1e-9 else ""
        line = (f"cost model: alpha={alpha:.3f} gamma={gamma:g}{used} c={_num(c, '.3f')}: tau (tokens per target "
                f"call) {_num(measured, '.2f')} measured vs {_num(predicted, '.2f')} predicted by "
                f"(1-alpha^(g+1))/(1-alpha) over the g drafted in each iteration; predicted speedup "
                f"(1-alpha^(g+1))/((1-alpha)(g*c+1)) = {_num(stats.get('predicted_speedup'), '.2f')}x"
                + ("" if compare else " (--compare measures it)"))
        lines.append(line)
    return lines


def compare_line(compare: dict[str, Any]) -> str:
    """--compare's result: the measured speedup next to the predicted one."""
    same, first = compare.get("same_tokens"), compare.get("first_difference")
    # Greedy outputs may part only at a near-tie of the target's top two logits (rounding:
    # docs/algorithm.md, numerics policy); sampled runs draw differently and are not compared.
    tokens = "" if same is None else ("; the same greedy tokens" if same else
                                      f"; the greedy tokens part at token {first} (see the numerics policy in "
                                      "docs/algorithm.md)")
    return (f"compare: speculative {_num(compare['speculative_tokens_per_second'], '.1f')} tokens/s, target alone "
            f"{_num(compare['baseline_tokens_per_second'], '.1f')} tokens/s: measured speedup "
            f"{_num(compare['measured_speedup'], '.2f')}x, predicted {_num(compare['predicted_speedup'], '.2f')}x by "
            f"the cost model{tokens}")


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


# ----------------------------------------------------------------------------- main
def planned_draft(args: argparse.Namespace, target: ModelConfig) -> ModelConfig | None:
    """The draft's shape for the memory plan: none for --no-draft and lookup, a 1-layer model
    of the target's shape for a feature head (its embedding and output head are the
    target's, so this overestimates a little), the draft model's config otherwise."""
    kind = draft_kind(args, plan=True)
    if kind == "head":
        return replace(target, n_layers=1)
    return plan_config(args.draft) if kind == "model" else None


def draft_kind(args: argparse.Namespace, plan: bool = False) -> str | None:
    """What --draft names: None (--no-draft), "lookup", "head" (a feature head's folder) or "model"."""
    if args.no_draft:
        return None
    if args.draft == LOOKUP:
        return "lookup"
    if plan and args.draft not in SHIPPED and not Path(args.draft).expanduser().is_dir():
        return "model"  # --plan knows the published shapes of checkpoints that are not downloaded
    return "head" if is_feature_head(resolve(args.draft)) else "model"


def load(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, world_size: int = 1,
         prompts: list[str] | None = None) -> tuple[Loaded, list[list[int]]]:
    """Resolve, check and load the target and the drafter; everything that can be refused is
    refused before loading. Returns them and the encoded prompts: ``prompts`` (the lines of
    --prompts-file, decoded as a batch), or else [--prompt]."""
    kind = draft_kind(args)
    names = {"target": args.target} if kind != "model" else {"target": args.target, "draft": args.draft}
    dirs = {role: resolve(name) for role, name in names.items()}
    configs = {role: read_config(path) for role, path in dirs.items()}
    tokenizers = {role: load_tokenizer(path) for role, path in dirs.items()}
    if kind == "model":
        # check_pair reads only .config and the tokenizers, so it runs before gigabytes are read.
        try:
            check_pair(SimpleNamespace(config=configs["target"]), SimpleNamespace(config=configs["draft"]),
                       tokenizers["target"], tokenizers["draft"])
        except PairMismatchError as err:
            hint = ""
            if args.draft == DEFAULT_DRAFT and args.target != DEFAULT_TARGET:
                hint = f" (--draft defaults to {DEFAULT_DRAFT}; name a draft of the target's family, or --no-draft)"
            raise PairMismatchError(f"draft {args.draft} cannot speculate for target {args.target}: {err}{hint}") \
                from None
    if args.setup != "default" and world_size > 1:
        raise UsageError(f"{setup_flag(args)} is for one process: tensor-parallel shards keep the default set-up (a "
                         f"compiled shard's all-reduces would run outside the graph); drop {setup_flag(args)} under "
                         "torchrun")
    if kind == "head" and world_size > 1:
        raise UsageError(f"--draft {args.draft} is a feature head, which reads the target's whole output head: not "
                         "supported under tensor parallelism; use a draft model or --draft lookup")
    if args.tree is not None and kind == "lookup":
        raise UsageError("--tree needs a drafter that can build trees (a draft model or a feature head); prompt "
                         "lookup proposes one chain")
    tokenizer = tokenizers["target"]
    encoded = [encode_prompt(tokenizer, text, args.chat, args.system) for text in prompts or [args.prompt]]
    context = min(c.max_seq_len for c in configs.values())
    for line, prompt_ids in enumerate(encoded, 1):
        if len(prompt_ids) >= context:
            where = f"--prompts-file line {line}: the prompt" if prompts else "the prompt"
            raise UsageError(f"{where} is {len(prompt_ids)} tokens, which leaves no room in the {context}-token "
                             f"context of {' and '.join(names.values())}")
    ahead = len(branching_parents(args.tree)) if args.tree else GAMMA_MAX if args.gamma == "auto" else args.gamma
    if args.tree and ahead + 1 >= context:
        raise UsageError(f"--tree {','.join(map(str, args.tree))} has {ahead} nodes, which cannot fit in the "
                         f"{context}-token context (the target scores them all in one call)")
    slack = 0 if kind is None else ahead + 1  # as the loop allocates
    positions = min(context, max(map(len, encoded)) + args.max_new_tokens + slack)
    rows = min(args.batch_size or len(encoded), len(encoded)) if prompts else 1  # the KV caches' rows
    sharded = world_size > 1 or args.quantize is not None
    # A feature head is counted as a 1-layer model of the target's shape (see planned_draft).
    planned = configs.get("draft") or (replace(configs["target"], n_layers=1) if kind == "head" else None)
    check_memory((args.target, configs["target"]), None if planned is None else (args.draft, planned), positions,
                 dtype, device, tp_size=world_size, quantize=args.quantize, batch=rows)

    t0 = time.perf_counter()
    if sharded:  # this rank's slices of the target; the draft whole on every rank; int8 if asked
        target = load_model_tp(dirs["target"], device, dtype, quantize=args.quantize)
        draft = load_model_tp(dirs["draft"], device, dtype, quantize=args.quantize, shard=False) \
            if kind == "model" else None
    else:
        target = load_model(dirs["target"], device=device, dtype=dtype)
        draft = load_model(dirs["draft"], device=device, dtype=dtype) if kind == "model" else None
    drafter = None
    if kind == "model":
        drafter = draft
    elif kind is not None:  # the head is checked against the target it was trained for
        drafter = load_drafter(args.draft, target, args.target)
    # Prepacking is a no-op off the CPU, off float32, and on int8 layers.
    networks = [target, draft, getattr(drafter, "head", None)]
    choosing = [target, draft] if args.setup != "default" else []  # models --setup chooses for (not a head)
    counts = [prepare_for_decoding(net, stack=not args.no_fuse, prepack=not args.no_prepack)
              for net in networks if net is not None and net not in choosing]
    fused, prepacked = (sum(column) for column in zip(*counts)) if counts else (0, 0)
    loaded = Loaded(target, drafter, tokenizer, time.perf_counter() - t0, prepacked, fused)
    if choosing:
        choose_setups(args, loaded, kind, min(context, positions + 1), rows)
    return loaded, encoded


def row_buckets(batch: int) -> tuple[int, ...]:
    """The batch sizes to compile for a batch of ``batch`` rows: 1, 2, 4, ... and ``batch`` (a
    batch shrinks as rows finish; a call of B rows runs padded in the next size up)."""
    sizes = {batch}
    size = 1
    while size < batch:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


def choose_setups(args: argparse.Namespace, loaded: Loaded, kind: str | None, cache_len: int,
                  rows_in_batch: int) -> None:
    """--setup / --compile: each model's set-up measured (or forced) for the call widths,
    batch sizes and tree shapes this run uses (model/setup.py), with a note when compiling
    does not pay for itself."""
    candidates = {"measure": ("plain", "stacked", "prepacked"), "measure-all": SETUPS}.get(args.setup, (args.setup,))
    gamma = args.gamma if kind is not None else 1
    reads_features = kind == "head"
    rows = row_buckets(rows_in_batch)
    tree = args.tree if kind is not None else None
    # a drafter's tree calls: the nodes so far at each depth below the first
    levels = [len(branching_parents(tree[:depth])) for depth in range(1, len(tree))] if tree else []
    choices = []
    try:
        target, choice = choose_setup(loaded.target, candidates, decode_widths(gamma, GAMMA_MAX) if kind else (1,),
                                      cache_len, hidden=reads_features, rows=rows,
                                      tree_widths=(len(branching_parents(tree)) + 1,) if tree else ())
    except ValueError as err:
        raise UsageError(f"--setup {args.setup}: {err}") from None
    if getattr(loaded.draft, "target", None) is loaded.target:  # a feature head reads the target it runs with
        loaded.draft.target = target
    loaded.target = target
    choices.append(("target", choice))
    if kind == "head" and choice.chosen == "compiled":  # the head follows its target (it is not timed)
        seconds = compile_for_decoding(loaded.draft.head, decode_widths(gamma, GAMMA_MAX), rows, cache_len,
                                       tree_widths=levels).compile_s
        choices.append(("head", SetupChoice("compiled", compile_s=seconds, why="as its target")))
    if kind == "model":
        loaded.draft, choice = choose_setup(loaded.draft, candidates, (1, 2), cache_len, rows=rows,
                                            tree_widths=levels)
        choices.append(("draft", choice))
    loaded.setups = [c.line(name) for name, c in choices]
    spent = sum(c.compile_s for _, c in choices)
    # At most one call of each model per new token, each saving the mean difference of a step
    # against the best eager set-up timed.
    saved = sum(c.compile_saving_s() for _, c in choices) * args.max_new_tokens
    if spent > 0 and saved < spent:
        loaded.setup_notes.append(f"compiling took {spent:.1f}s and saves at most {saved:.1f}s over "
                                  f"{args.max_new_tokens} tokens: this run does not pay for its compile time "
                                  "(a longer run, or a process that serves many, would)")


def run(args: argparse.Namespace) -> int:
    validate(args)
    given = getattr(args, "given", None)
    if given is None:  # called without main(): count the options that differ from their defaults
        defaults = vars(build_parser().parse_args([]))
        given = {dest for dest, value in vars(args).items() if dest in defaults and value != defaults[dest]}
    if args.prompts_file is not None and "prompt" in given:
        raise UsageError("give --prompt or --prompts-file, not both")
    is_main = int(os.environ.get("RANK", "0")) == 0  # only rank 0 prints; the others compute silently
    notes = unused_flags(args, given)
    if args.chat and not args.plan:
        notes += [w for w in [chat_warning(args.target)] if w]
    if is_main:
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
    if args.temperature == 0:  # the warned-about flags are dropped, so that settings show what ran
        args.top_k = args.top_p = args.seed = None
    if args.plan:
        return print_plan(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    texts = None  # the prompts of --prompts-file, decoded as one batch
    if args.prompts_file is not None:
        if world_size > 1:
            raise UsageError("--prompts-file is not supported under torchrun: batches do not run tensor-parallel; "
                             "run it in one process, or give one --prompt")
        texts = read_prompts(args.prompts_file)
    else:
        args.prompt = read_prompt(args.prompt, world_size)
    if world_size > 1:  # under torchrun: one process per GPU (cuda:LOCAL_RANK), NCCL; gloo on the CPU
        if pick_device(args.device).type == "cuda" and args.device is not None and ":" in args.device:
            raise UsageError("under torchrun each rank uses GPU LOCAL_RANK: pass --device cuda, not a numbered one")
        info = init_distributed(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        device, is_main = info.device, info.is_main
    else:
        device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    if "no_prepack" in given and is_main and (device.type != "cpu" or dtype != torch.float32):
        print(f"warning: --no-prepack has no effect on {device} in {str(dtype).removeprefix('torch.')}: weights are "
              "prepacked only on the CPU in float32", file=sys.stderr)
    loaded, encoded = load(args, device, dtype, world_size, texts)
    # Every rank must draw the same random numbers: one seed, rank 0's. A sampled run without
    # --seed gets a fresh one too, chosen here so that the header can show it for repeating the run.
    seed = broadcast_seed(args.seed, device) if args.temperature > 0 else None  # greedy draws no random number
    if texts is not None:
        return run_batch(args, loaded, texts, encoded, device, dtype, seed)
    prompt_ids = encoded[0]
    tokenizer = loaded.tokenizer
    speculative = loaded.draft is not None
    compare = args.compare and speculative
    color = not args.json and not args.no_color and sys.stdout.isatty() and not os.environ.get("NO_COLOR")

    streamer = None
    if not args.json and is_main:
        print(header_line(args, loaded, device, dtype, world_size, seed), file=sys.stderr)
        for line in loaded.setups:
            print(f"setup: {line}", file=sys.stderr)
        for note in loaded.setup_notes:
            print(f"note: {note}", file=sys.stderr)
        if color and speculative:
            print(f"colours: {GREEN}draft tokens accepted by the target{RESET}, "
                  f"{YELLOW}tokens produced by the target{RESET} (after a rejection, or the bonus token)",
                  file=sys.stderr)
        prefix = "" if args.chat else tokenizer.decode(prompt_ids)
        streamer = Streamer(tokenizer, prompt_ids, sys.stdout, color, prefix=prefix)

    step_clock = StepClock(streamer)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_id=tokenizer.eos_id,
                    seed=seed)
    # NonFiniteLogitsError (a ValueError) from either loop ends the run in main(): one error line, no tokens.
    with torch.inference_mode():
        if speculative:
            result = speculative_generate(loaded.target, loaded.draft, prompt_ids, args.max_new_tokens,
                                          gamma=len(args.tree) if args.tree else args.gamma, callback=step_clock,
                                          verify=args.verify, tree=args.tree, tree_mode=args.tree_mode, **sampling)
        else:
            result = autoregressive_generate(loaded.target, prompt_ids, args.max_new_tokens, callback=step_clock,
                                             **sampling)
    tokens = [int(t) for t in result.tokens]
    stats = stats_dict(result.stats, speculative)
    if streamer is not None:
        streamer.finish()
        for line in summary_lines(stats, speculative, compare=compare):
            print(line, file=sys.stderr)
    sizes = list(getattr(result.stats, "gamma_history", [])) or [0] * len(step_clock.times)
    hint = busy_hint(step_clock.times, sizes, torch.get_num_threads(), device)
    comparison = None
    if compare:  # the same prompt and settings, the target alone: every rank runs it, as it ran the first
        if streamer is not None:
            print("compare: now the target alone, on the same prompt with the same settings ...", file=sys.stderr)
        with torch.inference_mode():
            # A callback, as in the first run, so that both loops copy each token to the host alike.
            baseline = autoregressive_generate(loaded.target, prompt_ids, args.max_new_tokens,
                                               callback=StepClock(), **sampling)
        comparison = compare_stats(stats, baseline, tokens, args.temperature)
    if not is_main:
        return 0

    if args.json:
        settings = run_settings(args, loaded, device, dtype, world_size, seed, compare)
        doc = {"text": continuation_text(tokenizer, prompt_ids, tokens), "tokens": tokens,
               "prompt_tokens": len(prompt_ids), "settings": settings, "stats": stats}
        if comparison is not None:
            doc["compare"] = comparison
        doc["notes"] = JSON_NOTES
        print(json.dumps(_jsonable(doc), allow_nan=False))
    elif comparison is not None:
        print(compare_line(comparison), file=sys.stderr)
    if hint:
        print(hint, file=sys.stderr)
    return 0


def header_line(args: argparse.Namespace, loaded: Loaded, device: torch.device, dtype: torch.dtype,
                world_size: int, seed: int | None) -> str:
    """The run's first line on stderr: the pair, where it runs, and the whole decoding setup."""
    speculative = loaded.draft is not None
    dtype_name = str(dtype).removeprefix("torch.") + (" with int8 weights" if args.quantize else "")
    tuning = [f"{loaded.fused} projection groups stacked"] if loaded.fused else []
    tuning += [f"{loaded.prepacked} layers oneDNN-prepacked"] if loaded.prepacked else []
    if tuning:
        dtype_name += f" ({', '.join(tuning)})"
    if world_size > 1:
        dtype_name += f", tensor-parallel over {world_size} ranks"
    pair = f"draft {args.draft} -> target {args.target}" if speculative else f"target {args.target} alone"
    return (f"{pair} on {device} in {dtype_name} (loaded in {loaded.load_s:.1f}s), "
            f"{sampling_setup(args, seed, speculative)}")


def run_settings(args: argparse.Namespace, loaded: Loaded, device: torch.device, dtype: torch.dtype,
                 world_size: int, seed: int | None, compare: bool) -> dict[str, Any]:
    """--json's ``settings``: what the run used (top_k, top_p and seed are None when greedy)."""
    speculative = loaded.draft is not None
    return {"target": args.target, "draft": None if args.no_draft else args.draft, "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "gamma": args.gamma if speculative else None,
            "verify": args.verify if speculative else None, "tree": args.tree if speculative else None,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens, "seed": seed, "chat": args.chat,
            "quantize": args.quantize, "tensor_parallel": world_size,
            "prepacked_layers": loaded.prepacked, "fused_groups": loaded.fused, "setup": loaded.setups or args.setup,
            "threads": torch.get_num_threads(), "compare": compare}


def sampling_setup(args: argparse.Namespace, seed: int | None, speculative: bool) -> str:
    """The header's decoding settings, all of them: what was given and what was defaulted."""
    if args.temperature == 0:
        text = "greedy (temperature 0)"
    else:
        notes = [] if args.seed is not None else ["fresh; --seed repeats it"]
        notes += ["prompt i uses seed + i"] if getattr(args, "prompts_file", None) is not None else []
        text = (f"temperature {args.temperature:g}, top-k {args.top_k or 'off'}, top-p {args.top_p or 'off'}, "
                f"seed {seed}" + (f" ({'; '.join(notes)})" if notes else ""))
    if not speculative:
        return text
    if args.tree:
        shape = ",".join(map(str, args.tree))
        return text + f", tree {shape} ({len(branching_parents(args.tree))} nodes, children {args.tree_mode})"
    return text + f", gamma {args.gamma}, {args.verify}-wise verification"


# ----------------------------------------------------------------------------- --prompts-file: a batch
def run_batch(args: argparse.Namespace, loaded: Loaded, texts: list[str], encoded: list[list[int]],
              device: torch.device, dtype: torch.dtype, seed: int | None) -> int:
    """--prompts-file: every prompt in one batched run (speculative/batch.py), at most
    --batch-size rows per target call, prompt i sampling with seed + i. Nothing streams: the
    completions are printed after the run, in prompt order, then the batch's summary; with
    --compare the same batch runs again with the target alone."""
    speculative = loaded.draft is not None
    compare = args.compare and speculative
    tokenizer = loaded.tokenizer
    rows = min(args.batch_size or len(encoded), len(encoded))
    if not args.json:
        print(header_line(args, loaded, device, dtype, 1, seed), file=sys.stderr)
        where = "standard input" if args.prompts_file == "-" else args.prompts_file
        print(f"{len(encoded)} prompts from {where}, decoded as a batch of at most {rows} rows per target call",
              file=sys.stderr)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_id=tokenizer.eos_id,
                    seed=seed, batch_size=rows)
    # NonFiniteLogitsError (a ValueError) ends the run in main(): one error line, nothing on stdout.
    if speculative:
        result = speculative_generate_batch(loaded.target, loaded.draft, encoded, args.max_new_tokens,
                                            gamma=args.gamma, verify=args.verify, **sampling)
    else:
        result = autoregressive_generate_batch(loaded.target, encoded, args.max_new_tokens, **sampling)
    docs = []
    for i, (text, prompt_ids, row) in enumerate(zip(texts, encoded, result.results)):
        tokens = [int(t) for t in row.tokens]
        docs.append({"prompt_index": i, "line": i + 1, "prompt": text, "seed": None if seed is None else seed + i,
                     "text": continuation_text(tokenizer, prompt_ids, tokens), "tokens": tokens,
                     "prompt_tokens": len(prompt_ids), "stats": stats_dict(row.stats, speculative)})
    if not args.json:
        for doc, prompt_ids in zip(docs, encoded):
            seed_note = "" if doc["seed"] is None else f", seed {doc['seed']}"
            prefix = "" if args.chat else tokenizer.decode(prompt_ids)  # as the single run prints it
            print(f"--- prompt {doc['prompt_index']} (line {doc['line']}{seed_note}) ---\n{prefix}{doc['text']}")
        sys.stdout.flush()
        for line in batch_summary_lines(result, speculative):
            print(line, file=sys.stderr)
    comparison = None
    if compare:
        if not args.json:
            print("compare: now the target alone, on the same prompts in batches of the same size ...",
                  file=sys.stderr)
        baseline = autoregressive_generate_batch(loaded.target, encoded, args.max_new_tokens, **sampling)
        comparison = compare_batch(result, baseline, args.temperature)
    if args.json:
        settings = {**run_settings(args, loaded, device, dtype, 1, seed, compare),
                    "prompts_file": args.prompts_file, "batch_size": rows}
        out = {"prompts": docs, "batch": result.stats.to_dict(), "settings": settings}
        if comparison is not None:
            out["compare"] = comparison
        out["notes"] = {**JSON_NOTES, **BATCH_NOTES}
        print(json.dumps(_jsonable(out), allow_nan=False))
    elif comparison is not None:
        print(batch_compare_line(comparison), file=sys.stderr)
    return 0


def batch_summary_lines(result: BatchResult, speculative: bool) -> list[str]:
    """The batch's totals: its rows, speed, calls and acceptance (no cost model: it is for one sequence)."""
    stats = result.stats
    reasons = Counter(row.stats.stop_reason for row in result.results)
    stopped = ", ".join(f"{count} {reason}" for reason, count in reasons.most_common())
    lines = [f"batch: {stats.prompts} prompts, batch size {stats.batch_size} (mean {_num(stats.mean_batch, '.2f')} "
             f"rows per target call), {stats.new_tokens} new tokens at {_num(stats.tokens_per_second, '.1f')} "
             f"tokens/s over all rows (the prompts' passes included); {stats.iterations} target calls"
             + (f", {stats.draft_calls} draft calls" if speculative else " (one token per row each)")
             + f", {stats.decode_time_s:.2f}s decoding; stopped: {stopped}"]
    if speculative:
        lines.append(f"alpha={_num(stats.acceptance_rate, '.3f')}, tau {_num(stats.tokens_per_row_iteration, '.2f')} "
                     f"tokens per row per target call ({stats.row_iterations} row-iterations); "
                     f"{stats.accepted_draft_tokens} of {stats.drafted_tokens} drafted tokens accepted")
    return lines


def compare_batch(result: BatchResult, baseline: BatchResult, temperature: float) -> dict[str, Any]:
    """--compare with --prompts-file: the batch's total tokens/s with the draft and without, and their ratio."""
    fast, slow = result.stats.tokens_per_second, baseline.stats.tokens_per_second
    base_tokens = [[int(t) for t in row.tokens] for row in baseline.results]
    differ = None if temperature > 0 else [i for i, (row, base) in enumerate(zip(result.results, base_tokens))
                                           if [int(t) for t in row.tokens] != base]
    return {"speculative_tokens_per_second": fast, "baseline_tokens_per_second": slow,
            "measured_speedup": fast / slow if fast and slow else None,
            "same_tokens": None if differ is None else not differ, "differing_prompts": differ,
            "baseline": baseline.stats.to_dict(), "baseline_tokens": base_tokens}


def batch_compare_line(compare: dict[str, Any]) -> str:
    differ = compare["differing_prompts"]
    tokens = "" if differ is None else ("; the same greedy tokens for every prompt" if not differ else
                                        f"; the greedy tokens differ for prompt(s) {', '.join(map(str, differ))} "
                                        "(see the numerics policy in docs/algorithm.md)")
    return (f"compare: speculative {_num(compare['speculative_tokens_per_second'], '.1f')} tokens/s, target alone "
            f"{_num(compare['baseline_tokens_per_second'], '.1f')} tokens/s (both batched alike, all rows): measured "
            f"speedup {_num(compare['measured_speedup'], '.2f')}x{tokens}")


def compare_stats(stats: dict[str, Any], baseline: Any, tokens: list[int], temperature: float) -> dict[str, Any]:
    """--compare: both decode speeds, their ratio (the measured speedup) and the predicted one."""
    fast, slow = stats.get("tokens_per_second"), baseline.stats.tokens_per_second
    base_tokens = [int(t) for t in baseline.tokens]
    same = None if temperature > 0 else base_tokens == tokens  # sampled runs draw differently, by design
    first = None if same is None or same else next(
        (i for i, (a, b) in enumerate(zip(tokens, base_tokens)) if a != b), min(len(tokens), len(base_tokens)))
    return {"speculative_tokens_per_second": fast, "baseline_tokens_per_second": slow,
            "measured_speedup": fast / slow if fast and slow else None,
            "predicted_speedup": stats.get("predicted_speedup"), "same_tokens": same, "first_difference": first,
            "baseline": stats_dict(baseline.stats, False), "baseline_tokens": base_tokens}


# What the two acceptance numbers mean, in the JSON itself (docs/cli.md has every field).
JSON_NOTES = {
    "acceptance_rate": "the paper's alpha: the probability that the target accepts a drafted token, the mean of "
                       "sum_x min(p(x), q(x)) over the draft positions it verified; the alpha of the cost model",
    "empirical_acceptance": "accepted_draft_tokens / drafted_tokens in this run: lower than alpha, because the "
                            "tokens drafted after a rejection are counted but never verified",
    "tokens_per_second": "decode speed: new tokens over the loop's time after its first iteration (the prompt's)",
    "stop_reason": "eos: the model ended the text; max_new_tokens: --max-new-tokens reached; max_seq_len: the "
                   "context is full",
}


# And for --prompts-file.
BATCH_NOTES = {
    "batch": "the batch's totals (speculative/batch.py BatchStats): an iteration is one target call for all rows; "
             "tokens_per_second is all rows' new tokens over the whole loop (the prompts' passes included); "
             "tokens_per_row_iteration is tau, the tokens a row gained per target call it was in",
    "prompts": "one entry per line of --prompts-file, in order; prompt_index i (from 0, line i + 1) sampled with "
               "seed + i; each stats is that row's own, its times those of the batched calls it shared",
}


def _jsonable(value: Any) -> Any:
    """Plain JSON: tensors as lists, NaN and infinities as null, anything unknown as a string."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def main(argv: list[str] | None = None) -> int:
    # Under torchrun every rank meets the same bad input: rank 0 alone reports it. Damaged
    # weights are the exception: each rank reads only its own slice, so whichever rank finds
    # them says so.
    rank = int(os.environ.get("RANK", "0"))
    try:
        args = build_parser().parse_args(argv)
        args.given = given_flags(argv)
        return run(args)
    except NonFiniteWeightsError as err:
        print(f"error: {'' if rank == 0 else f'rank {rank}: '}{err}".splitlines()[0], file=sys.stderr)
        return 2
    except (UsageError, UnknownCheckpointError, CheckpointError, ConfigError, PairMismatchError, ValueError) as err:
        if rank == 0:
            print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError:
        print("error: out of GPU memory; try a smaller pair, a smaller dtype or fewer --max-new-tokens",
              file=sys.stderr)
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
