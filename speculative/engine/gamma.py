"""The mechanisms that choose gamma by measurement: gamma="auto" (:class:`AutoGamma`), the guard
(:class:`Switch`), and one fixed answer (:class:`FixedGamma`). One object owns them and asks them,
the gamma policy (speculative.engine.gamma_policy.GammaPolicy), which also honours a row's pinned
gamma and a server's gamma by the load (LoadGamma, speculative.serving.policy); the formulas are
speculative.engine.cost's.

gamma="auto" (:class:`AutoGamma`) estimates alpha from the exact per-position acceptance
probabilities sum_x min(p_i, q_i) of the verified positions, and c from exponential moving
averages of the two call times, and before each iteration picks the gamma in
[1, GAMMA_MAX] that maximises speedup(gamma) (theorem 3.8, speculative.engine.cost) for the
current estimates. Until it has a c (the first iteration's times include the prompt and are
not used) it proposes GAMMA_START.

The alpha estimate is (S + 1) / (N + 2), Laplace's rule of succession, where S sums the
acceptance probabilities and N counts the positions, both fading by a factor 0.95 per new
position (about the last 20 count). A plain moving average starts from the first
observation: in greedy decoding those are 0 or 1, so two accepted tokens made alpha 1 and
gamma jump to 16. The two pseudo-observations keep an estimate from few positions near
1/2 and vanish in the fading counts as evidence comes in (docs/algorithm.md gives the
effect on the shipped pair).

Speculation can lose where the theorem's assumptions fail: a target whose call grows with its
width, an iteration whose own work is not small beside a target step (a compiled small target).
So gamma="auto" also measures what the paper's model leaves out, the whole iteration, and turns
speculation off where it loses (:class:`Switch`, which AutoGamma extends). A fixed gamma or a
named tree gets the same switch alone with ``guard=True`` (the Engine's argument; ``--guard``), or with
recorded costs (generate.py's default, below): the drafted length stays as asked, or 0 while plain steps are
faster.

:class:`Switch` times whole iterations, start to start: the seconds of clean speculating ones (not
the prompt's, not the one after plain steps, where the drafter catches up) and of plain ones (gamma
0, one target step), and counts the tokens of every speculating iteration. Iterations 0 and 1
speculate, 2 is a plain step (the probe), 3 speculates; from iteration 4 on (2's time is known when
3 ends) speculation is off wherever it loses for sure enough: where, with its tokens' mean raised
by one standard error (their spread taken with one pseudo-observation of half the range, gamma
tokens a row, so that two unlucky iterations are not a verdict) and its seconds the fastest of the
last three clean ones (so that one iteration slowed by a neighbour is not either), it still emits
fewer tokens per second than plain steps. While on, one iteration in 32 is a plain step, so that
the plain cost stays measured. While off it speculates again for two iterations (the drafter
catching up, then one clean one) after 16 iterations off, then 32, 64, ... while it keeps losing
(back to 16 once it pays), and never sooner than keeps what the retries lose within 1% of the time
spent off: a drafter that costs three target steps more per iteration than it saves waits some
400 iterations. So a set-up where speculation loses for sure pays for three speculating
iterations and rare retries. Nothing is set by hand: the crossover is where this run's own
measurements put it.

Given ``recorded`` costs (the seconds of a plain step and of a speculating iteration, measured once
on this machine: generate.py's default, speculative.cli.costs), the switch reads no
clock: it judges every speculating iteration as it ends, by the same rule with those two seconds, and
needs no plain probe. A third recorded figure, what the first speculating iteration after plain steps
costs more (the drafter catching up on them, in a call wider than its usual ones), is charged to each
retry, which keeps retries within the 1% budget with it. Its choices then follow the tokens the
iterations emitted alone, which a seed fixes, so a sampled run repeats; the timed switch makes them
follow the clock too. The recorded speculating iteration is one that drafts the full gamma; one that
drafts k < gamma (a drafter that proposes what it finds, prompt lookup) is charged the plain step and
k / gamma of what the full one costs more, and one that drafts nothing is a plain step.

Changing gamma from one iteration to the next does not affect the output distribution:
each emitted token has the target's distribution given everything before it, whatever
gamma the history led to.

This module imports nothing of the engine (the engine imports it): a policy is handed the
engine when called, and FixedGamma does not look at it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from speculative.engine.cost import best_gamma
from speculative.inputs import GAMMA_MAX

GAMMA_START = 4  # before anything is measured


@dataclass
class Switch:
    """Speculation on or off by whole iterations, as this run measures them (the module docstring):
    ``choose`` answers ``gamma`` or 0, ``observe`` feeds each iteration's tokens and start."""

    gamma: int = GAMMA_START  # drafted when on
    decay: float = 0.9  # weight of the past in the moving averages
    # whole iterations, measured: the last three clean speculating ones' seconds, and plain seconds per token
    speculating: list[float] | None = None
    plain_s: float | None = None
    off: bool = False  # plain steps emit more tokens per second than speculating, for sure: gamma 0
    probe_every: int = 32  # while on: one plain iteration in this many
    retry_after: int = 16  # while off: iterations before speculating again (doubles while it loses)
    budget: float = 0.01  # while off: the share of the time the retries may lose, at most
    next_retry: int = 0
    last: tuple[int, int] = (-1, 0)  # (iteration, gamma) chosen: the engine asks once per row
    previous_gamma: int = 0  # the gamma of the iteration observed last
    pending: tuple | None = (
        None  # (iteration, gamma, tokens, start mark): timed when the next one starts
    )
    fade: float = 0.95  # weight of the past per new speculating iteration's tokens (AutoGamma: per position's alpha)
    # faded count, sum, sum of squares
    emitted: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    rows: int = 1  # the tokens of a plain iteration
    # (plain seconds a token, seconds of a speculating iteration[, the seconds the first one after plain steps costs
    # more]) measured once and recorded: the clock is not read, and a retry is charged its drafter's catching up
    recorded: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.recorded is not None:
            self.plain_s, self.speculating = self.recorded[0], [self.recorded[1]]

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def choose(self, iteration: int) -> int:
        """The gamma for engine iteration ``iteration`` (0: the prompt's): ``gamma``, or 0 while
        off or for a probe (the module docstring)."""
        if self.last[0] != iteration:
            self.last = (iteration, self._choose(iteration))
        return self.last[1]

    def _choose(self, i: int) -> int:
        if self.off:  # a retry: two iterations (the drafter catching up, then a clean one), plain until it is timed
            if i - self.next_retry > 3:  # the retry was cut to nothing (a row's limits): again
                self.next_retry = i
            return self.gamma if 0 <= i - self.next_retry < 2 else 0
        if self.recorded is None and (
            i == 2 or self.plain_s is None and i > 3 or i > 0 and i % self.probe_every == 0
        ):
            return 0  # a probe: recorded costs need none
        return self.gamma

    def observe(self, iteration: int, gamma: int, tokens: int, start: Any, clock: Any) -> None:
        """Engine iteration ``iteration`` (its ``gamma``, the tokens all rows emitted, its
        ``clock`` mark at its ``start``). The one before it, now timed from its start to this one's,
        goes into the speculating or the plain average when clean; then on or off."""
        if self.recorded is not None:  # nothing to time: judged at once
            return self._observe(iteration, gamma, 0.0, tokens)
        pending, self.pending = self.pending, (iteration, gamma, tokens, start)
        if pending is not None and pending[0] == iteration - 1:
            self._observe(pending[0], pending[1], clock.seconds(pending[3], start), pending[2])

    def _observe(self, iteration: int, gamma: int, seconds: float, tokens: float) -> None:
        clean = iteration > 0 and not (gamma > 0 and self.previous_gamma == 0)
        self.previous_gamma = gamma
        if 0 < gamma < self.gamma and self.recorded is not None and self.recorded[0] > 0:
            # Recorded: an iteration that drafted fewer (prompt lookup finding a short match) cost less; what a
            # drafted token costs is linear in the count, so its tokens count as those it would have needed at
            # the full depth for the same gain over plain steps.
            tokens += (
                self.rows
                * (self.recorded[1] / self.recorded[0] - 1)
                * (self.gamma - gamma)
                / self.gamma
            )
        # every speculating iteration's tokens count, clean or not: they vary, the seconds less so
        if gamma > 0:
            w, total, squares = self.emitted
            self.emitted = [
                self.fade * w + 1,
                self.fade * total + tokens,
                self.fade * squares + tokens * tokens,
            ]
        else:
            self.rows = tokens  # a plain iteration emits one token a row
        # every speculating iteration is judged, at the recorded costs
        if self.recorded is not None:
            if gamma == 0 or self.emitted[0] == 0:
                return
        elif not clean or seconds <= 0:
            return
        elif gamma == 0:
            self.plain_s = self._average(self.plain_s, seconds / max(tokens, 1))
        # fresh after a pause: what it costs now, not before
        elif self.off or self.speculating is None:
            self.speculating = [seconds]
        else:
            self.speculating = [*self.speculating, seconds][-3:]
        if self.plain_s is None or self.speculating is None:
            return
        # A loss counts only where the tokens' spread cannot explain it: with their mean raised by one standard
        # error (the spread taken with one pseudo-observation of half the range: gamma tokens a row), speculating
        # still emits fewer tokens per second than plain steps.
        # The seconds: the fastest of the last three, so that one iteration slowed by something else on the
        # machine (a neighbour's burst) does not turn off speculation that pays.
        seconds, (w, total, squares) = min(self.speculating), self.emitted
        mean = total / w
        spread = (max(squares - total * mean, 0.0) + (self.gamma * self.rows / 2) ** 2) / (w + 1)
        # what a retry's two iterations lose
        lost = 2 * (seconds - (mean + math.sqrt(spread / w)) * self.plain_s)
        losing = lost > 0
        # off now, or a retry lost again
        if losing and (not self.off or gamma > 0 and iteration >= self.next_retry):
            self.retry_after = self.retry_after * 2 if self.off else 16
            # catching up
            lost += (
                self.recorded[2] if self.recorded is not None and len(self.recorded) > 2 else 0.0
            )
            self.next_retry = iteration + max(
                self.retry_after, math.ceil(lost / (self.budget * self.plain_s) - 1e-9)
            )
        self.off = losing


@dataclass
class AutoGamma(Switch):
    """Chooses gamma before each iteration from running estimates of alpha and c.

    With ``parallel`` (a drafter whose one call drafts the whole chain, speculative.draft.parallel)
    the drafting costs one call whatever gamma, so the cost model above would always answer
    gamma_max. Two things it assumes away then decide: a parallel draft's acceptance falls with
    the position (position i does not see the tokens drafted before it), and the target's call
    grows with its width g + 1. So it keeps alpha per position (alpha_i, faded as alpha is) and
    the target's call time per width, and picks the gamma with the most expected tokens,
    1 + sum_{j<=g} alpha_1 ... alpha_j, per unit of time, c_call + T(g + 1) (a width not measured
    yet is read off the line through the nearest measured ones; once tried, it is measured)."""

    gamma_max: int = GAMMA_MAX
    alpha: float | None = None
    draft_step_s: float | None = None  # one drafter call (token by token: one step)
    target_call_s: float | None = None
    accepted_mass: float = 0.0  # S: faded sum of acceptance probabilities
    positions: float = 0.0  # N: faded count of verified positions
    parallel: bool = False
    by_position: dict[int, list[float]] | None = None  # parallel: position -> [S_i, N_i]
    by_width: dict[int, float] | None = None  # parallel: target call width -> its moving average

    def update(
        self,
        overlaps: list[float],
        draft_step_s: float | None,
        target_call_s: float | None,
        positions: list[int] | None = None,
        width: int | None = None,
    ) -> None:
        """Feed one iteration's measurements: the acceptance probabilities of its verified
        positions (``positions``: their draft positions 1.., for a parallel drafter), and (None
        to skip) the mean time of its drafter calls and of its target call (``width``: its tokens)."""
        for i, beta in enumerate(overlaps):
            self.accepted_mass = self.fade * self.accepted_mass + beta
            self.positions = self.fade * self.positions + 1
            if self.parallel and positions is not None:
                self.by_position = {} if self.by_position is None else self.by_position
                cell = self.by_position.get(positions[i], [0.0, 0.0])
                self.by_position[positions[i]] = [
                    self.fade * cell[0] + beta,
                    self.fade * cell[1] + 1,
                ]
        if overlaps:
            self.alpha = (self.accepted_mass + 1) / (self.positions + 2)
        if draft_step_s is not None and target_call_s is not None:
            self.draft_step_s = self._average(self.draft_step_s, draft_step_s)
            self.target_call_s = self._average(self.target_call_s, target_call_s)
            if self.parallel and width is not None:
                self.by_width = self.by_width or {}
                self.by_width[width] = self._average(self.by_width.get(width), target_call_s)
        if self.alpha is not None and self.draft_step_s is not None and self.target_call_s:
            self.gamma = (
                self.best_parallel()
                if self.parallel
                else best_gamma(self.alpha, self.draft_step_s / self.target_call_s, self.gamma_max)
            )

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
        if below and above:  # between two measured widths
            (w0, t0), (w1, t1) = below[-1], above[0]
        elif above:  # narrower than every measured width: the line through the two narrowest
            (w0, t0), (w1, t1) = known[:2]
        else:  # wider than every measured width: the line through the two widest
            (w0, t0), (w1, t1) = known[-2:]
        return max(t0 + (t1 - t0) * (width - w0) / (w1 - w0), 0.0)

    def best_parallel(self) -> int:
        """The gamma in [1, gamma_max] with the most expected tokens per second (the smaller on ties)."""
        best = 1
        rate_best = -1.0
        reach = 1.0  # alpha_1 ... alpha_g: the chance that all g drafted tokens are kept
        tokens = 1.0  # expected tokens of an iteration drafting g
        for g in range(1, self.gamma_max + 1):
            reach *= self.alpha_at(g)
            tokens += reach
            seconds = (self.draft_step_s or 0.0) + self.target_at(g + 1)
            rate = tokens / seconds if seconds > 0 else tokens
            if rate > rate_best * (1 + 1e-9):
                best, rate_best = g, rate
        return best


class FixedGamma:
    """A policy that always answers one gamma: ``FixedGamma(0)`` turns speculation off."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def __call__(self, engine: object) -> int:  # the engine is not read: one answer for all
        return self.gamma
