"""The cost model of section 3 of the paper, and gamma="auto" built on it.

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

Changing gamma from one iteration to the next does not affect the output distribution:
each emitted token has the target's distribution given everything before it, whatever
gamma the history led to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GAMMA_START = 4  # before anything is measured
GAMMA_MAX = 16  # the most tokens gamma="auto" drafts per iteration


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
    """Chooses gamma before each iteration from running estimates of alpha and c."""

    decay: float = 0.9  # weight of the past in the moving averages of the call times
    fade: float = 0.95  # per position, of the past acceptance counts
    gamma_max: int = GAMMA_MAX
    gamma: int = GAMMA_START  # the gamma to use next
    alpha: float | None = None
    draft_step_s: float | None = None
    target_call_s: float | None = None
    accepted_mass: float = 0.0  # S: faded sum of acceptance probabilities
    positions: float = 0.0  # N: faded count of verified positions

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def update(self, overlaps: list[float], draft_step_s: float | None, target_call_s: float | None) -> None:
        """Feed one iteration's measurements: the acceptance probabilities of its verified
        positions, and (None to skip) the mean time of its draft steps and of its target call."""
        for beta in overlaps:
            self.accepted_mass = self.fade * self.accepted_mass + beta
            self.positions = self.fade * self.positions + 1
        if overlaps:
            self.alpha = (self.accepted_mass + 1) / (self.positions + 2)
        if draft_step_s is not None and target_call_s is not None:
            self.draft_step_s = self._average(self.draft_step_s, draft_step_s)
            self.target_call_s = self._average(self.target_call_s, target_call_s)
        if self.alpha is not None and self.draft_step_s is not None and self.target_call_s:
            self.gamma = best_gamma(self.alpha, self.draft_step_s / self.target_call_s, self.gamma_max)
