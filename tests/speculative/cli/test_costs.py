"""generate.py's guard by recorded costs (speculative/cli/costs.py): measured once per machine and set-up,
kept in the compiled-step store, read by every later run of the same set-up, and measured again for another
set-up or a record that does not parse."""

from __future__ import annotations

import json

import pytest
import torch

from speculative.cli import costs
from tests.support.toy_models import noisy_copy, random_llama
from weights.step_cache import StepCache

RUN = dict(gamma=3, tree=None, tree_mode="without_replacement", verify="block", temperature=1.0, top_k=None,
           top_p=None)


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0)
    return target, noisy_copy(target, std=0.3, seed=1)


def test_costs_are_measured_once_and_read_after(models, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = models
    store, measured = StepCache(tmp_path), []
    monkeypatch.setattr(costs, "measure", lambda *args: measured.append(args[3]) or (2e-3, 5e-3 * len(measured), 1e-3))
    assert costs.recorded(store, target, draft, [1, 2, 3], ["prepacked"], RUN) == ((2e-3, 5e-3, 1e-3), True)
    again = costs.recorded(store, target, draft, [4, 5], ["prepacked"], {**RUN, "seed": 9})
    assert again == ((2e-3, 5e-3, 1e-3), False)
    assert len(measured) == 1 and "seed" not in measured[0]
    # another gamma, set-up, or drafter's shape or dtype is another record; the same shapes with other weights
    # cost the same, and are not
    assert costs.recorded(store, target, draft, [1], ["prepacked"], {**RUN, "gamma": 4})[1]
    assert costs.recorded(store, target, draft, [1], ["compiled"], RUN)[1]
    assert costs.recorded(store, target, random_llama(vocab=16, dim=8, max_seq_len=64, seed=3), [1], ["prepacked"],
                          RUN)[1]
    assert costs.recorded(store, target, noisy_copy(target, std=0.3, seed=2).to(torch.float64), [1], ["prepacked"],
                          RUN)[1]
    assert not costs.recorded(store, target, noisy_copy(target, std=0.3, seed=2), [1], ["prepacked"], RUN)[1]
    assert len(measured) == 5
    # a record that does not parse is measured again, and replaced
    records = json.loads((tmp_path / costs.COSTS).read_text())
    (machine, known), = records.items()
    known[costs.cost_key(target, draft, ["prepacked"], RUN)]["plain_s"] = "fast"
    (tmp_path / costs.COSTS).write_text(json.dumps(records))
    assert costs.recorded(store, target, draft, [1], ["prepacked"], RUN) == ((2e-3, 0.030, 1e-3), True)
    assert costs.recorded(store, target, draft, [1], ["prepacked"], RUN)[1] is False


def test_a_measurement_times_the_loop_it_guards(models) -> None:
    """The costs of a real (small) pair: a speculating iteration, which runs a drafter of the target's size three
    times and the target once, costs more than a plain step of the target alone; catching up costs something."""
    target, draft = models
    plain_s, speculating_s, catch_up_s = costs.measure(target, draft, [1, 2, 3], RUN)
    assert 0 < plain_s < speculating_s and catch_up_s >= 0


def test_catching_up_is_timed_on_the_iteration_after_the_plain_steps(models, monkeypatch: pytest.MonkeyPatch) -> None:
    """The extra seconds are the first speculating iteration's after the plain steps, against the median of those
    after it: with a clock that makes every iteration take 1 ms and that one 5 ms, 4 ms."""
    target, draft = models
    drafted: list[int] = []  # each iteration's gamma, as the engine asks its switch

    class Watched(costs.Engine):
        def step(self):
            drafted.append(self.auto.choose(self.stats.iterations))
            return super().step()

    now = [0.0]

    def clock() -> float:  # called once an iteration, when its tokens are seen
        n = len(drafted) - 1
        now[0] += 0.005 if n > 0 and drafted[n] and not drafted[n - 1] else 0.001
        return now[0]

    monkeypatch.setattr(costs, "Engine", Watched)
    assert costs.catch_up(target, draft, [1, 2, 3], RUN, 8, clock) == pytest.approx(0.004)
    assert drafted[:8] == [0] * 8 and drafted[8] == 3 and 0 not in drafted[9:-1]


def test_a_context_too_short_to_catch_up_in_costs_nothing() -> None:
    """A model whose context ends within the plain steps leaves no speculating iteration to time: 0, no error."""
    short = random_llama(vocab=16, dim=16, max_seq_len=16, seed=0)
    assert costs.catch_up(short, noisy_copy(short, std=0.3, seed=1), [1, 2, 3], RUN, 12) == 0.0


def test_a_speculating_iteration_is_costed_at_the_full_depth() -> None:
    """A measured run whose iterations after the first drafted 0, 0, 2 and 2 positions (prompt lookup finding
    a match or not), at 1 plain step each for the first two and 1.5 for the others: what a drafted position adds
    is 0.25 of a step, so an iteration of the full 4 costs 2 steps, not the 1.25 of the iterations' mean; a
    drafter that drafts the full depth each time gives the mean."""
    from types import SimpleNamespace

    def stats(depths: list[int], seconds: list[float]) -> SimpleNamespace:
        return SimpleNamespace(gamma_history=[4, *depths], first_iteration_s=3.0, decode_time_s=3.0 + sum(seconds))

    assert costs.full_depth(stats([0, 0, 2, 2], [1, 1, 1.5, 1.5]), 1.0, 4) == pytest.approx(2.0)
    assert costs.full_depth(stats([4, 4, 4], [2.0, 2.2, 1.8]), 1.0, 4) == pytest.approx(2.0)
    assert costs.full_depth(stats([0, 0], [1.0, 1.2]), 1.0, 4) == pytest.approx(1.1)
