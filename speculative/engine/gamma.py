"""Every way the engine's gamma is decided, on the cost model of section 3 of the paper:
gamma="auto" for one sequence (:class:`AutoGamma`), the load for a server (:class:`LoadGamma`),
or one fixed answer (:class:`FixedGamma`); a row may also pin its own (``Row.gamma``).

With acceptance rate alpha (each drafted token accepted with probability alpha, the
paper's simplifying assumption) one iteration emits on average

    E[tokens] = 1 + alpha + ... + alpha^gamma = (1 - alpha^(gamma+1)) / (1 - alpha)      (eq. 1)

for the price of gamma draft steps and one target call, so with c = (time of a draft
step) / (time of a target call) the expected speedup over plain decoding is

    speedup(gamma) = (1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1))      (theorem 3.8)

gamma="auto" (:class:`AutoGamma`) estimates alpha from the exact per-position acceptance
probabilities sum_x min(p_i, q_i) of the verified positions, and c from exponential moving
averages of the two call times, and before each iteration picks the gamma in
[1, GAMMA_MAX] that maximises speedup(gamma) for the current estimates. Until it has a c
(the first iteration's times include the prompt and are not used) it proposes GAMMA_START.

The alpha estimate is (S + 1) / (N + 2), Laplace's rule of succession, where S sums the
acceptance probabilities and N counts the positions, both fading by a factor 0.95 per new
position (about the last 20 count). A plain moving average starts from the first
observation: in greedy decoding those are 0 or 1, so two accepted tokens made alpha 1 and
gamma jump to 16. The two pseudo-observations keep an estimate from few positions near
1/2 and vanish in the fading counts as evidence comes in (docs/algorithm.md gives the
effect on the shipped pair).

:class:`LoadGamma` is the engine's policy (``engine.policy``): before every iteration it
picks the gamma, 0 (no speculation) included, that maximises the cost model's tokens per
second at the current batch size B (docs/batching.md)::

    gamma*(B) = argmax_g  tau(alpha, g) / cost(B, g),   tau(alpha, g) = (1 - alpha^(g+1)) / (1 - alpha)
    cost(B, g) = g D(B) + T(B, g + 1) + V(B)            (tau(alpha, 0) = 1: a plain target step)

with alpha the live acceptance rate (faded over the last few hundred verified positions, as
gamma="auto" estimates it) and the iteration's parts measured on this machine as functions
of B: D the draft steps, T the target call of B rows x (g + 1) tokens, V the rest (verifying,
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from speculative.inputs import GAMMA_MAX
from speculative.sampling import Sampling

if TYPE_CHECKING:  # the policies are handed the engine; the engine imports this module
    from speculative.engine.engine import Engine

GAMMA_START = 4  # before anything is measured
GREEDY = Sampling(temperature=0.0)  # LoadGamma.calibrate's rows


def expected_tokens_per_iteration(alpha: float, gamma: float) -> float:
    """(1 - alpha^(gamma+1)) / (1 - alpha), the paper's eq. 1; gamma + 1 when alpha = 1."""
    if alpha <= 0:
        return 1.0
    if alpha >= 1:
        return gamma + 1.0
    log_alpha = math.log(alpha)  # expm1 keeps the ratio accurate when alpha is close to 1
    return math.expm1((gamma + 1) * log_alpha) / math.expm1(log_alpha)


def expected_speedup(alpha: float, gamma: float, c: float) -> float:
    """(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)), the paper's theorem 3.8."""
    return expected_tokens_per_iteration(alpha, gamma) / (gamma * c + 1)


def best_gamma(alpha: float, c: float, gamma_max: int = GAMMA_MAX) -> int:
    """The gamma in [1, gamma_max] with the largest expected speedup (the smallest on ties)."""
    return max(range(1, gamma_max + 1), key=lambda g: (expected_speedup(alpha, g, c), -g))


@dataclass
class AutoGamma:
    """Chooses gamma before each iteration from running estimates of alpha and c.

    With ``parallel`` (a drafter whose one call drafts the whole chain, speculative.draft.parallel)
    the drafting costs one call whatever gamma, so the cost model above would always answer
    gamma_max. Two things it assumes away then decide: a parallel draft's acceptance falls with
    the position (position i does not see the tokens drafted before it), and the target's call
    grows with its width g + 1. So it keeps alpha per position (alpha_i, faded as alpha is) and
    the target's call time per width, and picks the gamma with the most expected tokens,
    1 + sum_{j<=g} alpha_1 ... alpha_j, per unit of time, c_call + T(g + 1) (a width not measured
    yet is read off the line through the nearest measured ones; once tried, it is measured)."""

    decay: float = 0.9  # weight of the past in the moving averages of the call times
    fade: float = 0.95  # per position, of the past acceptance counts
    gamma_max: int = GAMMA_MAX
    gamma: int = GAMMA_START  # the gamma to use next
    alpha: float | None = None
    draft_step_s: float | None = None  # one drafter call (token by token: one step)
    target_call_s: float | None = None
    accepted_mass: float = 0.0  # S: faded sum of acceptance probabilities
    positions: float = 0.0  # N: faded count of verified positions
    parallel: bool = False
    by_position: dict[int, list[float]] | None = None  # parallel: position -> [S_i, N_i]
    by_width: dict[int, float] | None = None  # parallel: target call width -> its moving average

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def update(self, overlaps: list[float], draft_step_s: float | None, target_call_s: float | None,
               positions: list[int] | None = None, width: int | None = None) -> None:
        """Feed one iteration's measurements: the acceptance probabilities of its verified
        positions (``positions``: their draft positions 1.., for a parallel drafter), and (None
        to skip) the mean time of its drafter calls and of its target call (``width``: its tokens)."""
        for i, beta in enumerate(overlaps):
            self.accepted_mass = self.fade * self.accepted_mass + beta
            self.positions = self.fade * self.positions + 1
            if self.parallel and positions is not None:
                self.by_position = {} if self.by_position is None else self.by_position
                cell = self.by_position.get(positions[i], [0.0, 0.0])
                self.by_position[positions[i]] = [self.fade * cell[0] + beta, self.fade * cell[1] + 1]
        if overlaps:
            self.alpha = (self.accepted_mass + 1) / (self.positions + 2)
        if draft_step_s is not None and target_call_s is not None:
            self.draft_step_s = self._average(self.draft_step_s, draft_step_s)
            self.target_call_s = self._average(self.target_call_s, target_call_s)
            if self.parallel and width is not None:
                self.by_width = self.by_width or {}
                self.by_width[width] = self._average(self.by_width.get(width), target_call_s)
        if self.alpha is not None and self.draft_step_s is not None and self.target_call_s:
            self.gamma = self.best_parallel() if self.parallel else \
                best_gamma(self.alpha, self.draft_step_s / self.target_call_s, self.gamma_max)

    def alpha_at(self, position: int) -> float:
        """Position i's alpha, (S_i + 1) / (N_i + 2); positions never verified take the last known one's."""
        known = self.by_position or {}
        cell = known.get(position) or known.get(max((p for p in known if p < position), default=-1))
        return (cell[0] + 1) / (cell[1] + 2) if cell else (self.alpha or 0.5)

    def target_at(self, width: int) -> float:
        """The target's call time at ``width`` tokens: measured, else on the line through the two
        nearest measured widths (one measured width: the same time; none: the mean call)."""
        known = sorted((self.by_width or {}).items())
        if not known:
            return self.target_call_s or 0.0
        if len(known) == 1 or width in dict(known):
            return dict(known).get(width, known[0][1])
        below = [k for k in known if k[0] < width]
        above = [k for k in known if k[0] > width]
        (w0, t0), (w1, t1) = (below[-1], above[0]) if below and above else known[:2] if above else known[-2:]
        return max(t0 + (t1 - t0) * (width - w0) / (w1 - w0), 0.0)

    def best_parallel(self) -> int:
        """The gamma in [1, gamma_max] with the most expected tokens per second (the smaller on ties)."""
        best, rate_best, reach, tokens = 1, -1.0, 1.0, 1.0
        for g in range(1, self.gamma_max + 1):
            reach *= self.alpha_at(g)
            tokens += reach
            seconds = (self.draft_step_s or 0.0) + self.target_at(g + 1)
            rate = tokens / seconds if seconds > 0 else tokens
            if rate > rate_best * (1 + 1e-9):
                best, rate_best = g, rate
        return best


# ----------------------------------------------------------------------------- a server's gamma: by the load
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

    def __init__(self, gamma_max: int, max_rows: int, decay: float = 0.8, fade: float = 0.99,
                 explore_every: int = 32) -> None:
        if gamma_max < 1 or max_rows < 1:
            raise ValueError(f"gamma_max and max_rows must be >= 1, got {gamma_max} and {max_rows}")
        self.gamma_max, self.max_rows = gamma_max, max_rows
        self.decay, self.fade = decay, fade  # the costs' moving average; alpha's counts, per position
        self.explore_every = explore_every  # two iterations in this many re-measure a neighbour of the choice
        self.cells: dict[tuple[int, int], list[float]] = {}  # (B, g) -> [draft, target, rest] seconds
        self.accepted_mass, self.positions = 0.0, 0.0  # faded sum of acceptance probabilities, and count
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
        known = sorted(b for b, g in list(self.cells) if g == gamma)  # a copy: the loop's thread may add a cell
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
        return expected_tokens_per_iteration(self.alpha if alpha is None else alpha, gamma) / seconds

    def best(self, rows: int) -> int:
        """The gamma with the highest expected rate at ``rows`` rows (the smaller on a tie); the
        largest gamma until anything is measured."""
        rates = [(r, -g) for g in range(self.gamma_max + 1) if (r := self.rate(max(rows, 1), g)) is not None]
        return -max(rates)[1] if rates else self.gamma_max

    def speedup(self, rows: int, gamma: int) -> float | None:
        """The cost model's speedup of ``gamma`` over no speculation at ``rows`` rows."""
        on, off = self.rate(rows, gamma), self.rate(rows, 0)
        return on / off if on is not None and off else None

    def observe(self, it: Iteration) -> None:
        """One iteration: its verified positions into alpha, its clean times into its (B, g) cell."""
        if it.positions:
            faded = self.fade ** it.positions
            self.accepted_mass = faded * self.accepted_mass + it.overlap
            self.positions = faded * self.positions + it.positions
        if it.clean and it.rows:
            self.record(it.rows, it.gamma, [it.draft_s, it.target_s, max(0.0, it.seconds - it.draft_s - it.target_s)])
        self.last_gamma = it.gamma

    def record(self, rows: int, gamma: int, parts: Sequence[float], weight: float | None = None) -> None:
        """Fold measured [draft, target, rest] seconds into the (rows, gamma) cell."""
        old = self.cells.get((rows, gamma))
        keep = self.decay if weight is None else 1 - weight
        self.cells[rows, gamma] = list(parts) if old is None else [keep * o + (1 - keep) * p for o, p in
                                                                   zip(old, parts)]

    def calibrate(self, engine: Engine, prompt: Sequence[int], sizes: Sequence[int] | None = None,
                  rounds: int = 5) -> float:
        """Measure every gamma's iteration at each batch size in ``sizes`` (default 1, 2, 4, ...,
        max_rows) on ``engine`` itself, before it serves: B greedy rows of ``prompt`` step with
        gamma 0, 1, ..., gamma_max in turn, ``rounds`` times (so that a slow moment of a shared
        machine falls on every gamma alike), and each cell keeps its median. The positions it
        verified seed alpha (weighted as the last 1 / (1 - fade) of them at most, so that live
        traffic soon outweighs them). Leaves the engine idle with this policy installed, and
        returns the seconds it took."""
        start = time.perf_counter()
        sizes = sorted(set(sizes or [*(2 ** k for k in range(max_rows_log(self.max_rows) + 1)), self.max_rows]))
        per_row = rounds * sum(g + 2 for g in range(self.gamma_max + 1)) + 2
        count = min(per_row, engine.row_limit - len(prompt) - 1)
        if count < per_row:
            raise ValueError(f"calibration needs {per_row} tokens after a {len(prompt)}-token prompt; the context "
                             f"holds {engine.row_limit}")
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
                    self.record(size, gamma, [sorted(column)[len(column) // 2] for column in zip(*parts)], weight=1.0)
                for row in rows:  # what the calibration verified seeds alpha (else 1/2 until traffic comes)
                    self.accepted_mass += row.stats.overlap_sum
                    self.positions += row.stats.verified_positions
                for row in rows:
                    engine.cancel(row)
                engine.step()  # they leave
        finally:
            engine.policy = self
            engine.finished.clear()
        window = 1 / (1 - self.fade)  # live traffic outweighs the calibration after about this many positions
        if self.positions > window:
            self.accepted_mass, self.positions = self.accepted_mass * window / self.positions, window
        return time.perf_counter() - start

    def table(self) -> list[tuple[int, int, float | None]]:
        """For every batch size, the gamma the policy would choose now and its predicted speedup."""
        out = []
        for rows in range(1, self.max_rows + 1):
            gamma = self.best(rows)
            out.append((rows, gamma, self.speedup(rows, gamma) if gamma else 1.0))
        return out


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


class FixedGamma:
    """A policy that always answers one gamma: ``FixedGamma(0)`` turns speculation off."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def __call__(self, engine: Engine) -> int:
        return self.gamma


