"""Generate text with speculative decoding: a small draft model proposes, the target verifies.

    python generate.py                                   # the shipped tiny pair, on the CPU
    python generate.py --draft 7b --target 70b --prompt "The capital of France is"
    python generate.py --draft 7b-chat --target 70b-chat --chat --prompt "Write a haiku about the sea"
    python generate.py --no-draft                        # the target alone: the baseline
    python generate.py --json                            # one JSON object on stdout

The continuation streams to stdout as the target accepts it. On a terminal, draft tokens
the target accepted are green and tokens the target produced itself (the fix-up after a
rejection, and the bonus token after a fully accepted block) are yellow. Statistics and
the comparison with the paper's cost model go to stderr, so ``> out.txt`` keeps only text.

Bad input (an unknown checkpoint, a mismatched pair, impossible settings, a pair that does
not fit in memory) ends with exit status 2 and one ``error: ...`` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

import torch
import torch.distributed as dist

from model import ConfigError, Llama, ModelConfig
from model.fuse import prepare_for_decoding
from model.memory import DEFAULT_RESERVE, DEVICES, MemoryPlan, plan
from model.tensor_parallel import broadcast_seed, init_distributed
from speculative import PairMismatchError, autoregressive_generate, check_pair, speculative_generate
from speculative.gamma import GAMMA_MAX
from weights import CheckpointError, Tokenizer, UnknownCheckpointError, load_model, load_tokenizer, read_config, resolve
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


def gamma_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}") from None


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair = parser.add_argument_group("models")
    pair.add_argument("--target", default=DEFAULT_TARGET,
                      help="target model: 7b, 13b, 70b, 7b-chat, 13b-chat, 70b-chat, tiny-target, or a path to an "
                           f"HF-layout folder (default {DEFAULT_TARGET})")
    pair.add_argument("--draft", default=DEFAULT_DRAFT,
                      help="draft model, same choices; it must share the target's tokenizer "
                           f"(default {DEFAULT_DRAFT}; tiny-draft-undistilled is the same draft before distillation)")
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
                      help="print the memory each GPU needs for this pair (weights, KV caches) and exit; reads "
                           "config.json only, or the published Llama-2 shapes when the weights are not downloaded")
    pair.add_argument("--plan-device", default=None,
                      help=f"the GPU --plan plans for: {', '.join(DEVICES)}, or auto, the visible GPU (default: "
                           "auto when a GPU is visible, else h200)")
    pair.add_argument("--tp", type=int, default=None,
                      help="the tensor-parallel size --plan plans for (default: WORLD_SIZE under torchrun, else 1). "
                           "To run tensor-parallel, launch with: torchrun --nproc-per-node N generate.py ...")
    pair.add_argument("--no-prepack", action="store_true",
                      help="on cpu in float32, keep PyTorch's default matmul instead of weights reordered once for "
                           "oneDNN, which make verifying several tokens cost about one step (model/prepack.py)")
    pair.add_argument("--no-fuse", action="store_true",
                      help="keep q/k/v and gate/up as separate products instead of stacking each group into one "
                           "(model/fuse.py: fewer operators per decode step)")
    pair.add_argument("--threads", type=int, default=None,
                      help="torch CPU threads (default: torch's choice, normally all cores)")

    text = parser.add_argument_group("prompt")
    text.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"the text to continue (default {DEFAULT_PROMPT!r})")
    text.add_argument("--chat", action="store_true",
                      help="wrap the prompt in the Llama-2 chat template '<s>[INST] <<SYS>>..<</SYS>> prompt [/INST]' "
                           "(for the -chat checkpoints)")
    text.add_argument("--system", default=None, help="system prompt for --chat (default: none)")

    sampling = parser.add_argument_group("decoding")
    sampling.add_argument("--gamma", type=gamma_arg, default=DEFAULT_GAMMA,
                          help=f"draft tokens proposed per target call, an integer >= 1, or 'auto' to choose it "
                               f"before every iteration from the measured acceptance rate and cost ratio (default "
                               f"{DEFAULT_GAMMA}: on the shipped pair 4 to 6 are about equally fast, auto a little "
                               "slower)")
    sampling.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                          help="0 is greedy decoding: deterministic, and the output equals the target's own greedy "
                               "output; 1 samples from the target's distribution, as in the paper. Default 0: on "
                               "the shipped pair greedy has the higher acceptance rate and so shows the speedup best "
                               "(docs/benchmarks.md)")
    sampling.add_argument("--top-k", type=int, default=None, help="sample only among the k most likely tokens")
    sampling.add_argument("--top-p", type=float, default=None,
                          help="nucleus sampling: the smallest set of tokens whose probability reaches p, 0 < p <= 1")
    sampling.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                          help=f"stop after this many new tokens, at end-of-sequence, or when the context is full "
                               f"(default {DEFAULT_MAX_NEW_TOKENS})")
    sampling.add_argument("--seed", type=int, default=None,
                          help="seed for sampling (default: a fresh one each run; greedy needs none)")

    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true",
                        help="print one JSON object {text, tokens, prompt_tokens, settings, stats} on stdout and "
                             "nothing else. stats.tokens_per_second is the decode speed: new tokens / time of the "
                             "generation loop after its first iteration, which also reads the prompt. "
                             "Without a draft, acceptance_rate, gamma and predicted_speedup are null and "
                             "draft_calls is 0")
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
    if (args.tp is not None or args.plan_device is not None) and not args.plan:
        raise UsageError("--tp and --plan-device are only used with --plan; to run on N GPUs, launch with "
                         "torchrun --nproc-per-node N generate.py ...")
    if args.tp is not None and args.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {args.tp}")
    if args.system is not None and not args.chat:
        raise UsageError("--system is only used with --chat")


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
                 quantize: str | None = None) -> MemoryPlan | None:
    """Refuse, before loading anything, a pair that will not fit in the memory free right now.

    The plan (model/memory.py) counts parameters x dtype bytes for the weights (this rank's
    share under tensor parallelism, int8 blocks with --quantize) and
    2 x layers x kv_heads x head_dim x positions x dtype bytes for each KV cache, plus,
    on a GPU, a reserve for the CUDA context and workspaces.
    """
    free = available_bytes(device)
    if free is None:
        return None
    if device.type == "cpu" and tp_size > 1:  # the ranks on this host share its memory
        free //= int(os.environ.get("LOCAL_WORLD_SIZE", str(tp_size)))
    reserve = DEFAULT_RESERVE if device.type == "cuda" else 0
    result = plan(target[1], draft[1] if draft else None, dtype, tp_size=tp_size, context=positions,
                  quantize=quantize, device_name=f"{device} (free)", reserve=reserve, target_name=target[0],
                  draft_name=draft[0] if draft else "draft", capacity_bytes=free)
    if not result.fits:
        names = f"{target[0]} + {draft[0]}" if draft else target[0]
        verb = "need" if draft else "needs"
        weights = "int8" if quantize else str(dtype).removeprefix("torch.")
        ranks = f" per device over {tp_size} ranks" if tp_size > 1 else ""
        extra = f" + {gb(result.workspace)} runtime reserve" if result.workspace else ""
        raise UsageError(f"{names} {verb} about {gb(result.total)}{ranks} in {weights} (weights "
                         f"{gb(result.weights)} + KV cache {gb(result.kv_cache)} for {positions} positions{extra}) "
                         f"but {device} has {gb(free)} free; use a smaller dtype, a smaller pair, or a device "
                         "with more memory (see generate.py --plan)")
    return result


def print_plan(args: argparse.Namespace) -> int:
    """--plan: the per-GPU memory of this pair, from configs only; nothing is loaded."""
    names = {"target": args.target} if args.no_draft else {"target": args.target, "draft": args.draft}
    configs = {role: plan_config(name) for role, name in names.items()}
    tp = args.tp or int(os.environ.get("WORLD_SIZE", "1"))
    device_name = args.plan_device or ("auto" if torch.cuda.is_available() else "h200")
    dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16
    result = plan(configs["target"], configs.get("draft"), dtype, tp_size=tp, quantize=args.quantize,
                  device_name=device_name, target_name=args.target, draft_name=args.draft)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result.to_dict()) if args.json else result.render())
    return 0


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
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], out: TextIO, color: bool) -> None:
        self.tokenizer, self.out, self.color = tokenizer, out, color
        self.ids = list(prompt_ids)
        self.printed = len(tokenizer.decode(self.ids))

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
                self.out.write("".join(f"{GREEN if d else YELLOW}{text}{RESET}" for d, text in runs))
            else:
                self.out.write("".join(text for _, text in runs))
            self.out.flush()

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids)  # whatever was held back (a truly broken byte sequence)
        if len(text) > self.printed:
            self.out.write(text[self.printed:])
        self.out.write("\n")
        self.out.flush()


# ----------------------------------------------------------------------------- stats
@dataclass
class Loaded:
    target: Llama
    draft: Llama | None
    tokenizer: Tokenizer
    load_s: float
    prepacked: int = 0  # linear layers reordered for oneDNN (model/prepack.py)
    fused: int = 0  # q/k/v and gate/up groups stacked into one product each (model/fuse.py)


def stats_dict(stats: Any, speculative: bool) -> dict[str, Any]:
    out = stats.to_dict() if hasattr(stats, "to_dict") else dict(vars(stats))
    if not speculative:  # fields of speculation that mean nothing for the target alone
        out.setdefault("draft_calls", 0)
        for key in ("acceptance_rate", "gamma", "predicted_speedup"):
            out[key] = None
    return out


def summary_lines(stats: dict[str, Any], speculative: bool) -> list[str]:
    """The run's numbers next to the paper's cost model (docs/cost_model.md)."""
    tps = stats.get("tokens_per_second")
    rate = f"{tps:.1f} tokens/s" if tps else "? tokens/s"
    lines = [f"{stats.get('new_tokens')} new tokens at {rate} (decoding: the prompt's pass and loading "
             f"excluded); {stats.get('target_calls')} target calls"
             + (f", {stats.get('draft_calls')} draft calls" if speculative else " (one per token)")]
    alpha, gamma, c = stats.get("acceptance_rate"), stats.get("gamma"), stats.get("cost_ratio")
    if speculative and alpha is not None and gamma is not None:
        measured, predicted = stats.get("tokens_per_target_call"), stats.get("predicted_tokens_per_target_call")
        line = (f"cost model: alpha={alpha:.3f} gamma={gamma:g} c={_num(c, '.3f')}: tokens/target call "
                f"{_num(measured, '.2f')} measured vs {_num(predicted, '.2f')} predicted by "
                f"(1-alpha^(gamma+1))/(1-alpha); predicted speedup (1-alpha^(gamma+1))/((1-alpha)(gamma*c+1)) = "
                f"{_num(stats.get('predicted_speedup'), '.2f')}x (run --no-draft for the measured baseline)")
        lines.append(line)
    return lines


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


# ----------------------------------------------------------------------------- main
def load(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
         world_size: int = 1) -> tuple[Loaded, list[int]]:
    """Resolve, check and load the pair; everything that can be refused is refused before loading."""
    names = {"target": args.target} if args.no_draft else {"target": args.target, "draft": args.draft}
    dirs = {role: resolve(name) for role, name in names.items()}
    configs = {role: read_config(path) for role, path in dirs.items()}
    tokenizers = {role: load_tokenizer(path) for role, path in dirs.items()}
    if not args.no_draft:
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
    tokenizer = tokenizers["target"]
    prompt_ids = encode_prompt(tokenizer, args.prompt, args.chat, args.system)
    context = min(c.max_seq_len for c in configs.values())
    if len(prompt_ids) >= context:
        raise UsageError(f"the prompt is {len(prompt_ids)} tokens, which leaves no room in the {context}-token "
                         f"context of {' and '.join(names.values())}")
    slack = 0 if args.no_draft else (GAMMA_MAX if args.gamma == "auto" else args.gamma) + 1  # as the loop allocates
    positions = min(context, len(prompt_ids) + args.max_new_tokens + slack)
    sharded = world_size > 1 or args.quantize is not None
    check_memory((args.target, configs["target"]), None if args.no_draft else (args.draft, configs["draft"]),
                 positions, dtype, device, tp_size=world_size, quantize=args.quantize)

    t0 = time.perf_counter()
    if sharded:  # this rank's slices of the target; the draft whole on every rank; int8 if asked
        target = load_model_tp(dirs["target"], device, dtype, quantize=args.quantize)
        draft = None if args.no_draft else load_model_tp(dirs["draft"], device, dtype, quantize=args.quantize,
                                                         shard=False)
    else:
        target = load_model(dirs["target"], device=device, dtype=dtype)
        draft = None if args.no_draft else load_model(dirs["draft"], device=device, dtype=dtype)
    # Prepacking is a no-op off the CPU, off float32, and on int8 layers.
    counts = [prepare_for_decoding(model, stack=not args.no_fuse, prepack=not args.no_prepack)
              for model in (target, draft) if model is not None]
    fused, prepacked = (sum(column) for column in zip(*counts))
    return Loaded(target, draft, tokenizer, time.perf_counter() - t0, prepacked, fused), prompt_ids


def run(args: argparse.Namespace) -> int:
    validate(args)
    if args.plan:
        return print_plan(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:  # under torchrun: one process per GPU (cuda:LOCAL_RANK), NCCL; gloo on the CPU
        if pick_device(args.device).type == "cuda" and args.device is not None and ":" in args.device:
            raise UsageError("under torchrun each rank uses GPU LOCAL_RANK: pass --device cuda, not a numbered one")
        info = init_distributed(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        device, is_main = info.device, info.is_main
    else:
        device, is_main = pick_device(args.device), True
    dtype = pick_dtype(args.dtype, device)
    loaded, prompt_ids = load(args, device, dtype, world_size)
    # Every rank must draw the same random numbers: one seed, rank 0's, even when --seed is not given.
    seed = broadcast_seed(args.seed, device) if world_size > 1 else args.seed
    tokenizer = loaded.tokenizer
    speculative = loaded.draft is not None
    color = not args.json and not args.no_color and sys.stdout.isatty() and not os.environ.get("NO_COLOR")

    streamer = None
    if not args.json and is_main:  # only rank 0 prints; the others compute the same tokens silently
        dtype_name = str(dtype).removeprefix("torch.") + (" with int8 weights" if args.quantize else "")
        tuning = [f"{loaded.fused} projection groups stacked"] if loaded.fused else []
        tuning += [f"{loaded.prepacked} layers oneDNN-prepacked"] if loaded.prepacked else []
        if tuning:
            dtype_name += f" ({', '.join(tuning)})"
        if world_size > 1:
            dtype_name += f", tensor-parallel over {world_size} ranks"
        pair = f"draft {args.draft} -> target {args.target}" if speculative else f"target {args.target} alone"
        decoding = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
        gamma = f", gamma {args.gamma}" if speculative else ""
        print(f"{pair} on {device} in {dtype_name} (loaded in {loaded.load_s:.1f}s), {decoding}{gamma}",
              file=sys.stderr)
        if color and speculative:
            print(f"colours: {GREEN}draft tokens accepted by the target{RESET}, "
                  f"{YELLOW}tokens produced by the target{RESET} (after a rejection, or the bonus token)",
                  file=sys.stderr)
        if not args.chat:
            sys.stdout.write(tokenizer.decode(prompt_ids))
            sys.stdout.flush()
        streamer = Streamer(tokenizer, prompt_ids, sys.stdout, color)

    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_id=tokenizer.eos_id,
                    seed=seed, callback=streamer)
    with torch.inference_mode():
        if speculative:
            result = speculative_generate(loaded.target, loaded.draft, prompt_ids, args.max_new_tokens,
                                          gamma=args.gamma, **sampling)
        else:
            result = autoregressive_generate(loaded.target, prompt_ids, args.max_new_tokens, **sampling)
    tokens = [int(t) for t in result.tokens]
    stats = stats_dict(result.stats, speculative)
    if not is_main:
        return 0

    if args.json:
        settings = {"target": args.target, "draft": None if args.no_draft else args.draft, "device": str(device),
                    "dtype": str(dtype).removeprefix("torch."), "gamma": args.gamma if speculative else None,
                    "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                    "max_new_tokens": args.max_new_tokens, "seed": seed, "chat": args.chat,
                    "quantize": args.quantize, "tensor_parallel": world_size,
                    "prepacked_layers": loaded.prepacked, "fused_groups": loaded.fused}
        doc = {"text": continuation_text(tokenizer, prompt_ids, tokens), "tokens": tokens,
               "prompt_tokens": len(prompt_ids), "settings": settings, "stats": stats}
        print(json.dumps(_jsonable(doc), allow_nan=False))
        return 0
    streamer.finish()
    for line in summary_lines(stats, speculative):
        print(line, file=sys.stderr)
    return 0


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
    # Under torchrun every rank meets the same bad input: rank 0 alone reports it.
    quiet = int(os.environ.get("RANK", "0")) != 0
    try:
        return run(build_parser().parse_args(argv))
    except (UsageError, UnknownCheckpointError, CheckpointError, ConfigError, PairMismatchError, ValueError) as err:
        if not quiet:
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
