"""What a run of generate.py shows on a terminal: the streamed and coloured continuation, the
step clock with its busy-CPU hint, the header and settings that describe a run, and the
compiled-step cache's listing (docs/cli.md is their reference)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from time import perf_counter
from typing import Any, TextIO

import torch

from speculative.serving.text import Output
from speculative.verify.tree import branching_parents

GREEN = "\033[32m"
YELLOW = "\033[33m"
RESET = "\033[0m"


LEGEND = (
    f"colours: {GREEN}draft tokens accepted by the target{RESET}, {YELLOW}tokens produced by the target{RESET} "
    "(after a rejection, or the bonus token)"
)


def compile_cache(store: Any, action: str) -> int:
    """--compile-cache: list the entries of the compiled-step cache (size, key) and what --compile
    measured with them on each machine (which the default run follows), on stdout; or clear it."""
    if action == "clear":
        count, size = store.clear()
        print(f"removed {count} entries ({size / 1e6:.1f} MB) from {store.root}")
        return 0
    entries = store.entries()
    print(f"{store.root}: {len(entries)} entries, {sum(e.size for e in entries) / 1e6:.1f} MB")
    for entry in entries:
        key = ", ".join(f"{k} {v}" for k, v in entry.key.items()) or entry.problem
        print(f"  {entry.path.name[:12]}  {entry.size / 1e6:7.1f} MB  {entry.built}  {key}")
    measured = store.measurements()
    models_measured = sum(len(m) for m in measured.values() if isinstance(m, dict))
    print(
        f"measured: {models_measured} models on {len(measured)} machines (the default run uses a "
        "model's compiled steps only where they measured faster)"
    )
    for machine, models in measured.items():
        print(f"  on {machine}:")
        if not isinstance(models, dict):
            continue
        for key, m in models.items():
            try:
                eager = ", ".join(f"{setup} {ms:.3f}" for setup, ms in m["eager_ms"].items())
                if m["faster"]:
                    verdict = "faster: the default uses them"
                else:
                    verdict = "slower: the default stays eager"
                words = key.split()
                print(
                    f"    {m['model']} {words[0][:12]} {' '.join(words[1:3])}: {eager} -> compiled "
                    f"{m['compiled_ms']:.3f} ms a step ({verdict}); built in {m['build_s']:.0f}s on {m['date']}"
                )
            except (KeyError, TypeError, AttributeError, ValueError):
                print(f"    {key[:12]}: a record that does not parse (ignored)")
    return 0


class Streamer:
    """The loop's callback: the text of each batch of new tokens to ``out`` as soon as it is
    complete (speculative.serving.text.Output), drafted tokens the target accepted in green and its
    own in yellow when ``color``; ``out`` None writes nothing (--json, a rank that does not print).

    ``stops``: the text ends before the first of these strings (--stop); text that may be the start
    of one is held back until the next tokens show it is not, and :meth:`stopped` says one was met
    (the run is then stopped at the end of that iteration, and :attr:`tokens` are those kept).

    ``prefix`` (the prompt's text) is written together with the first new text, not before
    the run: a run that fails before its first token (an error such as non-finite logits)
    leaves stdout empty."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        out: TextIO | None,
        color: bool,
        prefix: str = "",
        stops: Sequence[str] = (),
    ) -> None:
        self.output = Output(tokenizer, prompt_ids, stops)
        self.out = out
        self.color = color
        self.prefix = prefix

    def stopped(self) -> bool:
        """Whether the text met a stop string (the loop's ``stop``)."""
        return self.output.stopped

    @property
    def tokens(self) -> list[int]:
        """The new tokens kept: all of them, or those up to the one that completed a stop string."""
        return self.output.tokens

    @property
    def shown(self) -> str:
        """The new text so far, cut before a stop string (after :meth:`finish`, all of it)."""
        return self.output.text

    def __call__(self, new_ids: Sequence[int], from_draft: Sequence[bool]) -> None:
        runs: list[tuple[bool, str]] = []  # consecutive pieces of one colour, merged
        for token, drafted in zip(new_ids, from_draft):
            piece = self.output.add([token])
            if piece and runs and runs[-1][0] == drafted:
                runs[-1] = (drafted, runs[-1][1] + piece)
            elif piece:
                runs.append((drafted, piece))
        if runs and self.color:
            self.write(
                "".join(f"{GREEN if drafted else YELLOW}{text}{RESET}" for drafted, text in runs)
            )
        elif runs:
            self.write("".join(text for _, text in runs))

    def write(self, text: str) -> None:
        """``text`` to ``out`` at once, after the prefix if it has not been written yet."""
        if self.out is None:
            return
        self.out.write(self.prefix + text)
        self.prefix = ""
        self.out.flush()

    def finish(self) -> None:
        """The end of the text, and a newline."""
        # whatever was held back (the start of a stop string that never came, a broken byte sequence)
        self.write(self.output.finish() + "\n")


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


def busy_hint(
    times: Sequence[float], sizes: Sequence[int], threads: int, device: torch.device
) -> str | None:
    """One hint to try --threads 1, when steps of one size took very different times on a CPU.

    ``times``: when each iteration ended (StepClock); ``sizes``: the tokens each drafted
    (all 0 without a draft). Only decode iterations of the most common size are compared:
    the first also read the prompt, and iterations that drafted fewer tokens are cheaper.
    With several threads each operator waits for all of them, so when other processes hold
    the cores most steps wait for a descheduled thread, and the spread of the step times grows
    by orders of magnitude (docs/cli.md shows a measured case). Needs 10 such iterations;
    else None.
    """
    if device.type != "cpu" or threads <= 1:
        return None
    steps = [(b - a, size) for a, b, size in zip(times, times[1:], sizes[1:])]
    if not steps:
        return None
    step_sizes = [size for _, size in steps]
    modal = max(set(step_sizes), key=step_sizes.count)
    same = sorted(seconds for seconds, size in steps if size == modal)
    if len(same) < 10:
        return None
    fast = same[len(same) // 10]
    slow = same[(9 * len(same)) // 10]
    if slow < BUSY_SPREAD * fast:
        return None
    return (
        f"hint: decode steps took {fast * 1e3:.1f} ms to {slow * 1e3:.1f} ms (10th to 90th percentile): other "
        f"processes seem to be using the CPU, and each of the {threads} threads waits for the slowest; "
        "--threads 1 is often many times faster then"
    )


def header_line(
    args: argparse.Namespace,
    pair: Any,
    device: torch.device,
    dtype: torch.dtype,
    world_size: int,
    seed: int | None,
) -> str:
    """The run's first line on stderr: the pair, where it runs, and the whole decoding setup."""
    speculative = pair.draft is not None
    dtype_name = str(dtype).removeprefix("torch.")
    if args.quantize == "file":
        dtype_name += " with the file's 4-bit codes"
    elif args.quantize:
        dtype_name += f" with {args.quantize} weights"
    if pair.draft_dtype not in (None, dtype):
        dtype_name += f", the drafter in {str(pair.draft_dtype).removeprefix('torch.')}"
    tuning = []
    if pair.fused:
        tuning.append(f"{pair.fused} projection groups stacked")
    if pair.prepacked:
        tuning.append(f"{pair.prepacked} layers oneDNN-prepacked")
    if tuning:
        dtype_name += f" ({', '.join(tuning)})"
    if world_size > 1:
        dtype_name += f", tensor-parallel over {world_size} ranks"
    if speculative:
        names = f"draft {args.draft} -> target {args.target}"
    else:
        names = f"target {args.target} alone"
    return (
        f"{names} on {device} in {dtype_name} (loaded in {pair.load_s:.1f}s), "
        f"{sampling_setup(args, seed, speculative)}"
    )


def sampling_setup(args: argparse.Namespace, seed: int | None, speculative: bool) -> str:
    """The header's decoding settings, all of them: what was given and what was defaulted."""
    if args.temperature == 0:
        text = "greedy (temperature 0)"
    else:
        notes = []
        if args.seed is None:
            notes.append("fresh; --seed repeats it")
        if args.prompts_file is not None:
            notes.append("prompt i uses seed + i")
        text = (
            f"temperature {args.temperature:g}, top-k {args.top_k or 'off'}, top-p {args.top_p or 'off'}, "
            f"seed {seed}"
        )
        if notes:
            text += f" ({'; '.join(notes)})"
    if not speculative:
        return text
    if args.tree == "auto":
        return f"{text}, tree auto (each iteration's shape by this run's timings, children {args.tree_mode})"
    guarded = _guard_note(args)
    if args.tree:
        shape = ",".join(map(str, args.tree))
        nodes = len(branching_parents(args.tree))
        return f"{text}, tree {shape} ({nodes} nodes, children {args.tree_mode}){guarded}"
    return f"{text}, gamma {args.gamma}, {args.verify}-wise verification{guarded}"


def _guard_note(args: argparse.Namespace) -> str:
    """The header's words for the guard: nothing when it is off or gamma is auto (which always
    weighs speculating against plain steps), else which costs it goes by."""
    if not args.guard.on or args.gamma == "auto":
        return ""
    if args.guard.mode == "recorded":
        return ", guarded (plain steps where recorded costs say speculating loses)"
    return ", guarded (plain steps where speculating loses)"


def guard_setting(args: argparse.Namespace, speculative: bool) -> bool | str:
    """--json's ``settings.guard``: "recorded" (by costs recorded on this machine), true (by the
    run's own timings: the timed guard, and gamma or tree "auto", which always measure), or false."""
    if not speculative:
        return False
    if args.gamma == "auto" or args.tree == "auto":
        return True
    if args.guard.mode == "recorded":
        return "recorded"
    return args.guard.on


def run_settings(
    args: argparse.Namespace,
    pair: Any,
    setups: list[str],
    device: torch.device,
    dtype: torch.dtype,
    world_size: int,
    seed: int | None,
    compare: bool,
) -> dict[str, Any]:
    """--json's ``settings``: what the run used (top_k, top_p and seed are None when greedy)."""
    speculative = pair.draft is not None
    draft_dtype = None
    if speculative:
        draft_dtype = str(pair.draft_dtype or dtype).removeprefix("torch.")
    guard = guard_setting(args, speculative)
    return {
        "target": args.target,
        "draft": None if args.no_draft else args.draft,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "gamma": args.gamma if speculative else None,
        "draft_dtype": draft_dtype,
        "verify": args.verify if speculative else None,
        "tree": args.tree if speculative else None,
        "guard": guard,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "ignore_eos": args.ignore_eos,
        "stop": list(args.stop),
        "ctx_size": args.ctx_size,
        "seed": seed,
        "chat": args.chat,
        "quantize": args.quantize,
        "tensor_parallel": world_size,
        "prepacked_layers": pair.prepacked,
        "fused_groups": pair.fused,
        "setup": setups or args.setup,
        "threads": torch.get_num_threads(),
        "compare": compare,
    }


def say(line: str) -> None:
    """A progress line (what a run is waiting for), on stderr as it happens."""
    print(line, file=sys.stderr, flush=True)
