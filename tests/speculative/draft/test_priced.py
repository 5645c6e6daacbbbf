"""Draft lengths chosen by what an iteration costs (the ``priced`` hook): the formula
(speculative/draft/costs.py), the suffix and hybrid drafters' choices by hand, the measurement of
the costs (speculative/cli/pricing.py) against a clock the test drives, its record, and the
exactness of both drafters with costs that make them cut their chains.

* best_prefix and IterationCosts by hand: a staircase of costs, a flat one, one where a plain
  step wins.
* The suffix drafter cuts its chain where the costs say, and proposes nothing where no prefix is
  worth more than a plain step; the hybrid picks the copier's prefix, the model or a plain step
  by tokens per second, by hand.
* verify_seconds measures each width's iteration: with a clock that advances by the tokens the
  target reads, the figures are the clock's own, and a mutant that times the wrong iteration is
  caught.
* recorded: measured once, read after; the guard's record is another.
* Exactness: the checker (exact law, greedy identity) with priced drafters, and greedy identity
  and a repeated seed through the command line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import generate
from speculative.cli import pricing
from speculative.draft.costs import IterationCosts, best_prefix
from speculative.draft.hybrid import HybridDrafter, RowRecord
from speculative.draft.suffix import Continuation, SuffixDrafter
from speculative.proofs import check
from speculative.proofs.cases import priced_hybrid_drafter, priced_suffix_drafter
from speculative.proofs.toys import random_llama
from tests.support.cli import TARGET, needs_pair
from tests.support.mutation import mutated
from weights.step_cache import StepCache

STAIRS = IterationCosts((1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0))  # a compiled ladder 1, 5, 9
FLAT = IterationCosts((1.0,) * 9)


def chain(frequencies: list[float]) -> Continuation:
    return Continuation(list(range(10, 10 + len(frequencies))), list(frequencies), match=2)


# ----------------------------------------------------------------------------- by hand
def test_the_costs_by_hand() -> None:
    assert STAIRS.verify(0) == 1.0 and STAIRS.verify(5) == 2.0
    # past the measured widths: the line of the last one's cost per token
    costs = IterationCosts((1.0, 1.5, 2.0))
    assert costs.verify(4) == pytest.approx(3.0)
    for bad in [(), (1.0, 0.0), (1.0, -1.0)]:
        with pytest.raises(ValueError, match="verify_s"):
            IterationCosts(bad)
    with pytest.raises(ValueError, match="model_s"):
        IterationCosts((1.0,), model_s=0.0)


def test_the_best_prefix_by_hand() -> None:
    sure = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # every token kept
    # flat costs: the whole chain, 9 tokens an iteration
    assert best_prefix(sure, FLAT) == (8, pytest.approx(9.0))
    # the stairs: 4 tokens cost one unit (5 a second), 8 cost two (4.5 a second): four
    assert best_prefix(sure, STAIRS) == (4, pytest.approx(5.0))
    # a chain of doubtful tokens past the first step is cut at the step
    doubtful = [0.9, 1.7, 2.4, 3.0, 3.5, 3.9, 4.2, 4.4]
    assert best_prefix(doubtful, STAIRS)[0] == 4
    # nothing worth a wide call: a plain step
    assert best_prefix([0.1], IterationCosts((1.0, 1.5))) == (0, pytest.approx(1.0))
    # ties keep the shorter
    assert best_prefix([1.0, 1.0], FLAT)[0] == 1


def test_the_suffix_drafter_cuts_its_chain_by_cost() -> None:
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1, 2, 3]  # "1 2 3" was followed by 4 5 6 ... twice
    drafter = SuffixDrafter(spec_factor=4.0)
    drafter.start(1, 128)
    drafter.keep_rows([], new=1)
    drafter.rows[0].update(ids)
    whole = drafter.propose([ids], [8], [None], [None], torch.device("cpu"))
    assert whole.tokens[0].tolist() == [4, 5, 6, 7, 8, 9, 1, 2]  # the whole chain, unpriced
    drafter.priced(STAIRS)
    cut = drafter.propose([ids], [8], [None], [None], torch.device("cpu"))
    assert cut.tokens[0].tolist() == [4, 5, 6, 7]
    drafter.priced(FLAT)
    assert drafter.propose([ids], [8], [None], [None], torch.device("cpu")).lengths == [8]
    # a wide call that costs more than any chain is worth: nothing proposed, a plain step
    drafter.priced(IterationCosts((1.0, 10.0)))
    assert drafter.propose([ids], [8], [None], [None], torch.device("cpu")).lengths == [0]


def test_the_suffix_drafter_calibrates_its_estimates_by_what_was_kept() -> None:
    """A row whose copied tokens were rarely kept (a target that samples) has its estimates
    scaled down, until a wide call is not worth its chain; by hand: (kept + 1) / (estimated + 1)."""
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1, 2, 3]
    drafter = SuffixDrafter(spec_factor=4.0)
    drafter.priced(IterationCosts((1.0, 1.5, 1.5, 1.5, 1.5, 2.0, 2.0, 2.0, 2.0)))
    drafter.start(1, 128)
    drafter.keep_rows([], new=1)
    drafter.rows[0].update(ids)
    cpu = torch.device("cpu")
    # 8 sure tokens: 9 for 2.0 (4.5 a second) against 5 for 1.5 (3.3) and 1 for 1.0
    assert drafter.propose([ids], [8], [None], [None], cpu).lengths == [8]
    drafter.commit([len(ids) + 1])  # none of the 8 kept: the target's own token only
    assert (drafter.calibrations[0].accepted, drafter.calibrations[0].estimated) == (0.0, 8.0)
    assert drafter.calibrations[0].scale == pytest.approx(1 / 9)
    # now 8 promise 8/9 kept: 0.94 a second, 4 promise 4/9: 0.96, a plain step 1: nothing
    assert drafter.propose([ids], [8], [None], [None], cpu).lengths == [0]
    drafter.commit([len(ids) + 1])  # a row that drafted nothing records nothing
    assert drafter.calibrations[0].estimated == 8.0
    # a row that kept what it copied is trusted again: 8 of 8 kept, scale (8 + 1) / (16 + 1)
    drafter.calibrations[0] = type(drafter.calibrations[0])(accepted=8.0, estimated=16.0)
    assert drafter.propose([ids], [8], [None], [None], cpu).lengths == [8]
    drafter.commit([len(ids) + 9])
    assert drafter.calibrations[0].accepted == 16.0 and drafter.calibrations[0].estimated == 24.0
    # a new row starts afresh
    drafter.keep_rows([0], new=1)
    assert drafter.calibrations[1].scale == 1.0


def test_the_hybrid_chooses_by_tokens_per_second() -> None:
    drafter = HybridDrafter(SuffixDrafter(), object(), model_gamma=4)
    fresh = RowRecord()  # the model's prior, 0.5 a position: 1.9375 tokens with the target's own
    unpriced = drafter.choose(fresh, chain([1.0] * 8), gamma=8)
    assert unpriced[0] == "copier" and len(unpriced[1].tokens) == 8
    # the model's iteration costs 1.2: 1.61 tokens a second against the copier's 5 on the stairs
    drafter.priced(IterationCosts(STAIRS.verify_s, model_s=1.2))
    source, cut = drafter.choose(fresh, chain([1.0] * 8), gamma=8)
    assert source == "copier" and len(cut.tokens) == 4
    # a doubtful chain (0.3: 1.3 tokens a second at best) loses to the model (1.61)
    assert drafter.choose(fresh, chain([0.3, 0.3]), gamma=8)[0] == "model"
    # a slow model (2.5: 0.78 a second) and no chain: a plain step (1 a second)
    drafter.priced(IterationCosts(STAIRS.verify_s, model_s=2.5))
    assert drafter.choose(fresh, chain([]), gamma=8)[0] == "none"
    # without the model's cost measured, the model does not draft
    drafter.priced(STAIRS)
    assert drafter.choose(fresh, chain([]), gamma=8)[0] == "none"
    assert drafter.choose(fresh, chain([1.0]), gamma=0)[0] == "none"


# ----------------------------------------------------------------------------- measurement
class Counting(torch.nn.Module):
    """A target that advances a clock by one second a call plus a second per token it reads."""

    def __init__(self, target: torch.nn.Module) -> None:
        super().__init__()
        self.target = target
        self.now = 0.0

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.target, name)

    def forward(self, tokens: torch.Tensor, call: Any, **kwargs: Any) -> Any:
        self.now += 1.0 + tokens.shape[1]
        return self.target(tokens, call, **kwargs)


RUN = dict(gamma=4, tree=None, tree_mode="without_replacement", verify="token", temperature=0.0)


def test_verify_seconds_are_each_widths_iterations() -> None:
    target = Counting(random_llama(vocab=8, max_seq_len=512, seed=0, dtype=torch.float64))
    with torch.inference_mode():
        seconds = pricing.verify_seconds(target, False, [1, 2, 3], RUN, 4, clock=lambda: target.now)
    # an iteration verifying g tokens reads g + 1: 2 + g seconds
    assert seconds == (2.0, 3.0, 4.0, 5.0, 6.0)


def test_a_measurement_of_the_wrong_iteration_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant also times each block's first iteration, which follows another width's (a
    drafter catching up, a compiled step's first call): with a clock that charges a change of
    width, its figures move."""
    target = Counting(random_llama(vocab=8, max_seq_len=512, seed=0, dtype=torch.float64))
    last = [0]

    def forward(tokens, call, **kwargs):
        width = tokens.shape[1]
        target.now += 1.0 + width + (10.0 if width != last[0] else 0.0)
        last[0] = width
        return target.target(tokens, call, **kwargs)

    monkeypatch.setattr(target, "forward", forward)
    mutant = mutated(pricing, ("if i > 0 and before > 0", "if before > 0"))
    with torch.inference_mode():
        # two iterations a block: the one after a change of width is half of what a median sees
        right, wrong = (
            module.verify_seconds(
                target, False, [1, 2, 3], RUN, 4, block=2, clock=lambda: target.now
            )
            for module in (pricing, mutant)
        )
    assert right == (2.0, 3.0, 4.0, 5.0, 6.0)
    assert wrong != right


def test_costs_are_measured_once_and_read_after(tmp_path, monkeypatch) -> None:
    target = random_llama(vocab=8, max_seq_len=64, seed=0)
    draft = SuffixDrafter()
    store, calls = StepCache(tmp_path), []
    made = IterationCosts((1e-3, 2e-3), model_s=None)
    monkeypatch.setattr(pricing, "measure", lambda *args: calls.append(args) or made)
    assert pricing.recorded(store, target, draft, [1, 2], ["prepacked"], RUN) == (made, True)
    assert pricing.recorded(store, target, draft, [3], ["prepacked"], {**RUN, "seed": 5}) == (
        made,
        False,
    )
    assert len(calls) == 1
    # another gamma is another record; the guard's record (speculative.cli.costs) is not this one
    assert pricing.recorded(store, target, draft, [1], ["prepacked"], {**RUN, "gamma": 2})[1]
    records = json.loads((tmp_path / "guard_costs.json").read_text())
    (keys,) = records.values()
    assert len(keys) == 2 and all(pricing.KIND in key for key in keys)


def test_a_hybrid_is_measured_with_its_model_drafting() -> None:
    target = random_llama(vocab=8, max_seq_len=256, seed=0, dtype=torch.float64)
    with torch.inference_mode():
        costs = pricing.measure(target, priced_hybrid_drafter(target), [1, 2, 3, 1, 2], RUN)
    assert len(costs.verify_s) == RUN["gamma"] + 1 and costs.model_s is not None
    suffix = pricing.measure(target, SuffixDrafter(), [1, 2, 3, 1, 2], RUN)
    assert suffix.model_s is None


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("build", [priced_suffix_drafter, priced_hybrid_drafter])
def test_the_checker_passes_the_priced_drafters(build) -> None:
    report = check(build, quick=True, properties=["exact", "greedy"])
    assert report.ok, [result.line() for result in report.results]


@needs_pair
def test_the_command_line_prices_suffix_decoding_and_repeats_a_seed() -> None:
    def run(*argv: str) -> tuple[dict, str]:
        out, err = io.StringIO(), io.StringIO()
        common = ["--target", str(TARGET), "--max-new-tokens", "24", "--dtype", "float64"]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert generate.main([*common, "--json", *argv]) == 0
        return json.loads(out.getvalue()), err.getvalue()

    alone, _ = run("--no-draft")
    greedy, _ = run("--draft", "suffix")
    assert greedy["tokens"] == alone["tokens"]
    sampled = [run("--draft", "suffix", "--temperature", "1", "--seed", "3")[0] for _ in range(2)]
    assert sampled[0]["tokens"] == sampled[1]["tokens"]
    # the costs were measured and recorded (the tests' own store, tests/conftest.py)
    records = json.loads((Path(os.environ["SPECULATIVE_CACHE"]) / "guard_costs.json").read_text())
    keys = [key for machine in records.values() for key in machine]
    assert any(pricing.KIND in key and "SuffixDrafter" in key for key in keys)
