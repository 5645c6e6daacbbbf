"""generate.py's guard by recorded costs (speculative/cli/costs.py): measured once per machine and set-up,
kept in the compiled-step store, read by every later run of the same set-up, and measured again for another
set-up or a record that does not parse."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

from speculative.cli import costs
from tests.support.toy_models import noisy_copy, random_llama
from weights.step_cache import StepCache

RUN = dict(
    gamma=3,
    tree=None,
    tree_mode="without_replacement",
    verify="block",
    temperature=1.0,
    top_k=None,
    top_p=None,
)


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0)
    return target, noisy_copy(target, std=0.3, seed=1)


def test_costs_are_measured_once_and_read_after(
    models, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft = models
    store, measured = StepCache(tmp_path), []
    monkeypatch.setattr(
        costs,
        "measure",
        lambda *args: measured.append(args[3]) or (2e-3, 5e-3 * len(measured), 1e-3),
    )
    assert costs.recorded(store, target, draft, [1, 2, 3], ["prepacked"], RUN) == (
        (2e-3, 5e-3, 1e-3),
        True,
    )
    again = costs.recorded(store, target, draft, [4, 5], ["prepacked"], {**RUN, "seed": 9})
    assert again == ((2e-3, 5e-3, 1e-3), False)
    assert len(measured) == 1 and "seed" not in measured[0]
    # another gamma, set-up, or drafter's shape or dtype is another record; the same shapes with other weights
    # cost the same, and are not
    assert costs.recorded(store, target, draft, [1], ["prepacked"], {**RUN, "gamma": 4})[1]
    assert costs.recorded(store, target, draft, [1], ["compiled"], RUN)[1]
    assert costs.recorded(
        store,
        target,
        random_llama(vocab=16, dim=8, max_seq_len=64, seed=3),
        [1],
        ["prepacked"],
        RUN,
    )[1]
    assert costs.recorded(
        store,
        target,
        noisy_copy(target, std=0.3, seed=2).to(torch.float64),
        [1],
        ["prepacked"],
        RUN,
    )[1]
    assert not costs.recorded(
        store, target, noisy_copy(target, std=0.3, seed=2), [1], ["prepacked"], RUN
    )[1]
    assert len(measured) == 5
    # a record that does not parse is measured again, and replaced
    records = json.loads((tmp_path / costs.COSTS).read_text())
    ((machine, known),) = records.items()
    known[costs.cost_key(target, draft, ["prepacked"], RUN)]["plain_s"] = "fast"
    (tmp_path / costs.COSTS).write_text(json.dumps(records))
    assert costs.recorded(store, target, draft, [1], ["prepacked"], RUN) == (
        (2e-3, 0.030, 1e-3),
        True,
    )
    assert costs.recorded(store, target, draft, [1], ["prepacked"], RUN)[1] is False


def test_a_measurement_times_the_loop_it_guards(models) -> None:
    """The costs of a real (small) pair: a speculating iteration, which runs a drafter of the target's size three
    times and the target once, costs more than a plain step of the target alone; catching up costs something."""
    target, draft = models
    plain_s, speculating_s, catch_up_s = costs.measure(target, draft, [1, 2, 3], RUN)
    assert 0 < plain_s < speculating_s and catch_up_s >= 0


def scripted(
    monkeypatch: pytest.MonkeyPatch, seconds: Callable[[int, list[int]], float]
) -> tuple[list[int], Callable]:
    """The gammas the engines of costs choose, iteration by iteration, into the list returned; and a clock for
    them that adds ``seconds(n, chosen)`` at each call (once an iteration, when its tokens are seen)."""
    chosen: list[int] = []

    class Watched(costs.Engine):
        def step(self):
            chosen.append(self.policy(self))
            return super().step()

    monkeypatch.setattr(costs, "Engine", Watched)
    now = [0.0]

    def clock() -> float:
        now[0] += seconds(len(chosen) - 1, chosen)
        return now[0]

    return chosen, clock


def test_catching_up_is_timed_on_the_iteration_after_the_plain_steps(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extra seconds are the first speculating iteration's after the plain steps, against the median of those
    after it: with a clock that makes every iteration take 1 ms and that one 5 ms, 4 ms."""
    target, draft = models
    drafted, clock = scripted(
        monkeypatch, lambda n, g: 0.005 if n > 0 and g[n] and not g[n - 1] else 0.001
    )
    assert costs.catch_up(target, draft, [1, 2, 3], RUN, 8, clock) == pytest.approx(0.004)
    assert drafted[:8] == [0] * 8 and drafted[8] == 3 and 0 not in drafted[9:-1]


def test_a_context_too_short_to_catch_up_in_costs_nothing() -> None:
    """A model whose context ends within the plain steps leaves no speculating iteration to time: 0, no error."""
    short = random_llama(vocab=16, dim=16, max_seq_len=16, seed=0)
    assert costs.catch_up(short, noisy_copy(short, std=0.3, seed=1), [1, 2, 3], RUN, 12) == 0.0


def test_a_speculating_iteration_is_costed_at_the_full_depth() -> None:
    """Iterations that drafted 0, 0, 2 and 2 positions (prompt lookup finding a match or not), at 1 plain step
    each for the first two and 1.5 for the others: what a drafted position adds is 0.25 of a step, so an
    iteration of the full 4 costs 2 steps, not the 1.25 of the iterations' mean; a drafter that drafts the full
    depth each time gives the mean, and so does one that drafted nothing."""
    assert costs.full_depth([1, 1, 1.5, 1.5], [0, 0, 2, 2], 1.0, 4) == pytest.approx(2.0)
    assert costs.full_depth([2.0, 2.2, 1.8], [4, 4, 4], 1.0, 4) == pytest.approx(2.0)
    assert costs.full_depth([1.0, 1.2], [0, 0], 1.0, 4) == pytest.approx(1.1)


def test_plain_and_speculating_iterations_are_timed_in_turns(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run, blocks of 2 plain and 2 speculating iterations in turn, ending with plain ones; a clock that a
    drift slows steadily (iteration n takes 1 + 2n / 25 times as long), each speculating iteration twice a plain
    step of its moment (the first after plain steps, the drafter catching up, 5 times: left out). A plain step
    is the median cycle's (iterations 5, 6, 9 and 10: 1.6 ms), and a speculating iteration 2 of them within the
    half-iteration offset of the centres (2.05); rounds of each way one after the other would have counted the
    drift as cost."""
    target, draft = models

    def seconds(n: int, g: list[int]) -> float:
        pace = 1 + 2 * n / 25  # the machine slows as the run goes on
        if n > 0 and g[n] and not g[n - 1]:
            steps = 5  # the first speculating iteration after plain steps: the drafter catches up
        elif g[n]:
            steps = 2
        else:
            steps = 1
        return 1e-3 * pace * steps

    chosen, clock = scripted(monkeypatch, seconds)
    run = {**RUN, "temperature": 0.0, "verify": "token"}
    plain_s, speculating_s = costs.alternated(
        target, draft, [1, 2, 3], run, block=2, cycles=3, clock=clock
    )
    assert chosen == [3, 0, 0, 3, 3, 0, 0, 3, 3, 0, 0, 3, 3, 0, 0]
    assert plain_s == pytest.approx(1.6e-3)
    assert speculating_s / plain_s == pytest.approx(2.05)


def test_a_context_too_short_for_a_cycle_gives_its_iterations_mean() -> None:
    """A context that ends within the first block: the iterations it has, both figures alike, no error."""
    short = random_llama(vocab=16, dim=16, max_seq_len=8, seed=0)
    plain_s, speculating_s = costs.alternated(
        short, noisy_copy(short, std=0.3, seed=1), [1, 2, 3], RUN
    )
    assert plain_s == speculating_s >= 0


def test_a_measurement_is_announced_and_a_read_is_not(
    models, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generate.py says what it waits for: one line before measuring, nothing when the record is read."""
    target, draft = models
    store, said = StepCache(tmp_path), []
    monkeypatch.setattr(costs, "measure", lambda *args: (2e-3, 5e-3, 1e-3))
    costs.recorded(store, target, draft, [1, 2, 3], ["prepacked"], RUN, said.append)
    assert len(said) == 1 and said[0].startswith("measure: ")
    costs.recorded(store, target, draft, [1, 2, 3], ["prepacked"], RUN, said.append)
    assert len(said) == 1
