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
sampling, gamma or tree and verification rule, on the last tokens of its prompt: plain steps and
speculating iterations in short blocks in turn within one run, each cycle's speculating cost a ratio to
its own plain step, so that the machine's drift moves both sides of a ratio alike (:func:`measure`).
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
from speculative.cli.options import unrecorded
from speculative.draft.model import as_drafter
from speculative.draft.protocol import trait
from speculative.engine.engine import Engine
from speculative.engine.gamma_policy import Guard

COSTS = "guard_costs.json"  # the store's file of these records (beside measured.json)
# a record's seconds, in Switch.recorded's order
FIGURES = (
    "plain_s",
    "speculating_s",
    "catch_up_s",
)
TOKENS = 16  # new tokens a measurement decodes: a few iterations after the prompt's
ROUNDS = 3  # runs that time the drafter catching up
# iterations each way in turn, and their cycles: the run that times plain and speculating
BLOCK, CYCLES = (
    4,
    6,
)
CONTEXT = 32  # the prompt's last tokens it starts from: a long prompt's pass would cost more than the rest
# What a record means, in its key: 2 since the speculating iteration is the full depth's (:func:`full_depth`), 3
# since plain and speculating iterations are timed in turns in one run; an older record is measured again.
VERSION = 3
# a run's arguments an Engine takes
ENGINE = (
    "gamma",
    "tree",
    "tree_mode",
    "verify",
    "temperature",
    "top_k",
    "top_p",
)


def cost_key(target: Any, draft: Any, setups: Sequence[str], settings: dict[str, Any]) -> str:
    """What a record holds for: the shapes and dtypes of the target's and the drafter's networks with
    their configs (what a step costs depends on them, not on the weights' values, and hashing a large
    model's bytes would take seconds), the set-ups chosen, and the run's decoding ``settings``."""
    # a plain draft model is read as the model of its drafter
    drafter = None if draft is None else as_drafter(draft)
    networks = [target] + [
        net for net in (trait(drafter, "model"), trait(drafter, "head")) if net is not None
    ]
    shapes = [
        repr(
            (
                net.config,
                [
                    (n, tuple(t.shape), t.dtype)
                    for n, t in [*net.named_parameters(), *net.named_buffers()]
                    if ".cache." not in n
                ],
            )
        )
        for net in networks
    ]
    digests = [
        hashlib.blake2b(text.encode(), digest_size=8).hexdigest() for text in dict.fromkeys(shapes)
    ]
    named = " ".join(f"{k} {settings[k]}" for k in sorted(settings))
    return (
        f"{' '.join(digests)} | {type(draft).__name__} | {'/'.join(setups)} | {named} | v{VERSION}"
    )


def measure(
    target: Any,
    draft: Any,
    prompt_ids: Sequence[int],
    run: dict[str, Any],
    tokens: int = TOKENS,
    rounds: int = ROUNDS,
) -> tuple[float, float, float]:
    """(seconds of a plain step, seconds of a speculating iteration that drafts the full depth, what the first
    speculating iteration after plain steps costs more) for this pair with the run's speculative_generate
    arguments ``run`` (gamma, tree, verify, sampling): the first two from one run of short blocks of each in
    turn (:func:`alternated`), the third the median of ``rounds`` runs of ``tokens`` plain steps and then
    speculating (:func:`catch_up`)."""
    prompt = list(prompt_ids)[-CONTEXT:]
    plain_s, speculating_s = alternated(target, draft, prompt, run)
    return (
        plain_s,
        speculating_s,
        statistics.median(catch_up(target, draft, prompt, run, tokens) for _ in range(rounds)),
    )


def timed(
    target: Any,
    draft: Any,
    prompt: list[int],
    run: dict[str, Any],
    plain: Callable[[int], bool],
    new_tokens: Callable[[int], int],
    iterations: int,
    clock: Callable[[], float],
) -> tuple[list[float], list[int], int]:
    """One engine run of at most ``iterations`` iterations and ``new_tokens(gamma)`` tokens whose iterations ``plain``
    names are plain steps and the others draft the full gamma (the engine's ``policy``, as a server sets it): each
    iteration's seconds, timed by ``clock`` when its tokens are seen (0 for the prompt's, iteration 0), the
    positions each drafted, and the full gamma."""
    marks: list[float] = []
    engine = Engine(target, draft, **{k: v for k, v in run.items() if k in ENGINE})
    engine.policy = lambda engine: 0 if plain(engine.stats.iterations) else engine.gamma_max
    engine.add(
        prompt,
        new_tokens(engine.gamma_max),
        eos_id=(),
        seed=0,
        callback=lambda *_: marks.append(clock()),
    )
    engine.step()  # the prompt's iteration: admits the row
    row = engine.rows[0] if engine.rows else None
    while engine.rows and engine.stats.iterations < iterations:
        engine.step()
    seconds = [0.0] + [b - a for a, b in zip(marks, marks[1:])]
    return seconds, row.stats.gamma_history if row is not None else [], engine.gamma_max


def alternated(
    target: Any,
    draft: Any,
    prompt: list[int],
    run: dict[str, Any],
    block: int = BLOCK,
    cycles: int = CYCLES,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """(seconds of a plain step, seconds of a speculating iteration that drafts the full depth), from one run
    of ``cycles`` cycles of ``block`` plain iterations and ``block`` speculating ones, each iteration timed by
    ``clock`` when its tokens are seen. The first speculating iteration of a block, where the drafter catches
    up on the plain steps, is left out. Each speculating block gives its iterations' cost at the full depth
    (:func:`full_depth`) as a ratio to the mean plain step of the blocks on either side of it, and the figures
    are the medians of those: each ratio compares iterations a fraction of a second apart, centred alike, so a
    machine whose speed drifts (a VM, a neighbour) moves both sides of it together, and a cycle that a burst
    hit is outvoted. A context that ends before a cycle is complete uses the cycles completed (at least the
    iterations it has)."""
    # a last plain block: each speculating one has plain ones each side
    iterations = 1 + 2 * block * cycles + block
    seconds, depths, gamma = timed(
        target,
        draft,
        prompt,
        run,
        lambda i: i > 0 and (i - 1) // block % 2 == 0,
        lambda gamma: iterations * (gamma + 1),
        iterations,
        clock,
    )
    plain, ratios = [], []
    for c in range(cycles):
        first = 1 + 2 * block * c
        plains = [
            seconds[j]
            for j in [*range(first, first + block), *range(first + 2 * block, first + 3 * block)]
            if j < len(seconds)
        ]
        clean = [
            j
            for j in range(first + block + 1, first + 2 * block)
            if j < min(len(seconds), len(depths))
        ]
        if len(plains) < 2 * block or not clean:
            break
        step = statistics.fmean(plains)
        plain.append(step)
        ratios.append(
            full_depth([seconds[j] for j in clean], [depths[j] for j in clean], step, gamma) / step
        )
    if not ratios:  # too short a context for one cycle: the iterations it has, as they are
        step = statistics.fmean(seconds[1:]) if len(seconds) > 1 else 0.0
        return step, step
    step = statistics.median(plain)
    return step, step * statistics.median(ratios)


def full_depth(
    seconds: Sequence[float], depths: Sequence[int], plain_s: float, depth: int
) -> float:
    """The seconds of a speculating iteration that drafts ``depth`` positions, from iterations that took
    ``seconds`` and drafted ``depths`` positions, and the seconds of a plain step: an iteration costs a plain
    step and what its drafted positions add, linearly in their count (the switch charges one that drafts
    fewer, prompt lookup's short match, in proportion). A drafter that drafts the full depth every time gives
    the iterations' mean; one that drafted nothing, that mean too (nothing better is known)."""
    if not sum(depths):
        return statistics.fmean(seconds)
    return plain_s + (sum(seconds) - len(seconds) * plain_s) * depth / sum(depths)


def catch_up(
    target: Any,
    draft: Any,
    prompt: list[int],
    run: dict[str, Any],
    plain_steps: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """What the first speculating iteration after ``plain_steps`` plain steps costs more than the median of
    those after it, in one run (:func:`timed`) of ``plain_steps`` plain steps, the prompt's included, and then
    speculating."""
    seconds, _, _ = timed(
        target,
        draft,
        prompt,
        run,
        lambda i: i < plain_steps,
        lambda _: plain_steps + TOKENS,
        plain_steps + TOKENS,
        clock,
    )
    # the context ended first (a model of a short context): nothing to compare
    if len(seconds) <= plain_steps + 1:
        return 0.0
    return max(seconds[plain_steps] - statistics.median(seconds[plain_steps + 1 :]), 0.0)


def recorded(
    store: Any,
    target: Any,
    draft: Any,
    prompt_ids: Sequence[int],
    setups: Sequence[str],
    run: dict[str, Any],
    say: Callable[[str], None] | None = None,
) -> tuple[tuple[float, ...], bool]:
    """The costs recorded in ``store`` for this machine and set-up, or measured now (told to ``say``
    first) and recorded; and whether they were measured now."""
    where, run = machine(target.device), {k: v for k, v in run.items() if k != "seed"}
    key = cost_key(target, draft, setups, run)
    seen = store.measured(where, key, file=COSTS) or {}
    try:
        return tuple(float(seen[name]) for name in FIGURES), False
    except (KeyError, TypeError, ValueError):
        pass
    if say is not None:
        say(
            "measure: a plain step and a speculating iteration, for the guard, once on this machine "
            "and set-up ..."
        )
    measured = measure(target, draft, prompt_ids, run)
    store.record(
        where,
        key,
        {**dict(zip(FIGURES, measured)), "date": time.strftime("%Y-%m-%d %H:%M")},
        file=COSTS,
    )
    return measured, True


def decoding_run(args: Any) -> dict[str, Any]:
    """A command line's decoding settings as an engine run takes them (a tree's gamma is its
    shape's): what a record of costs is measured with and keyed by."""
    return dict(
        gamma=None if args.tree else args.gamma,
        tree=args.tree,
        tree_mode=args.tree_mode,
        verify=args.verify,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
    )


def chosen_setups(setups: Any) -> list[str]:
    """The set-up chosen for each model (model.fast.setup.Setups), as a record's key names them."""
    return [choice.chosen for _, choice in setups.choices]


def default_guard(
    args: Any,
    pair: Any,
    prompt_ids: Sequence[int],
    setups: Any,
    store: Any,
    one_row: bool,
    say: Callable[[str], None] | None = None,
) -> tuple[Guard, str | None]:
    """generate.py's guard without --guard / --no-guard: the recorded costs of a chain or a named
    tree (:func:`recorded`), and a note when they were measured now. Where recorded costs do not
    apply (a batch of prompts or a run over several processes, where each would measure its own;
    gamma or tree "auto"; nothing drafted), the guard is options.unrecorded's."""
    if pair.draft is None or not one_row or args.gamma == "auto" or args.tree == "auto":
        return unrecorded(args.temperature), None
    costs, now = recorded(
        store,
        pair.target,
        pair.draft,
        prompt_ids,
        chosen_setups(setups),
        decoding_run(args),
        say,
    )
    note = None
    if now:
        milliseconds = (seconds * 1e3 for seconds in costs)
        note = (
            "guard: measured here once, {:.2f} ms a plain step, {:.2f} ms a speculating iteration "
            "and {:.2f} ms more for the first after plain steps, and recorded: later runs of this "
            "set-up read them (--compile-cache clear forgets them)".format(*milliseconds)
        )
    return Guard("recorded", costs), note
