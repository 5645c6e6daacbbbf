"""A server's gamma, by the load: :class:`LoadGamma` is the engine's policy
(``engine.policy``) under the serving loop (speculative.serving.loop). It drives an engine
from outside (it calibrates on it and reads its statistics and clock), so it lives here,
beside the server, and the engine imports none of it.

Before every iteration it picks the gamma, 0 (no speculation) included, that maximises the
cost model's tokens per second at the current batch size B (docs/batching.md)::

    gamma*(B) = argmax_g  tau(alpha, g) / cost(B, g),   tau(alpha, g) = (1 - alpha^(g+1)) / (1 - alpha)
    cost(B, g) = g D(B) + T(B, g + 1) + V(B)            (tau(alpha, 0) = 1: a plain target step)

with tau the paper's eq. 1 (speculative.engine.cost), alpha the live acceptance rate (faded
over the last few hundred verified positions, as gamma="auto" estimates it,
speculative.engine.gamma) and the iteration's parts measured on this machine as functions of
B: D the draft steps, T the target call of B rows x (g + 1) tokens, V the rest (verifying,
committing, the rows moving, and whatever the server's own work takes from the CPU).
:meth:`LoadGamma.calibrate` measures every (B, g) at start-up on the engine itself (B = 1, 2,
4, ... max_rows; sizes between are interpolated); every iteration served updates its own cell,
and two in every 32 try a gamma next to the choice, so that both sides of it stay measured. No
threshold is set by hand: the crossover where speculation stops paying is where the measured
costs put it.

Changing gamma from one iteration to the next does not affect the output distribution:
each emitted token has the target's distribution given everything before it, whatever
gamma the history led to.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from speculative.engine.cost import expected_tokens_per_iteration
from speculative.engine.engine import Engine
from speculative.engine.gamma import FixedGamma
from speculative.sampling import Sampling

GREEDY = Sampling(temperature=0.0)  # LoadGamma.calibrate's rows


@dataclass
class Iteration:
    """What one engine step did, as the loop saw it."""

    rows: int  # B: rows that took part
    gamma: int  # the most any of them drafted (0: nobody speculated)
    seconds: float  # the whole step
    draft_s: float
    target_s: float
    tokens: int  # emitted, all rows
    overlap: float  # sum over verified positions of sum_x min(p, q)
    positions: int  # verified draft positions
    clean: bool  # no prompt read and no draft catching up: its times are an iteration's cost


class LoadGamma:
    """The engine's gamma for the next iteration, from the cost model at the current batch size
    (see the module docstring). Call it as ``engine.policy``; feed it every iteration with
    :meth:`observe`."""

    def __init__(
        self,
        gamma_max: int,
        max_rows: int,
        decay: float = 0.8,
        fade: float = 0.99,
        explore_every: int = 32,
    ) -> None:
        if gamma_max < 1 or max_rows < 1:
            raise ValueError(f"gamma_max and max_rows must be >= 1, got {gamma_max} and {max_rows}")
        self.gamma_max, self.max_rows = gamma_max, max_rows
        # the costs' moving average; alpha's counts, per position
        self.decay, self.fade = (
            decay,
            fade,
        )
        self.explore_every = (
            explore_every  # two iterations in this many re-measure a neighbour of the choice
        )
        self.cells: dict[
            tuple[int, int], list[float]
        ] = {}  # (B, g) -> [draft, target, rest] seconds
        # faded sum of acceptance probabilities, and count
        self.accepted_mass, self.positions = (
            0.0,
            0.0,
        )
        self.chosen: tuple[int, int] = (-1, 0)  # (iteration, gamma): decided once per iteration
        self.last_gamma = gamma_max

    @property
    def alpha(self) -> float:
        """(S + 1) / (N + 2) over the faded counts: 1/2 before anything is verified."""
        return (self.accepted_mass + 1) / (self.positions + 2)

    def __call__(self, engine: Engine) -> int:
        iteration = engine.stats.iterations
        if self.chosen[0] != iteration:  # the engine asks once per row
            self.chosen = (iteration, self.choose(len(engine.rows), iteration))
        return self.chosen[1]

    def choose(self, rows: int, iteration: int) -> int:
        """best(rows); but two iterations in every explore_every speculate with a neighbouring
        gamma (0..gamma_max, alternately above and below the choice), so that the costs on both
        sides of the choice stay measured live, as the server's own work and the machine change
        them, not only at start-up. Two in a row, because the first iteration after plain steps
        lets the draft catch up and is not an iteration's cost."""
        gamma = self.best(rows)
        if not self.explore_every or iteration % self.explore_every > 1:
            return gamma
        neighbours = [g for g in (gamma + 1, gamma - 1) if 0 <= g <= self.gamma_max]
        return neighbours[(iteration // self.explore_every) % len(neighbours)]

    def cost(self, rows: int, gamma: int) -> float | None:
        """Seconds of one iteration of ``rows`` rows drafting ``gamma``: measured at this B, else
        interpolated linearly between the nearest measured sizes (scaled from the largest above
        them); None when nothing is known for this gamma."""
        # a copy: the loop's thread may add a cell
        known = sorted(b for b, g in list(self.cells) if g == gamma)
        if not known:
            return None
        if rows in known:
            return sum(self.cells[rows, gamma])
        below, above = [b for b in known if b < rows], [b for b in known if b > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            w = (rows - lo) / (hi - lo)
            return (1 - w) * sum(self.cells[lo, gamma]) + w * sum(self.cells[hi, gamma])
        nearest = above[0] if above else below[-1]
        return sum(self.cells[nearest, gamma]) * (1 if above else rows / nearest)

    def rate(self, rows: int, gamma: int, alpha: float | None = None) -> float | None:
        """Expected tokens per second per row: tau(alpha, gamma) / cost(B, gamma)."""
        seconds = self.cost(rows, gamma)
        if seconds is None or seconds <= 0:
            return None
        return (
            expected_tokens_per_iteration(self.alpha if alpha is None else alpha, gamma) / seconds
        )

    def best(self, rows: int) -> int:
        """The gamma with the highest expected rate at ``rows`` rows (the smaller on a tie); the
        largest gamma until anything is measured."""
        rates = [
            (r, -g)
            for g in range(self.gamma_max + 1)
            if (r := self.rate(max(rows, 1), g)) is not None
        ]
        return -max(rates)[1] if rates else self.gamma_max

    def speedup(self, rows: int, gamma: int) -> float | None:
        """The cost model's speedup of ``gamma`` over no speculation at ``rows`` rows."""
        on, off = self.rate(rows, gamma), self.rate(rows, 0)
        return on / off if on is not None and off else None

    def observe(self, it: Iteration) -> None:
        """One iteration: its verified positions into alpha, its clean times into its (B, g) cell."""
        if it.positions:
            faded = self.fade**it.positions
            self.accepted_mass = faded * self.accepted_mass + it.overlap
            self.positions = faded * self.positions + it.positions
        if it.clean and it.rows:
            self.record(
                it.rows,
                it.gamma,
                [it.draft_s, it.target_s, max(0.0, it.seconds - it.draft_s - it.target_s)],
            )
        self.last_gamma = it.gamma

    def record(
        self, rows: int, gamma: int, parts: Sequence[float], weight: float | None = None
    ) -> None:
        """Fold measured [draft, target, rest] seconds into the (rows, gamma) cell."""
        old = self.cells.get((rows, gamma))
        keep = self.decay if weight is None else 1 - weight
        self.cells[rows, gamma] = (
            list(parts) if old is None else [keep * o + (1 - keep) * p for o, p in zip(old, parts)]
        )

    def calibrate(
        self,
        engine: Engine,
        prompt: Sequence[int],
        sizes: Sequence[int] | None = None,
        rounds: int = 5,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> float:
        """Measure every gamma's iteration at each batch size in ``sizes`` (default 1, 2, 4, ...,
        max_rows) on ``engine`` itself, before it serves: B greedy rows of ``prompt`` step with
        gamma 0, 1, ..., gamma_max in turn, ``rounds`` times (so that a slow moment of a shared
        machine falls on every gamma alike), and each cell keeps its median. The positions it
        verified seed alpha (weighted as the last 1 / (1 - fade) of them at most, so that live
        traffic soon outweighs them). ``progress(size, done, count)`` hears of each batch size
        measured (the ``done``-th of ``count``). Leaves the engine idle with this policy installed,
        and returns the seconds it took."""
        start = time.perf_counter()
        sizes = sorted(set(sizes or calibration_sizes(self.max_rows)))
        per_row = rounds * sum(g + 2 for g in range(self.gamma_max + 1)) + 2
        count = min(per_row, engine.row_limit - len(prompt) - 1)
        if count < per_row:
            raise ValueError(
                f"calibration needs {per_row} tokens after a {len(prompt)}-token prompt; the context "
                f"holds {engine.row_limit}"
            )
        fixed = engine.policy = FixedGamma(0)
        try:
            for size in sizes:
                rows = [engine.add(prompt, count, sampling=GREEDY, seed=0) for _ in range(size)]
                engine.step()  # reads the prompts
                times: dict[int, list[list[float]]] = {g: [] for g in range(self.gamma_max + 1)}
                for _ in range(rounds):
                    for fixed.gamma in range(self.gamma_max + 1):
                        if fixed.gamma == 1:
                            engine.step()  # the draft catches up on what the plain steps emitted
                        times[fixed.gamma].append(timed_step(engine))
                for gamma, parts in times.items():
                    self.record(
                        size,
                        gamma,
                        [sorted(column)[len(column) // 2] for column in zip(*parts)],
                        weight=1.0,
                    )
                # what the calibration verified seeds alpha (else 1/2 until traffic comes)
                for row in rows:
                    self.accepted_mass += row.stats.overlap_sum
                    self.positions += row.stats.verified_positions
                for row in rows:
                    engine.cancel(row)
                engine.step()  # they leave
                if progress is not None:
                    progress(size, sizes.index(size) + 1, len(sizes))
        finally:
            engine.policy = self
            engine.finished.clear()
        # live traffic outweighs the calibration after about this many positions
        window = 1 / (1 - self.fade)
        if self.positions > window:
            self.accepted_mass, self.positions = (
                self.accepted_mass * window / self.positions,
                window,
            )
        return time.perf_counter() - start

    def snapshot(self) -> dict[str, Any]:
        """What calibration measured, as JSON can keep it: every (B, g) cell's [draft, target, rest]
        seconds, and alpha's faded counts (:meth:`restore` reads it back)."""
        return {
            "cells": [[b, g, *parts] for (b, g), parts in sorted(self.cells.items())],
            "accepted_mass": self.accepted_mass,
            "positions": self.positions,
        }

    def restore(self, record: Any) -> bool:
        """Take the cells and alpha's counts of a :meth:`snapshot`, in place of a calibration; False
        (nothing taken) when ``record`` is not one for this policy's gamma and batch sizes."""
        try:
            cells = {
                (int(b), int(g)): [float(x) for x in parts] for b, g, *parts in record["cells"]
            }
            mass, positions = float(record["accepted_mass"]), float(record["positions"])
        except (KeyError, TypeError, ValueError):
            return False
        wanted = {
            (b, g) for b in calibration_sizes(self.max_rows) for g in range(self.gamma_max + 1)
        }
        if set(cells) != wanted or any(len(parts) != 3 for parts in cells.values()):
            return False
        self.cells, self.accepted_mass, self.positions = cells, mass, positions
        return True

    def table(self) -> list[tuple[int, int, float | None]]:
        """For every batch size, the gamma the policy would choose now and its predicted speedup."""
        out = []
        for rows in range(1, self.max_rows + 1):
            gamma = self.best(rows)
            out.append((rows, gamma, self.speedup(rows, gamma) if gamma else 1.0))
        return out


def calibration_sizes(max_rows: int) -> list[int]:
    """The batch sizes :meth:`LoadGamma.calibrate` measures by default: 1, 2, 4, ... and max_rows."""
    return sorted({*(2**k for k in range(max_rows_log(max_rows) + 1)), max_rows})


def max_rows_log(max_rows: int) -> int:
    return max(0, int(math.floor(math.log2(max_rows))))


def timed_step(engine: Engine) -> list[float]:
    """One engine step's [draft, target, rest] seconds (the engine's own marks, on a CPU)."""
    stats = engine.stats
    before = (stats.draft_time_s, stats.target_time_s)
    start = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - start
    settle(engine)
    draft, target = stats.draft_time_s - before[0], stats.target_time_s - before[1]
    return [draft, target, max(0.0, seconds - draft - target)]


def settle(engine: Engine) -> None:
    """On CUDA the engine's times wait in its clock until settled: settle them (one wait)."""
    if engine.clock is not None and engine.clock.events:
        engine.clock.settle()
