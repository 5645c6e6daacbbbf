"""What an iteration costs by the tokens it verifies, measured once per machine and set-up, for a
drafter that chooses its own draft length by it (the ``priced`` hook of speculative.draft.protocol:
suffix decoding and the hybrid proposer).

The paper's cost model charges a verification of gamma + 1 tokens as one target step. On a GPU
that holds; on a CPU a call's cost grows with its width once its arithmetic outweighs reading the
weights, and a compiled target pads a call to its next compiled width, so the cost is a staircase.
A copier's chain may run to gamma tokens, and verifying all of them is worth it only where the
tokens it is expected to get accepted grow faster than the seconds. So the costs are measured:

* ``verify_s[g]`` for g = 0..gamma: iterations of the run's own engine, pair and sampling whose
  drafter proposes g tokens at no cost (:class:`Repeat`), in short blocks, every g in turn, over a
  few rounds (the machine's drift moves all of them alike), each figure the median of its
  iterations;
* ``model_s`` for a hybrid: an iteration with its model drafter drafting its own length, as the
  guard times a speculating iteration (speculative.cli.costs.alternated).

They are kept in the compiled-step store beside the guard's costs (``guard_costs.json``, a record
of its own) and read by every later run of the set-up: constants of a run, never its clock, so a
seeded run repeats while the record stays (``--compile-cache clear`` forgets it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from model.fast.setup import machine
from speculative.cli.costs import (
    CONTEXT,
    COSTS,
    ENGINE,
    alternated,
    chosen_setups,
    cost_key,
    decoding_run,
)
from speculative.draft.costs import IterationCosts
from speculative.draft.protocol import Draft, copied_chains, trait
from speculative.engine.engine import Engine
from speculative.sampling import Sampling

BLOCK = 4  # iterations at one width in a row (the first of a block is left out)
ROUNDS = 3  # times every width is timed, in turns
KIND = "iteration costs"  # what the record is, in its key: not the guard's


class Repeat:
    """A drafter for timing only: it proposes ``gamma`` copies of each row's last token, at no
    cost, so that an iteration verifies exactly the tokens asked for. It reads the features the
    measured drafter reads, as the target then computes them."""

    vocab_size = None
    max_seq_len = None

    def __init__(self, reads_features: bool | tuple[int, ...]) -> None:
        self.reads_features = reads_features

    def start(self, max_rows: int = 0, cache_len: int = 0, target: Any = None) -> None:
        pass

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: list[Sampling],
        generators: list[torch.Generator],
        device: torch.device,
    ) -> Draft:
        return copied_chains([[row[-1]] * g for row, g in zip(ids, gammas)], device)

    def commit(
        self,
        lengths: list[int],
        hidden: torch.Tensor | None = None,
        hidden_starts: list[int] | None = None,
    ) -> None:
        pass

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        pass


def verify_seconds(
    target: Any,
    reads_features: bool | tuple[int, ...],
    prompt: list[int],
    run: dict[str, Any],
    gamma: int,
    rounds: int = ROUNDS,
    block: int = BLOCK,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, ...]:
    """Seconds of an iteration verifying g = 0..gamma tokens drafted at no cost: one engine run
    in which every g has ``block`` iterations in a row, all of them in turn (upwards, then
    downwards, ...) for ``rounds`` rounds; each g's figure is the median of its iterations but
    the first of each block. A context that ends first gives the iterations it had; a g never
    timed takes the figure of the nearest one below it."""
    engine = Engine(target, Repeat(reads_features), **{**_engine_args(run), "gamma": max(gamma, 1)})
    drafting = [0]
    engine.policy = lambda engine: drafting[0]
    marks: list[tuple[float, int]] = []
    iterations = 1 + rounds * (gamma + 1) * block
    engine.add(
        prompt,
        iterations * (gamma + 1),
        eos_id=(),
        seed=0,
        callback=lambda *_: marks.append((clock(), drafting[0])),
    )
    engine.step()  # the prompt's iteration: admits the row
    by_width: dict[int, list[float]] = {g: [] for g in range(gamma + 1)}
    for turn in range(rounds):
        order = range(gamma + 1) if turn % 2 == 0 else range(gamma, -1, -1)
        for g in order:
            drafting[0] = g
            for i in range(block):
                if not engine.rows:
                    break
                before = len(marks)
                engine.step()
                if i > 0 and before > 0 and len(marks) > before:
                    by_width[g].append(marks[-1][0] - marks[before - 1][0])
    seconds: list[float] = []
    for g in range(gamma + 1):
        if by_width[g]:
            seconds.append(statistics.median(by_width[g]))
        elif seconds:
            seconds.append(seconds[-1])
    if not seconds:
        raise RuntimeError("the context ended before an iteration could be timed")
    return tuple(seconds)


def measure(
    target: Any, draft: Any, prompt_ids: Sequence[int], run: dict[str, Any]
) -> IterationCosts:
    """The costs of an iteration for ``draft`` with the run's arguments: by the tokens verified
    up to the run's gamma, and with a hybrid's model drafter drafting its own length."""
    prompt = list(prompt_ids)[-CONTEXT:]
    verify_s = verify_seconds(
        target, trait(draft, "reads_features"), prompt, run, int(run["gamma"])
    )
    model_s = None
    model = getattr(draft, "drafter", None)  # a hybrid's model drafter
    if model is not None:
        model_gamma = min(int(draft.model_gamma), int(run["gamma"]))
        _, model_s = alternated(target, model, prompt, {**run, "gamma": model_gamma})
    return IterationCosts(verify_s, model_s)


def recorded(
    store: Any,
    target: Any,
    draft: Any,
    prompt_ids: Sequence[int],
    setups: Sequence[str],
    run: dict[str, Any],
    say: Callable[[str], None] | None = None,
) -> tuple[IterationCosts, bool]:
    """The costs recorded in ``store`` for this machine and set-up, or measured now (told to ``say``
    first) and recorded; and whether they were measured now."""
    where, run = machine(target.device), {k: v for k, v in run.items() if k != "seed"}
    key = cost_key(target, draft, setups, {**run, "record": KIND})
    seen = store.measured(where, key, file=COSTS) or {}
    try:
        model_s = seen["model_s"]
        return IterationCosts(
            tuple(float(s) for s in seen["verify_s"]),
            None if model_s is None else float(model_s),
        ), False
    except (KeyError, TypeError, ValueError):
        pass
    if say is not None:
        say(
            "measure: an iteration's costs by the tokens it verifies, once on this machine and "
            "set-up ..."
        )
    measured = measure(target, draft, prompt_ids, run)
    store.record(
        where,
        key,
        {
            "verify_s": list(measured.verify_s),
            "model_s": measured.model_s,
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        file=COSTS,
    )
    return measured, True


def price(
    args: Any,
    pair: Any,
    prompt_ids: Sequence[int],
    setups: Any,
    store: Any,
    one_row: bool,
    say: Callable[[str], None] | None = None,
) -> str | None:
    """generate.py's pricing of a drafter with the ``priced`` hook: its recorded costs
    (:func:`recorded`) handed to it, and a note when they were measured now. Nothing for another
    drafter, a batch of prompts or a run over several processes (each would measure its own), a
    tree, or gamma "auto" (the cost model then chooses gamma itself)."""
    hook = trait(pair.draft, "priced")
    if hook is None or not one_row or args.gamma == "auto" or args.tree:
        return None
    run = {**decoding_run(args), "tree": None}  # no tree here: its gamma is args.gamma
    costs, now = recorded(
        store, pair.target, pair.draft, prompt_ids, chosen_setups(setups), run, say
    )
    hook(costs)
    if not now:
        return None
    return (
        f"draft length: an iteration's costs by the tokens it verifies (0..{len(costs.verify_s) - 1}) "
        "measured here once and recorded: later runs of this set-up read them (--compile-cache "
        "clear forgets them)"
    )


def _engine_args(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k in ENGINE}
