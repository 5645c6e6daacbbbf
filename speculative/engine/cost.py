"""The cost model of section 3 of the paper, as formulas and nothing else: a leaf module, so
that whatever reasons about gamma (the engine's gamma="auto", the statistics, a server's load
policy, the benchmarks) reads one definition and imports no part of the engine with it.

With acceptance rate alpha (each drafted token accepted with probability alpha, the
paper's simplifying assumption) one iteration emits on average

    E[tokens] = 1 + alpha + ... + alpha^gamma = (1 - alpha^(gamma+1)) / (1 - alpha)      (eq. 1)

for the price of gamma draft steps and one target call, so with c = (time of a draft
step) / (time of a target call) the expected speedup over plain decoding is

    speedup(gamma) = (1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1))      (theorem 3.8)

docs/cost_model.md derives both and compares them with measured runs.

A drafter whose chain has a length of its own (suffix decoding, a hybrid) replaces both
assumptions by measurement: speculative.draft.costs.
"""

from __future__ import annotations

import math

from speculative.inputs import GAMMA_MAX


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
