"""The one gamma policy (speculative.engine.gamma_policy): which mechanism decides, in what order,
within what room, and the guard's one type from the command line to the engine."""

from __future__ import annotations

import pytest
import torch

from speculative import speculative_generate
from speculative.engine import Engine
from speculative.engine.gamma import AutoGamma, FixedGamma, Switch
from speculative.engine.gamma_policy import OFF, RECORDED, TIMED, GammaPolicy, Guard
from speculative.engine.trees import AutoTree
from speculative.serving.loop import EngineLoop
from speculative.serving.policy import LoadGamma
from tests.support.toy_models import noisy_copy, random_llama


@pytest.fixture(scope="module")
def pair() -> dict:
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    return {"target": target, "draft": noisy_copy(target, std=0.3, seed=1)}


# ----------------------------------------------------------------------------- the guard's one type
def test_the_guard_s_short_forms_are_one_type() -> None:
    assert Guard.of(False) == OFF and Guard.of(None) == OFF and Guard.of(()) == OFF
    assert Guard.of(True) == TIMED
    assert Guard.of((1.0, 2.5)) == Guard("recorded", (1.0, 2.5))
    assert Guard.of(TIMED) is TIMED
    assert not OFF.on and TIMED.on and RECORDED.on


def test_a_guard_that_cannot_be_is_refused() -> None:
    with pytest.raises(ValueError, match="one of off, timed, recorded"):
        Guard("sometimes")
    with pytest.raises(ValueError, match="takes no recorded costs"):
        Guard("timed", (1.0, 2.0))
    with pytest.raises(ValueError, match="needs its costs"):
        GammaPolicy(4, guard=RECORDED)  # the command line reads them before the engine is built


# ----------------------------------------------------------------------------- who decides
def test_each_setting_names_the_mechanism_that_decides(pair: dict) -> None:
    target, draft = pair["target"], pair["draft"]
    cases = [
        (Engine(target, None), "none", None),
        (Engine(target, draft, gamma=3), "fixed", None),
        (Engine(target, draft, gamma="auto"), "auto", AutoGamma),
        (Engine(target, draft, gamma=3, guard=True), "guard (timed)", Switch),
        (Engine(target, draft, gamma=3, guard=(1e-3, 2e-3)), "guard (recorded costs)", Switch),
        (Engine(target, draft, tree=(2, 1)), "tree", None),
        (Engine(target, draft, tree=(2, 1), guard=True), "guard (timed)", Switch),
        (Engine(target, draft, tree="auto"), "tree auto", None),
    ]
    for engine, name, switch in cases:
        assert engine.gamma_policy.name == name
        if switch is None:
            assert engine.gamma_policy.switch is None, name
        else:
            assert type(engine.gamma_policy.switch) is switch, name
    recorded = Engine(target, draft, gamma=3, guard=(1e-3, 2e-3)).gamma_policy.switch
    assert recorded.recorded == (1e-3, 2e-3)
    assert Engine(target, draft, tree="auto").gamma_policy.tree_auto is not None


class Rows:
    """Just what GammaPolicy.choose reads of an engine and its rows."""

    def __init__(self, room: list[int], pinned: list[int | None], iterations: int = 5) -> None:
        self.rooms = dict(zip(range(len(room)), room))
        self.rows = [type("Row", (), {"gamma": g, "index": b})() for b, g in enumerate(pinned)]
        self.stats = type("Stats", (), {"iterations": iterations})()

    def room(self, row: object) -> int:
        return self.rooms[row.index]


def test_a_pinned_gamma_wins_then_the_outside_then_the_switch_then_the_fixed_gamma() -> None:
    policy = GammaPolicy(4, guard=TIMED)
    engine = Rows(room=[10, 10, 10], pinned=[1, None, 0])
    policy.switch.choose = lambda iteration: 2  # what the guard would say this iteration
    assert policy.choose(engine, engine.rows).gammas == [1, 2, 0]
    asked = []
    policy.steer(lambda e: asked.append(e) or 3, "load")
    assert policy.choose(engine, engine.rows).gammas == [1, 3, 0]
    assert asked == [engine]  # asked once: the pinned rows do not ask
    assert policy.name == "load"
    policy.steer(None)
    assert policy.name == "guard (timed)"
    assert GammaPolicy(4).choose(engine, engine.rows).gammas == [1, 4, 0]


def test_the_choice_stays_within_each_row_s_room_and_the_most() -> None:
    policy = GammaPolicy(4)
    engine = Rows(room=[2, 0, -1, 10], pinned=[None, None, None, None])
    assert policy.choose(engine, engine.rows).gammas == [2, 0, 0, 4]
    policy.steer(FixedGamma(9))  # more than the engine drafts at most
    assert policy.choose(engine, engine.rows).gammas == [2, 0, 0, 4]
    assert policy.last.gammas == [2, 0, 0, 4]  # readable from outside


def test_a_tree_s_shape_is_chosen_only_where_it_drafts() -> None:
    policy = GammaPolicy(3, tree=(2, 1, 1), tree_auto=True)
    chosen = []
    policy.tree_auto = AutoTree(shapes=((1,), (2, 1, 1)))
    real = policy.tree_auto.choose
    policy.tree_auto.choose = lambda i, counts: chosen.append(i) or real(i, counts)
    row_stats = type("Stats", (), {"tree_shapes": {}})()
    engine = Rows(room=[0], pinned=[None], iterations=7)
    engine.rows[0].stats = row_stats
    assert policy.choose(engine, engine.rows).shape is None and chosen == []  # no room: no tree
    engine.rooms[0] = 5
    choice = policy.choose(engine, engine.rows)
    assert chosen == [7] and choice.shape in ((1,), (2, 1, 1))
    named = GammaPolicy(3, tree=(2, 1, 1))
    assert named.choose(engine, engine.rows).shape == (2, 1, 1)


# ----------------------------------------------------------------------------- seen from outside
def test_the_policy_is_in_each_row_s_statistics(pair: dict) -> None:
    target, draft = pair["target"], pair["draft"]
    for kwargs, name in [
        ({"gamma": 2}, "fixed"),
        ({"gamma": "auto"}, "auto"),
        ({"gamma": 2, "guard": (1e-3, 1.5e-3)}, "guard (recorded costs)"),
    ]:
        out = speculative_generate(target, draft, [1, 2], 6, temperature=0, **kwargs)
        assert out.stats.gamma_policy == name
        assert out.stats.to_dict()["gamma_policy"] == name


def test_a_server_s_chooser_is_named_by_its_kind(pair: dict) -> None:
    target, draft = pair["target"], pair["draft"]
    for chooser, name in [
        (LoadGamma(4, 2), "load"),
        (FixedGamma(0), "off"),
        (FixedGamma(3), "fixed"),
        (lambda engine: 1, "outside"),
        (None, "fixed"),  # the engine's own: its fixed gamma
    ]:
        engine = Engine(target, draft, gamma=4, max_rows=2)
        EngineLoop(engine, policy=chooser)
        assert engine.gamma_policy.name == name
        assert engine.policy is chooser
