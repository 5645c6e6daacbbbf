"""generate.py's guard: costs measured once per machine and set-up, then read.

A guard that times the run's own iterations (speculative.engine.gamma.Switch) makes a sampled
run's tokens follow the clock: which iterations draft decides which random numbers are drawn for
what. ``--seed`` promises to repeat a run, so generate.py guards a run by recorded costs instead
(a greedy one too: it is spared the timed switch's probes and the clock's noise): the seconds of a
plain target step and of a speculating iteration, and what the first speculating iteration after
plain steps costs more (the drafter catching up), measured the first time a set-up runs on a
machine and kept in the compiled-step store (weights/step_cache.py's ``guard_costs.json``). The
switch then decides from those and from the tokens the run's iterations emit, both fixed for a
seed: the same command gives the same tokens while the record stays (``--compile-cache clear``
removes it, and the next run measures again).

What is measured is the loop as the run will drive it: the run's pair in its set-up, its
sampling, gamma or tree and verification rule, on the last tokens of its prompt, the target
alone and speculating in turns, each round's costs as ratios to its plain step (:func:`measure`).
The key names all of those, the networks by their shapes (:func:`cost_key`). A store that cannot
be written leaves each run to measure its own costs, so that its tokens follow them.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from model.fast.setup import machine
from speculative.engine.engine import DEFAULT_GAMMA, Engine
from speculative.engine.generation import autoregressive_generate, speculative_generate

COSTS = "guard_costs.json"  # the store's file of these records (beside measured.json)
FIGURES = ("plain_s", "speculating_s", "catch_up_s")  # a record's seconds, in Switch.recorded's order
TOKENS = 16  # new tokens a measurement decodes: a few iterations after the prompt's
ROUNDS = 3
CONTEXT = 32  # the prompt's last tokens it starts from: a long prompt's pass would cost more than the rest
# What a record means, in its key: 2 since the speculating iteration is the full depth's (:func:`full_depth`); a
# record of 1 (every iteration's mean) is measured again rather than misread.
VERSION = 2
ENGINE = ("gamma", "tree", "tree_mode", "verify", "temperature", "top_k", "top_p")  # a run's arguments an Engine takes


def cost_key(target: Any, draft: Any, setups: Sequence[str], settings: dict[str, Any]) -> str:
    """What a record holds for: the shapes and dtypes of the target's and the drafter's networks with
    their configs (what a step costs depends on them, not on the weights' values, and hashing a large
    model's bytes would take seconds), the set-ups chosen, and the run's decoding ``settings``."""
    networks = [net for net in (target, getattr(draft, "model", None), getattr(draft, "head", None), draft)
                if hasattr(net, "config")]
    shapes = [repr((net.config, [(n, tuple(t.shape), t.dtype) for n, t in [*net.named_parameters(),
                                 *net.named_buffers()] if ".cache." not in n])) for net in networks]
    digests = [hashlib.blake2b(text.encode(), digest_size=8).hexdigest() for text in dict.fromkeys(shapes)]
    named = " ".join(f"{k} {settings[k]}" for k in sorted(settings))
    return f"{' '.join(digests)} | {type(draft).__name__} | {'/'.join(setups)} | {named} | v{VERSION}"


def measure(target: Any, draft: Any, prompt_ids: Sequence[int], run: dict[str, Any],
            tokens: int = TOKENS, rounds: int = ROUNDS) -> tuple[float, float, float]:
    """(seconds of a plain step, seconds of a speculating iteration, what the first speculating iteration
    after plain steps costs more) for this pair with the run's speculative_generate arguments ``run``
    (gamma, tree, verify, sampling), the prompt's iteration left out: ``rounds`` rounds of the target alone,
    speculating, and speculating after ``tokens`` plain steps, in turns. The switch compares them with one
    another only, so each round's two ratios to its plain step are kept, the median of each, beside the
    median plain step: a machine whose speed drifts between rounds (a VM, a neighbour) moves all three
    of a round together."""
    prompt = list(prompt_ids)[-CONTEXT:]
    sampling = {k: run[k] for k in ("temperature", "top_k", "top_p")}
    depth = len(run["tree"]) if run.get("tree") else run.get("gamma") or DEFAULT_GAMMA  # what the switch calls full
    plain, speculating, catching_up = [], [], []
    for _ in range(rounds):
        alone = autoregressive_generate(target, prompt, tokens, eos_id=(), seed=0, **sampling).stats
        plain.append((alone.target_time_s - alone.first_call_s) / max(alone.new_tokens - 1, 1))
        drafted = speculative_generate(target, draft, prompt, tokens, eos_id=(), seed=0, guard=False, **run).stats
        speculating.append(full_depth(drafted, plain[-1], depth))
        catching_up.append(catch_up(target, draft, prompt, run, tokens))
    step = statistics.median(plain)
    return (step, step * statistics.median(s / p for s, p in zip(speculating, plain)),
            step * statistics.median(c / p for c, p in zip(catching_up, plain)))


def full_depth(stats: Any, plain_s: float, depth: int) -> float:
    """The seconds of a speculating iteration that drafts ``depth`` positions, from a run's ``stats`` (its first
    iteration, which also read the prompt, left out) and the seconds of a plain step: an iteration costs a
    plain step and what its drafted positions add, linearly in their count (the switch charges one that drafts
    fewer, prompt lookup's short match, in proportion). A drafter that drafts the full depth every time gives
    the iterations' mean; one that drafted nothing, that mean too (nothing better is known)."""
    depths = stats.gamma_history[1:]
    seconds = stats.decode_time_s - stats.first_iteration_s
    if not sum(depths):
        return seconds / max(len(depths), 1)
    return plain_s + (seconds - len(depths) * plain_s) * depth / sum(depths)


def catch_up(target: Any, draft: Any, prompt: list[int], run: dict[str, Any], plain_steps: int,
             clock: Callable[[], float] = time.perf_counter) -> float:
    """What the first speculating iteration after ``plain_steps`` plain steps costs more than the median of
    those after it (each iteration timed by ``clock`` when its tokens are seen): a switch held off until
    then, whose equal costs never turn it off again."""
    marks: list[float] = []
    engine = Engine(target, draft, **{k: v for k, v in run.items() if k in ENGINE}, guard=(1.0, 1.0))
    engine.auto.off, engine.auto.next_retry = True, plain_steps
    engine.add(prompt, plain_steps + TOKENS, eos_id=(), seed=0, callback=lambda *_: marks.append(clock()))
    engine.run()
    seconds = [b - a for a, b in zip(marks, marks[1:])]  # seconds[i]: iteration i + 1
    if len(seconds) <= plain_steps:  # the context ended first (a model of a short context): nothing to compare
        return 0.0
    return max(seconds[plain_steps - 1] - statistics.median(seconds[plain_steps:]), 0.0)


def recorded(store: Any, target: Any, draft: Any, prompt_ids: Sequence[int], setups: Sequence[str],
             run: dict[str, Any]) -> tuple[tuple[float, ...], bool]:
    """The costs recorded in ``store`` for this machine and set-up, or measured now and recorded;
    and whether they were measured now."""
    where, run = machine(target.device), {k: v for k, v in run.items() if k != "seed"}
    key = cost_key(target, draft, setups, run)
    seen = store.measured(where, key, file=COSTS) or {}
    try:
        return tuple(float(seen[name]) for name in FIGURES), False
    except (KeyError, TypeError, ValueError):
        pass
    measured = measure(target, draft, prompt_ids, run)
    store.record(where, key, {**dict(zip(FIGURES, measured)), "date": time.strftime("%Y-%m-%d %H:%M")}, file=COSTS)
    return measured, True


def default_guard(args: Any, pair: Any, prompt_ids: Sequence[int], setups: Any, store: Any,
                  one_row: bool) -> tuple[tuple[float, ...] | bool, str | None]:
    """generate.py's guard without --guard / --no-guard: the recorded costs of a chain or a named tree
    (:func:`recorded`), and a note when they were measured now. False for a batch of prompts or a run over
    several processes (each would measure its own), for gamma or tree "auto", and where nothing is drafted."""
    if pair.draft is None or not one_row or args.gamma == "auto" or args.tree == "auto":
        return False, None
    run = dict(gamma=None if args.tree else args.gamma, tree=args.tree, tree_mode=args.tree_mode, verify=args.verify,
               temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    costs, now = recorded(store, pair.target, pair.draft, prompt_ids, [choice.chosen for _, choice in setups.choices],
                          run)
    note = ("guard: measured here once, {:.2f} ms a plain step, {:.2f} ms a speculating iteration and {:.2f} ms more "
            "for the first after plain steps, and recorded: later runs of this set-up read them (--compile-cache "
            "clear forgets them)".format(*(seconds * 1e3 for seconds in costs))) if now else None
    return costs, note
