"""serve.py's cost model at start-up: measured once per machine and set-up, then read.

With ``--speculation load`` the server picks each iteration's gamma from what an iteration of B rows
drafting g tokens costs (speculative.serving.policy.LoadGamma). Measuring every (B, g) takes seconds
on a quiet machine and minutes on a busy one, and its figures hardly change from one start to the
next on the same machine, so the first start measures them and records them in the compiled-step
store (weights/step_cache.py's ``serving_costs.json``), and later starts read them: a second start
answers in seconds. The record is only where the policy starts: every iteration served updates its
own cell, as after a measurement (``--recalibrate`` measures again and replaces the record;
``--compile-cache clear`` forgets it).

The key names what the costs depend on: the networks' shapes and set-ups (speculative.cli.costs's
:func:`cost_key`), the drafter, the largest gamma and batch, the context, the verification rule, the
device and its thread count.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from model.fast.setup import machine
from speculative.cli.costs import cost_key
from speculative.engine.engine import Engine
from speculative.serving.policy import LoadGamma

SERVING_COSTS = "serving_costs.json"  # the store's file of these records (beside measured.json)
VERSION = 1  # what a record holds; a record of another version is measured again


def calibrated(
    policy: LoadGamma,
    engine: Engine,
    draft: Any,
    prompt: Sequence[int],
    store: Any,
    setups: Sequence[str],
    fresh: bool,
    say: Callable[[str], None],
) -> str:
    """Install the policy's costs: read from ``store`` for this machine and set-up, or (none there, or
    ``fresh``) measured on ``engine`` with a line to ``say`` per batch size, and recorded. Returns a
    line saying which."""
    settings = {
        "max_rows": engine.max_rows,
        "gamma_max": policy.gamma_max,
        "context": engine.row_limit,
        "verify": engine.rule
        if isinstance(engine.rule, str)
        else getattr(engine.rule, "__name__", "own"),
        "serving_costs": VERSION,
    }
    where = machine(engine.device)
    key = cost_key(engine.target, draft, setups, settings)
    record = None if fresh else store.measured(where, key, file=SERVING_COSTS)
    if record is not None and policy.restore(record):
        return (
            f"cost model: every gamma at batch sizes up to {engine.max_rows} as measured here on "
            f"{record.get('date', 'an earlier start')} (--recalibrate measures again)"
        )
    say(
        f"cost model: measuring every gamma at batch sizes up to {engine.max_rows}, once on this machine "
        "and set-up ..."
    )

    def measured(size: int, done: int, count: int) -> None:
        say(f"cost model: batch size {size} measured ({done} of {count})")

    seconds = policy.calibrate(engine, prompt, progress=measured)
    store.record(
        where,
        key,
        {**policy.snapshot(), "date": time.strftime("%Y-%m-%d %H:%M")},
        file=SERVING_COSTS,
    )
    return f"cost model: every gamma measured at batch sizes up to {engine.max_rows} in {seconds:.1f}s, and recorded"
