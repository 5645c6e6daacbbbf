"""serve.py's cost model at start-up (speculative/cli/calibration.py): measured once per machine and
set-up with a line per batch size, recorded in the compiled-step store, and read by a later start of
the same set-up without measuring; another set-up, --recalibrate or a record that does not fit is
measured again."""

from __future__ import annotations

import json

import pytest
import torch

from speculative.cli import calibration
from speculative.engine.engine import Engine
from speculative.serving.policy import LoadGamma
from tests.support.toy_models import noisy_copy, random_llama
from weights.step_cache import StepCache

PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = random_llama(vocab=16, dim=16, max_seq_len=256, seed=0)
    return target, noisy_copy(target, std=0.3, seed=1)


def start(models, store: StepCache, max_rows: int = 4, fresh: bool = False, setups=("prepacked",)):
    """What serve.py's start does with the cost model: (the policy, what it said, the line it returns)."""
    target, draft = models
    engine = Engine(target, draft, gamma=2, max_rows=max_rows, cache_len=200)
    policy = LoadGamma(2, max_rows)
    said: list[str] = []
    line = calibration.calibrated(
        policy, engine, draft, PROMPT, store, list(setups), fresh=fresh, say=said.append
    )
    return policy, said, line


def test_the_cost_model_is_measured_once_then_read(models, tmp_path) -> None:
    store = StepCache(tmp_path)
    first, said, line = start(models, store)
    # a line before measuring and one per batch size (1, 2, 4), then the summary
    assert said[0].startswith("cost model: measuring")
    assert [s.split(" measured")[0] for s in said[1:]] == [
        "cost model: batch size 1",
        "cost model: batch size 2",
        "cost model: batch size 4",
    ]
    assert "measured" in line and "recorded" in line
    assert set(first.cells) == {(b, g) for b in (1, 2, 4) for g in range(3)}
    second, said_again, line_again = start(models, store)
    assert said_again == [] and "as measured here on" in line_again
    assert second.cells == first.cells
    assert (second.accepted_mass, second.positions) == (first.accepted_mass, first.positions)
    assert second.table() == first.table()


def test_another_set_up_or_recalibrate_measures_again(models, tmp_path) -> None:
    store = StepCache(tmp_path)
    start(models, store)
    assert start(models, store, setups=("compiled",))[1]  # another set-up: measured
    assert start(models, store, max_rows=2)[1]  # another batch bound: measured
    assert start(models, store, fresh=True)[1]  # --recalibrate
    assert not start(models, store)[1]  # and the first set-up's record stays


def test_a_record_that_does_not_fit_is_measured_again(models, tmp_path) -> None:
    store = StepCache(tmp_path)
    start(models, store)
    path = tmp_path / calibration.SERVING_COSTS
    known = json.loads(path.read_text())
    for records in known.values():
        for record in records.values():
            record["cells"] = record["cells"][:-1]  # a cell missing
    path.write_text(json.dumps(known))
    policy, said, _ = start(models, store)
    assert said and len(policy.cells) == 9
    path.write_text("not json")
    assert start(models, store)[1]


def test_a_snapshot_restores_only_into_a_policy_of_its_shape() -> None:
    policy = LoadGamma(2, 2)
    for b in (1, 2):
        for g in range(3):
            policy.record(b, g, [0.001 * g, 0.01 * b, 0.0005])
    policy.accepted_mass, policy.positions = 3.5, 7.0
    record = json.loads(json.dumps(policy.snapshot()))
    same = LoadGamma(2, 2)
    assert same.restore(record) and same.cells == policy.cells and same.alpha == policy.alpha
    assert not LoadGamma(3, 2).restore(record)  # another gamma_max
    assert not LoadGamma(2, 4).restore(record)  # other batch sizes
    assert not LoadGamma(2, 2).restore({"cells": "x"})
