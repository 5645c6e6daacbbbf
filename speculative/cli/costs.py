"""The guard of a sampled run: costs measured once per machine and set-up, then read.

A guard that times the run's own iterations (speculative.engine.gamma.Switch) makes a sampled
run's tokens follow the clock: which iterations draft decides which random numbers are drawn for
what. ``--seed`` promises to repeat a run, so generate.py guards a sampled run by recorded costs
instead: the seconds of a plain target step and of a speculating iteration, measured the first
time a set-up runs on a machine and kept in the compiled-step store (weights/step_cache.py's
``guard_costs.json``). The switch then decides from those and from the tokens the run's
iterations emit, both fixed for a seed: the same command gives the same tokens while the record
stays (``--compile-cache clear`` removes it, and the next sampled run measures again).

What is measured is the loop as the run will drive it: the run's pair in its set-up, its
sampling, gamma or tree and verification rule, on the last tokens of its prompt, the target
alone and speculating in turns, the fastest round of each (:func:`measure`). The key names all
of those, the networks by their shapes (:func:`cost_key`). A store that cannot be written leaves
each sampled run to measure its own costs, so that its tokens follow them.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

from model.fast.setup import machine
from speculative.engine.generation import autoregressive_generate, speculative_generate

COSTS = "guard_costs.json"  # the store's file of these records (beside measured.json)
TOKENS = 16  # new tokens a measurement decodes: a few iterations after the prompt's
ROUNDS = 3
CONTEXT = 32  # the prompt's last tokens it starts from: a long prompt's pass would cost more than the rest


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
    return f"{' '.join(digests)} | {type(draft).__name__} | {'/'.join(setups)} | {named}"


def measure(target: Any, draft: Any, prompt_ids: Sequence[int], run: dict[str, Any],
            tokens: int = TOKENS, rounds: int = ROUNDS) -> tuple[float, float]:
    """(seconds of a plain step, seconds of a speculating iteration) for this pair with the run's
    speculative_generate arguments ``run`` (gamma, tree, verify, sampling), the prompt's iteration
    left out of both: ``rounds`` rounds of the target alone and speculating in turns, the fastest
    round of each (a neighbour's burst slows a round, never speeds one up)."""
    prompt = list(prompt_ids)[-CONTEXT:]
    sampling = {k: run[k] for k in ("temperature", "top_k", "top_p")}
    plain, speculating = [], []
    for _ in range(rounds):
        alone = autoregressive_generate(target, prompt, tokens, eos_id=(), seed=0, **sampling).stats
        plain.append((alone.target_time_s - alone.first_call_s) / max(alone.new_tokens - 1, 1))
        drafted = speculative_generate(target, draft, prompt, tokens, eos_id=(), seed=0, guard=False, **run).stats
        speculating.append((drafted.decode_time_s - drafted.first_iteration_s) / max(drafted.target_calls - 1, 1))
    return min(plain), min(speculating)


def recorded(store: Any, target: Any, draft: Any, prompt_ids: Sequence[int], setups: Sequence[str],
             run: dict[str, Any]) -> tuple[tuple[float, float], bool]:
    """The costs recorded in ``store`` for this machine and set-up, or measured now and recorded;
    and whether they were measured now."""
    where, run = machine(target.device), {k: v for k, v in run.items() if k != "seed"}
    key = cost_key(target, draft, setups, run)
    seen = store.measured(where, key, file=COSTS) or {}
    try:
        return (float(seen["plain_s"]), float(seen["speculating_s"])), False
    except (KeyError, TypeError, ValueError):
        pass
    plain_s, speculating_s = measure(target, draft, prompt_ids, run)
    store.record(where, key, {"plain_s": plain_s, "speculating_s": speculating_s,
                              "date": time.strftime("%Y-%m-%d %H:%M")}, file=COSTS)
    return (plain_s, speculating_s), True


def sampled_guard(args: Any, pair: Any, prompt_ids: Sequence[int], setups: Any, store: Any,
                  one_row: bool) -> tuple[tuple[float, float] | bool, str | None]:
    """generate.py's guard for a sampled run without --guard / --no-guard: the recorded costs of a
    chain or a named tree (:func:`recorded`), and a note when they were measured now. False for a batch
    of prompts or a run over several processes (each would measure its own), and where nothing is drafted."""
    if pair.draft is None or not one_row or args.gamma == "auto" or args.tree == "auto":
        return False, None
    run = dict(gamma=None if args.tree else args.gamma, tree=args.tree, tree_mode=args.tree_mode, verify=args.verify,
               temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    (plain_s, speculating_s), now = recorded(store, pair.target, pair.draft, prompt_ids,
                                             [choice.chosen for _, choice in setups.choices], run)
    note = (f"guard: measured here once, {plain_s * 1e3:.2f} ms a plain step and {speculating_s * 1e3:.2f} ms a "
            "speculating iteration, and recorded: sampled runs of this set-up read them (--compile-cache clear "
            "forgets them)") if now else None
    return (plain_s, speculating_s), note
