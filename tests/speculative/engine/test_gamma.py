"""The cost model and gamma="auto" (speculative/engine/gamma.py): the expected tokens per
iteration and the speedup against values worked out by hand (docs/cost_model.md), the best gamma
against a brute-force search, and AutoGamma's estimates, which start at 4 and follow the evidence
without jumping on the first accepted tokens."""

from __future__ import annotations

import random

import pytest

from speculative.engine.cost import best_gamma, expected_speedup, expected_tokens_per_iteration
from speculative.engine.gamma import GAMMA_START, AutoGamma, Switch
from speculative.inputs import GAMMA_MAX


# ----------------------------------------------------------------------------- cost model and gamma="auto"
def test_expected_tokens_per_iteration_by_hand() -> None:
    assert expected_tokens_per_iteration(0.8, 4) == pytest.approx(
        1 + 0.8 + 0.64 + 0.512 + 0.4096, abs=1e-12
    )
    assert expected_tokens_per_iteration(0.5, 1) == pytest.approx(1.5, abs=1e-12)
    assert expected_tokens_per_iteration(1.0, 4) == 5.0  # the limit gamma + 1
    # no cancellation
    assert expected_tokens_per_iteration(1 - 1e-13, 4) == pytest.approx(5.0, abs=1e-9)
    assert expected_tokens_per_iteration(0.0, 7) == 1.0


def test_expected_speedup_by_hand() -> None:
    # docs/cost_model.md: alpha .8, gamma 4, c .05 -> 3.3616 / 1.2
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2, abs=1e-12)
    assert expected_speedup(0.5, 4, 0.25) == pytest.approx(1.9375 / 2.0, abs=1e-12)
    assert expected_speedup(1.0, 3, 0.0) == 4.0


def brute_force_speedup(alpha: float, gamma: int, c: float) -> float:
    return sum(alpha**k for k in range(gamma + 1)) / (gamma * c + 1)


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
    mass, count = 0.95**2 * 0.9 + 0.95 * 0.9 + 0.8, 0.95**2 + 0.95 + 1
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


def run(
    auto: Switch,
    iterations: int,
    first: int,
    now: float,
    spec: tuple[float | list[float], float | list[float]],
    plain_s: float,
) -> tuple[list[int], float]:
    """Drive ``auto`` as the engine does for ``iterations`` iterations from index ``first``: each
    chosen gamma takes its seconds (speculating: spec = (seconds, tokens), each a number or a list that
    the speculating iterations take in turn; plain: plain_s for one token). Returns the gammas chosen
    and the clock."""
    chosen = []
    times, emitted = ([x] if not isinstance(x, list) else x for x in spec)
    for i in range(first, first + iterations):
        gamma = auto.choose(i)
        chosen.append(gamma)
        k = sum(g > 0 for g in chosen[:-1])  # speculating iterations before this one
        auto.observe(i, gamma, emitted[k % len(emitted)] if gamma else 1, now, Clock)
        now += times[k % len(times)] if gamma else plain_s
    return chosen, now


def retries(chosen: list[int]) -> list[int]:
    """The iterations where speculation starts again after plain steps (iteration 0 excluded)."""
    return [i for i in range(1, len(chosen)) if chosen[i] and not chosen[i - 1]]


@pytest.mark.parametrize("kind", [Switch, AutoGamma])
def test_speculation_is_turned_off_where_plain_steps_are_faster(kind: type) -> None:
    auto = kind()
    # speculating: 10 ms for 1.8 tokens (180 tokens/s); plain: 5 ms a token (200 tokens/s)
    chosen, now = run(auto, 120, 0, 0.0, (0.010, 1.8), 0.005)
    # iterations 0 and 1 speculate, 2 is the plain probe (timed when 3 starts, known when 3 ends), 3 speculates
    assert chosen[:4] == [4, 4, 0, 4]
    # a loss this small could be the tokens' spread (an iteration may emit 1 token or 5) until about ten
    # iterations have shown the same: then off
    off = chosen.index(0, 3)
    assert 8 <= off <= 20 and auto.off
    # tried again 16 iterations after the one whose time turned it off (timed when the next starts, known
    # when that one ends: two before the first plain step): two speculating iterations (the drafter catching
    # up, one clean), then plain until the second is timed
    first = retries(chosen[off:])[0] + off
    assert first == off - 2 + 16 and chosen[off:first] == [0] * (first - off)
    assert chosen[first : first + 4] == [4, 4, 0, 0]
    # lost again: doubled
    assert retries(chosen)[-1] == first + 1 + 32 or retries(chosen)[-1] == first
    later, _ = run(auto, 400, 120, now, (0.010, 1.8), 0.005)
    gaps = [b - a for a, b in zip(retries(later), retries(later)[1:])]
    # it backs off while it loses
    assert gaps and all(b >= a for a, b in zip(gaps, gaps[1:])) and gaps[-1] > 100
    assert sum(g > 0 for g in later) <= 2 * (len(gaps) + 1)  # two speculating iterations a retry


def test_a_drafter_that_loses_much_is_retried_seldom_and_costs_little() -> None:
    """Each speculating iteration costs 20 ms for one token against 5 ms a token plain: even with its mean
    tokens raised by a standard error (one pseudo-observation of half the range, 2.5 tokens, beside the two
    measured ones), a retry loses 2 x (20 - 2.04 x 5) ms = 19.6 ms, so within 1% of 5 ms a plain step the
    first retry waits about 390 iterations, not 16."""
    auto = Switch(gamma=5)
    chosen, now = run(auto, 700, 0, 0.0, (0.020, 1), 0.005)
    assert chosen[:5] == [5, 5, 0, 5, 0]  # off from iteration 4, the probe's time known
    assert (
        retries(chosen)[0] == 3 and 380 <= retries(chosen)[1] <= 400 and len(retries(chosen)) == 2
    )
    speculating = sum(g > 0 for g in chosen)
    assert speculating == 5
    # 700 tokens at a plain step's 5 ms would take 3.5 s: the run is within 2.5% of it
    assert now == pytest.approx(speculating * 0.020 + (700 - speculating) * 0.005)
    assert now < 1.025 * 3.5


@pytest.mark.parametrize("kind", [Switch, AutoGamma])
def test_an_unlucky_start_is_not_taken_for_a_loss(kind: type) -> None:
    """Speculation that pays (9 ms for 3.1 tokens on average: 340 tokens/s against 200) but whose first two
    iterations each emit one token, as a draft accepted three times in four does once in 16 runs: the spread
    of so few iterations explains the loss, so it stays on (plain steps only for the probes)."""
    auto = kind()
    chosen, _ = run(auto, 200, 0, 0.0, (0.009, [1, 1, 5, 3, 4, 2, 5, 4, 1, 5]), 0.005)
    assert [i for i, g in enumerate(chosen) if g == 0] == [
        2,
        32,
        64,
        96,
        128,
        160,
        192,
    ] and not auto.off


@pytest.mark.parametrize("kind", [Switch, AutoGamma])
def test_one_iteration_slowed_by_a_neighbour_is_not_taken_for_a_loss(kind: type) -> None:
    """8 ms for 2 tokens (250 tokens/s against 200 plain), except one speculating iteration in 20 that a
    burst elsewhere on the machine stretches to 80 ms: judged by the fastest of the last three, it stays on
    (a moving average of the seconds, as the switch kept before, turned it off at the first burst)."""
    auto = kind()
    chosen, _ = run(auto, 200, 0, 0.0, ([0.008] * 19 + [0.080], 2), 0.005)
    assert [i for i, g in enumerate(chosen) if g == 0] == [
        2,
        32,
        64,
        96,
        128,
        160,
        192,
    ] and not auto.off


@pytest.mark.parametrize("kind", [Switch, AutoGamma])
def test_speculation_stays_on_where_it_pays_and_comes_back_when_it_starts_paying(
    kind: type,
) -> None:
    auto = kind()
    chosen, now = run(auto, 100, 0, 0.0, (0.010, 4), 0.005)  # 400 tokens/s against 200
    assert not auto.off
    assert [i for i, g in enumerate(chosen) if g == 0] == [2, 32, 64, 96]  # a plain probe in 32
    broke = kind()
    # loses: off, a retry after 2 x 34 ms lost / 1%
    chosen, now = run(broke, 30, 0, 0.0, (0.010, 1), 0.005)
    assert broke.off
    chosen, now = run(broke, 150, 30, now, (0.010, 4), 0.005)  # now it pays: on at the next retry
    assert not broke.off and chosen[-10:].count(0) <= 1 and retries(chosen)[0] == 36 - 30


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
    # the first test's rule would speculate in at most a few of these
    assert sum(g > 0 for g in chosen[5:]) > 20


# ----------------------------------------------------------------------------- recorded costs: generate.py's guard
class NoisyClock:
    """Every duration asked for a different one, as a busy machine's clock gives."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def seconds(self, start: float, end: float) -> float:
        return self.rng.uniform(0.001, 0.05)


def decide(auto: Switch, tokens: list[int], clock: NoisyClock) -> list[int]:
    """The gammas the switch chooses when its speculating iterations emit ``tokens`` in turn."""
    chosen = []
    for i in range(len(tokens)):
        gamma = auto.choose(i)
        chosen.append(gamma)
        auto.observe(
            i, gamma, tokens[sum(g > 0 for g in chosen[:-1])] if gamma else 1, float(i), clock
        )
    return chosen


def test_recorded_costs_decide_without_the_clock() -> None:
    """With recorded costs the choices follow the emitted tokens alone: two clocks that disagree at every
    iteration give the same ones (the --seed promise of a sampled run). The timed switch with the same tokens
    and clocks does not: the test's power."""
    tokens = [1, 2, 1, 1, 3, 1, 1, 1, 2, 1] * 30
    first = decide(Switch(gamma=4, recorded=(0.005, 0.012)), tokens, NoisyClock(0))
    assert first == decide(Switch(gamma=4, recorded=(0.005, 0.012)), tokens, NoisyClock(1))
    assert 0 in first and 4 in first
    assert decide(Switch(gamma=4), tokens, NoisyClock(0)) != decide(
        Switch(gamma=4), tokens, NoisyClock(1)
    )


def test_recorded_costs_by_hand() -> None:
    """5 ms a plain step, 15 ms a speculating iteration of gamma 4. Iteration 0 emits one token: raised by a
    standard error of sqrt((4 / 2)^2 / 2) = 1.414 (the pseudo-observation of half the range), 2.414 tokens
    are 12.07 ms of plain steps, less than 15: off at once, with no probe. A retry loses 2 x (15 - 12.07) =
    5.86 ms, so within 1% of a 5 ms plain step the retry waits 118 iterations; it loses again (one token:
    the faded spread gives 1.83 tokens, 9.2 ms), and the next waits 234."""
    auto = Switch(gamma=4, recorded=(0.005, 0.015))
    chosen = decide(auto, [1] * 400, NoisyClock(0))
    assert chosen[0] == 4 and chosen[1:118] == [0] * 117 and chosen[118:120] == [4, 0]
    assert retries(chosen) == [118, 352] and auto.off
    # a drafter that catches up in 10 ms more after plain steps: each retry is charged them, (5.86 + 10) / 0.05
    assert retries(
        decide(Switch(gamma=4, recorded=(0.005, 0.015, 0.010)), [1] * 400, NoisyClock(0))
    ) == [318]
    # 3 tokens a 12 ms iteration: 15 ms of plain steps
    paying = Switch(gamma=4, recorded=(0.005, 0.012))
    # never off, and no plain probe needed
    assert decide(paying, [3] * 100, NoisyClock(0)) == [4] * 100


def test_recorded_costs_charge_a_short_draft_in_proportion() -> None:
    """5 ms a plain step, 10 ms an iteration that drafts the full 4: one that drafts 1 (prompt lookup's short
    match) costs 5 + 5 / 4 = 6.25 ms, 1.25 plain steps. Emitting 1.6 tokens it pays, and stays on; charged the
    full iteration's 10 ms (2 steps: the switch before), it lost and turned off. Emitting 1.1 it loses, and
    turns off; one that drafts nothing is a plain step, neither."""

    def run(tokens: float, depth: int, n: int = 60) -> list[int]:
        auto = Switch(gamma=4, recorded=(0.005, 0.010))
        chosen = []
        for i in range(n):
            gamma = auto.choose(i)
            chosen.append(gamma)
            drafted = depth if gamma else 0
            emitted = tokens if gamma else 1
            auto.observe(i, drafted, emitted, float(i), NoisyClock(i))
        return chosen

    assert run(1.6, 1) == [4] * 60
    assert run(1.6, 4)[-1] == 0  # the same tokens from a full draft lose: the test's power
    assert 0 in run(1.1, 1)
    assert run(1.0, 0) == [4] * 60
