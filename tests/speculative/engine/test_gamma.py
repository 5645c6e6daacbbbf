"""The cost model and gamma="auto" (speculative/engine/gamma.py): the expected tokens per
iteration and the speedup against values worked out by hand (docs/cost_model.md), the best gamma
against a brute-force search, and AutoGamma's estimates, which start at 4 and follow the evidence
without jumping on the first accepted tokens."""

from __future__ import annotations

import pytest

from speculative.engine.cost import best_gamma, expected_speedup, expected_tokens_per_iteration
from speculative.engine.gamma import GAMMA_START, AutoGamma, Switch
from speculative.inputs import GAMMA_MAX


# ----------------------------------------------------------------------------- cost model and gamma="auto"
def test_expected_tokens_per_iteration_by_hand() -> None:
    assert expected_tokens_per_iteration(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096, abs=1e-12)
    assert expected_tokens_per_iteration(0.5, 1) == pytest.approx(1.5, abs=1e-12)
    assert expected_tokens_per_iteration(1.0, 4) == 5.0  # the limit gamma + 1
    assert expected_tokens_per_iteration(1 - 1e-13, 4) == pytest.approx(5.0, abs=1e-9)  # no cancellation
    assert expected_tokens_per_iteration(0.0, 7) == 1.0


def test_expected_speedup_by_hand() -> None:
    # docs/cost_model.md: alpha .8, gamma 4, c .05 -> 3.3616 / 1.2
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2, abs=1e-12)
    assert expected_speedup(0.5, 4, 0.25) == pytest.approx(1.9375 / 2.0, abs=1e-12)
    assert expected_speedup(1.0, 3, 0.0) == 4.0


def brute_force_speedup(alpha: float, gamma: int, c: float) -> float:
    return sum(alpha ** k for k in range(gamma + 1)) / (gamma * c + 1)


def brute_force_best_gamma(alpha: float, c: float) -> int:
    speedups = [brute_force_speedup(alpha, g, c) for g in range(1, GAMMA_MAX + 1)]
    return 1 + max(range(GAMMA_MAX), key=lambda i: (round(speedups[i], 12), -i))


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0])
@pytest.mark.parametrize("c", [0.0, 0.01, 0.05, 0.1, 0.3, 1.0, 2.0])
def test_best_gamma_is_the_brute_force_optimum(alpha: float, c: float) -> None:
    best = max(brute_force_speedup(alpha, g, c) for g in range(1, GAMMA_MAX + 1))
    chosen = best_gamma(alpha, c)
    assert 1 <= chosen <= GAMMA_MAX
    assert brute_force_speedup(alpha, chosen, c) == pytest.approx(best, rel=1e-12)


def test_best_gamma_known_points() -> None:
    assert best_gamma(0.0, 0.1) == 1  # nothing is ever accepted: draft as little as possible
    assert best_gamma(1.0, 0.0) == GAMMA_MAX  # free and always right: draft as much as allowed
    assert best_gamma(0.8, 0.05) == 8  # docs/cost_model.md's table
    assert best_gamma(0.7, 0.1) == 4


def test_auto_gamma_starts_at_4_then_follows_the_estimates() -> None:
    auto = AutoGamma()
    assert auto.gamma == GAMMA_START == 4
    auto.update([0.9, 0.9], None, None)  # acceptance but no timing yet: stay at the start value
    assert auto.gamma == 4
    auto.update([0.8], draft_step_s=0.005, target_call_s=0.1)
    # Laplace's rule on counts fading by 0.95 per position: S = 0.95^2 0.9 + 0.95 0.9 + 0.8
    mass, count = 0.95 ** 2 * 0.9 + 0.95 * 0.9 + 0.8, 0.95 ** 2 + 0.95 + 1
    assert auto.alpha == pytest.approx((mass + 1) / (count + 2))
    assert auto.gamma == brute_force_best_gamma((mass + 1) / (count + 2), 0.05)
    for _ in range(200):
        auto.update([1.0, 1.0, 1.0], draft_step_s=0.0001, target_call_s=0.1)
    assert auto.gamma == GAMMA_MAX
    for _ in range(200):
        auto.update([0.0], draft_step_s=0.05, target_call_s=0.1)
    assert auto.gamma == 1  # never below 1


def test_auto_gamma_does_not_jump_on_the_first_accepted_tokens() -> None:
    """Two fully accepted positions are weak evidence: alpha stays well below 1 and gamma
    moves only a little (a plain moving average would make alpha 1 and gamma 16)."""
    auto = AutoGamma()
    auto.update([1.0, 1.0], draft_step_s=0.0005, target_call_s=0.005)
    assert auto.alpha == pytest.approx((1.95 + 1) / (1.95 + 2))
    assert auto.alpha < 0.8
    assert auto.gamma <= 6
    for _ in range(100):  # but it does follow sustained evidence
        auto.update([1.0] * 4, draft_step_s=0.0005, target_call_s=0.005)
    assert auto.alpha > 0.95
    assert auto.gamma > 8


# ----------------------------------------------------------------------------- speculation turned off where it loses
class Clock:
    """Marks are seconds on a clock the test moves."""

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start


def run(auto: Switch, iterations: int, first: int, now: float, spec: tuple[float, float],
        plain_s: float) -> tuple[list[int], float]:
    """Drive ``auto`` as the engine does for ``iterations`` iterations from index ``first``: each
    chosen gamma takes its seconds (speculating: spec = (seconds, tokens); plain: plain_s for one
    token). Returns the gammas chosen and the clock."""
    chosen = []
    for i in range(first, first + iterations):
        gamma = auto.choose(i)
        chosen.append(gamma)
        tokens = spec[1] if gamma else 1
        auto.observe(i, gamma, tokens, now, Clock)
        now += spec[0] if gamma else plain_s
    return chosen, now


def retries(chosen: list[int]) -> list[int]:
    """The iterations where speculation starts again after plain steps (iteration 0 excluded)."""
    return [i for i in range(1, len(chosen)) if chosen[i] and not chosen[i - 1]]


@pytest.mark.parametrize("kind", [Switch, AutoGamma])
def test_speculation_is_turned_off_where_plain_steps_are_faster(kind: type) -> None:
    auto = kind()
    # speculating: 10 ms for 1.8 tokens (180 tokens/s); plain: 5 ms a token (200 tokens/s)
    chosen, now = run(auto, 120, 0, 0.0, (0.010, 1.8), 0.005)
    # iterations 0 and 1 speculate, 2 is the plain probe and 3 waits for its time (timed when 3 starts,
    # known when 3 ends); from 4 on, off
    assert chosen[:4] == [4, 4, 0, 0] and auto.off
    # a retry loses 2 x (10 - 1.8 x 5) ms = 2 ms; within 1% of 5 ms a plain step: one per 40 plain steps,
    # counted from the probe (iteration 2); then two speculating iterations, plain until the second is timed
    first = retries(chosen)[0]
    assert first == 2 + 40 and chosen[4:first] == [0] * (first - 4)
    assert chosen[first:first + 4] == [4, 4, 0, 0]
    # it lost again: counted from its second iteration, the gap is now the doubled 32 or the budget's 40
    assert retries(chosen)[1] == first + 1 + 40
    later, _ = run(auto, 400, 120, now, (0.010, 1.8), 0.005)
    gaps = [b - a for a, b in zip(retries(later), retries(later)[1:])]
    assert gaps and all(b >= a for a, b in zip(gaps, gaps[1:])) and gaps[-1] > 100  # it backs off while it loses
    assert sum(g > 0 for g in later) <= 2 * (len(gaps) + 1)  # two speculating iterations a retry


def test_a_drafter_that_loses_much_is_retried_seldom_and_costs_little() -> None:
    """The docstring's case: each speculating iteration costs three plain steps more than its tokens
    (20 ms for one token, against 5 ms a token): retried only after 2 x 15 ms / (1% of 5 ms) = 600."""
    auto = Switch(gamma=5)
    chosen, now = run(auto, 700, 0, 0.0, (0.020, 1), 0.005)
    assert retries(chosen) == [2 + 600]
    speculating = sum(g > 0 for g in chosen)
    assert speculating == 4
    # 700 tokens at a plain step's 5 ms would take 3.5 s: the run is within 2% of it
    assert now == pytest.approx(speculating * 0.020 + (700 - speculating) * 0.005) and now < 1.02 * 3.5


@pytest.mark.parametrize("kind", [Switch, AutoGamma])
def test_speculation_stays_on_where_it_pays_and_comes_back_when_it_starts_paying(kind: type) -> None:
    auto = kind()
    chosen, now = run(auto, 100, 0, 0.0, (0.010, 4), 0.005)  # 400 tokens/s against 200
    assert not auto.off
    assert [i for i, g in enumerate(chosen) if g == 0] == [2, 3, 32, 64, 96]  # a plain probe in 32
    broke = kind()
    chosen, now = run(broke, 30, 0, 0.0, (0.010, 1.8), 0.005)  # loses: off
    assert broke.off
    chosen, now = run(broke, 150, 30, now, (0.010, 4), 0.005)  # now it pays: on at the next retry (42)
    assert not broke.off and chosen[-10:].count(0) <= 1 and chosen[42 - 30] == 4


def test_the_switch_keeps_its_gamma_and_auto_moves_its_own() -> None:
    """guard=True's switch drafts the gamma it was given or nothing; AutoGamma's cost model moves its gamma."""
    fixed, auto = Switch(gamma=3), AutoGamma()
    chosen, _ = run(fixed, 50, 0, 0.0, (0.010, 4), 0.005)
    assert set(chosen) == {0, 3}
    for _ in range(100):
        auto.update([1.0] * 4, draft_step_s=0.0005, target_call_s=0.005)
    assert auto.gamma > 8


def test_a_broken_on_off_rule_is_caught() -> None:
    """Power: the rule with its comparison reversed keeps speculating where it loses."""
    class Reversed(Switch):
        def _observe(self, iteration: int, gamma: int, seconds: float, tokens: int) -> None:
            super()._observe(iteration, gamma, seconds, tokens)
            if self.plain_s is not None and self.speculating is not None:
                self.off = not self.off
    chosen, _ = run(Reversed(), 40, 0, 0.0, (0.010, 1.5), 0.005)
    assert sum(g > 0 for g in chosen[5:]) > 20  # the first test's rule would speculate in at most a few of these
