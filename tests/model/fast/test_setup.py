"""Choosing a model's decoding set-up by measurement (model/fast/setup.py): the fastest measured
candidate is the one kept, each set-up is what its name says, and what cannot be measured
or does not apply is said, not guessed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import model.fast.setup as setup_lib
from model import call as calls
from model.fast.compile import CompileError, compile_for_decoding
from model.fast.prepack import MIN_ELEMENTS, PrepackedLinear, prepack_supported
from model.fast.setup import (
    SETUPS,
    SetupChoice,
    Setups,
    apply_setup,
    cacheable,
    candidates,
    choose_setup,
    choose_setups,
    row_buckets,
    tree_sizes,
)
from model.scale.quantize import quantize_int8
from model.scale.tensor_parallel import parallelize
from speculative.verify.tree import branching_parents
from tests.support.toy_models import random_eagle3_head, random_head, random_llama

torch.set_num_threads(1)


def kinds(model: torch.nn.Module) -> set[str]:
    attention = model.layers[0].self_attn
    out = {"stacked" if getattr(attention, "qkv_proj", None) is not None else "separate"}
    if any(isinstance(m, PrepackedLinear) for m in model.modules()):
        out.add("packed")
    return out


def small() -> torch.nn.Module:
    return random_llama(
        vocab=16, dim=512, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=512, max_seq_len=32
    )


def test_each_setup_is_what_its_name_says() -> None:
    for name, expected in (("plain", {"separate"}), ("stacked", {"stacked"})):
        model = small()
        assert apply_setup(model, name, (1,), 24) == 0.0 and kinds(model) == expected
    if prepack_supported():
        model = small()
        apply_setup(model, "prepacked", (1,), 24)
        assert kinds(model) == {"stacked", "packed"}
    with pytest.raises(ValueError, match="setup must be one of"):
        apply_setup(small(), "fastest", (1,), 24)


@pytest.mark.parametrize("fastest", ["plain", "stacked", "prepacked"])
def test_the_fastest_measured_candidate_is_kept(
    fastest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """step_ms is replaced by a clock that makes ``fastest`` the fastest: the chooser must keep
    that set-up's model (seen in its structure) and report every time it took."""
    if fastest == "prepacked" and not prepack_supported():
        pytest.skip("prepacking needs oneDNN")
    times = {"plain": 3.0, "stacked": 2.0, "prepacked": 2.5}
    times[fastest] = 1.0

    def fake_step_ms(model, widths, hidden, calls=15):
        packed = any(isinstance(m, PrepackedLinear) for m in model.modules())
        stacked = getattr(model.layers[0].self_attn, "qkv_proj", None) is not None
        if packed:
            return times["prepacked"]
        if stacked:
            return times["stacked"]
        return times["plain"]

    monkeypatch.setattr(setup_lib, "step_ms", fake_step_ms)
    model, choice = choose_setup(small(), ("plain", "stacked", "prepacked"), (1, 3), 24)
    assert choice.chosen == fastest and choice.times_ms == times and choice.widths == 2
    assert (
        kinds(model)
        == {"plain": {"separate"}, "stacked": {"stacked"}, "prepacked": {"stacked", "packed"}}[
            fastest
        ]
    )
    assert choice.line("target").endswith(f"-> {fastest}")
    with torch.inference_mode():  # the kept model decodes
        model.setup_cache(1, 24)
        assert model(torch.tensor([[1, 2, 3]]), calls.chain(0, 3, "cpu")).shape == (1, 3, 16)


def test_one_candidate_or_a_large_model_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        setup_lib, "step_ms", lambda *a, **k: pytest.fail("nothing should be timed")
    )
    model, choice = choose_setup(small(), ("stacked",), (1,), 24)
    assert (
        choice.chosen == "stacked"
        and not choice.times_ms
        and "only set-up asked for" in choice.line("draft")
    )
    monkeypatch.setattr(setup_lib, "MAX_COPY_BYTES", 1)
    model, choice = choose_setup(small(), ("plain", "stacked"), (1,), 24)
    assert choice.chosen == "stacked" and "too large to time copies" in choice.why


def test_a_setup_that_does_not_apply_is_refused() -> None:
    model = random_llama(
        vocab=16, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32, dtype=torch.float64
    )
    with pytest.raises(ValueError, match="prepacked set-up does not apply"):
        choose_setup(model, ("prepacked",), (1,), 24)
    assert set(SETUPS) == {"plain", "stacked", "prepacked", "compiled"}


# ----------------------------------------------------------------------------- a run's models
def test_row_buckets_and_tree_sizes_by_hand() -> None:
    assert row_buckets(1) == (1,) and row_buckets(2) == (1, 2) and row_buckets(5) == (1, 2, 4, 5)
    assert row_buckets(8) == (1, 2, 4, 8)
    assert tree_sizes((3, 2, 1, 1)) == [3, 9, 15, 21]  # 3, then 2 after each, then 1 and 1
    assert tree_sizes((2,)) == [2] and tree_sizes(()) == []
    for shape in ((3, 2, 1, 1), (4, 2, 1, 1, 1), (1, 3, 2)):  # the tree module's own count agrees
        assert tree_sizes(shape) == [
            len(branching_parents(shape[:d])) for d in range(1, len(shape) + 1)
        ]


def test_what_a_setup_request_names() -> None:
    assert candidates("measure") == ("plain", "stacked", "prepacked")
    assert candidates("measure-all") == SETUPS and candidates("stacked") == ("stacked",)


def test_the_compile_note_weighs_the_compile_time_against_the_run() -> None:
    """2 s of compiling; the compiled target saves 1 ms a call (3 widths summed 3 ms) and the draft nothing."""
    target = SetupChoice("compiled", {"plain": 9.0, "compiled": 6.0}, compile_s=1.5, widths=3)
    draft = SetupChoice("compiled", {"stacked": 2.0, "compiled": 2.5}, compile_s=0.5, widths=3)
    setups = Setups(None, None, [("target", target), ("draft", draft)])
    assert target.compile_saving_s() == pytest.approx(1e-3) and draft.compile_saving_s() == 0
    note = setups.compile_note(1000)  # saves 1.0 s < 2.0 s
    assert note.startswith(
        "compiling took 2.0s and saves at most 1.0s over 1000 tokens: this run does not pay"
    )
    assert setups.compile_note(3000) is None  # saves 3 s
    # nothing compiled
    assert (
        Setups(
            None, None, [("target", SetupChoice("stacked", {"plain": 1.0, "stacked": 0.5}))]
        ).compile_note(1)
        is None
    )
    assert setups.lines == [target.line("target"), draft.line("draft")]


def test_choose_setups_returns_the_models_to_decode_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chosen copies come back; the models given are not changed; a draft is timed for widths
    1 and 2, the target for its widths, both at the tree's calls."""
    timed: list[tuple[str, tuple[int, ...]]] = []

    def fake_step_ms(model, widths, hidden, calls=15):
        stacked = getattr(model.layers[0].self_attn, "qkv_proj", None) is not None
        timed.append((model.config.dim, tuple(widths), hidden))
        return 1.0 if stacked else 2.0  # stacking wins

    monkeypatch.setattr(setup_lib, "step_ms", fake_step_ms)
    target, draft = (
        small(),
        random_llama(vocab=16, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32),
    )
    setups = choose_setups(target, ("plain", "stacked"), (1, 2, 5), 24, draft=draft, batch=3)
    # the timed copies, not patched models
    assert setups.target is not target and setups.draft is not draft
    assert kinds(setups.target) == kinds(setups.draft) == {"stacked"} and kinds(target) == {
        "separate"
    }
    assert [name for name, _ in setups.choices] == ["target", "draft"]
    assert timed == [(512, (1, 2, 5), False)] * 2 + [(32, (1, 2), False)] * 2
    alone = choose_setups(target, ("stacked",), (1,), 24)
    # one set-up: applied
    assert alone.draft is None and alone.target is target and kinds(target) == {"stacked"}
    assert alone.lines == ["target: stacked (the only set-up asked for)"]


def test_a_feature_head_is_compiled_with_its_target_for_the_drafter_s_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compile_for_decoding replaced by a recorder: the target is compiled for its widths with
    features, the rows' buckets and the whole tree's call; the head, untimed, for the same widths
    and the drafter's tree calls. An eager target leaves the head alone."""

    compiled = []

    def fake_compile(
        model, widths, rows=(1,), cache_len=None, hidden=False, mode=None, tree_widths=(), **store
    ):
        compiled.append(
            (type(model).__name__, tuple(widths), tuple(rows), hidden, tuple(tree_widths))
        )
        return SimpleNamespace(compile_s=0.5)

    monkeypatch.setattr(setup_lib, "compile_for_decoding", fake_compile)
    target = random_llama(vocab=16, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64)
    head = random_head(target)
    setups = choose_setups(target, ("compiled",), (1, 2, 5), 40, head=head, batch=3, tree=(3, 2, 1))
    assert compiled == [
        ("Llama", (1, 2, 5), (1, 2, 3), True, (16,)),
        ("FeatureHead", (1, 2, 5), (1, 2, 3), False, (3, 9)),
    ]
    assert [name for name, _ in setups.choices] == ["target", "head"] and setups.draft is None
    assert setups.choices[1][1].line("head") == "head: compiled (as its target; compiled in 0.5s)"
    compiled.clear()
    choose_setups(target, ("stacked",), (1, 2, 5), 40, head=head)
    assert compiled == []


@pytest.mark.skipif(
    not prepack_supported(), reason="this PyTorch build cannot prepack float32 weights here"
)
def test_a_compiled_eagle3_head_prepacks_the_products_outside_its_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An EAGLE-3 head compiled with its target: its fc (the features' projection) and output layer run
    eagerly at every draft step and are prepacked; the block's products, which the compiled step holds,
    stay plain, however large."""
    monkeypatch.setattr(
        setup_lib, "compile_for_decoding", lambda *args, **kwargs: SimpleNamespace(compile_s=0.5)
    )
    target = random_llama(
        vocab=1024, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=1024, max_seq_len=64
    )
    head = random_eagle3_head(target)
    choose_setups(target, ("compiled",), (1, 2, 5), 40, head=head)
    assert isinstance(head.fc, PrepackedLinear) and isinstance(head.lm_head, PrepackedLinear)
    block = [m for m in head.layers.modules() if isinstance(m, (torch.nn.Linear, PrepackedLinear))]
    assert any(m.weight.numel() >= MIN_ELEMENTS for m in block) and all(
        type(m) is torch.nn.Linear for m in block
    )


def test_int8_and_tensor_parallel_models_are_told_apart_without_their_classes() -> None:
    """model/fast imports nothing of model/scale (pyproject.toml's contract): int8 weights are
    known by their dtype and a tensor-parallel layer by its mark, here on models that model/scale
    itself made. Neither is kept in the compiled-step cache, and a shard is not compiled."""
    assert cacheable(small())
    assert not cacheable(quantize_int8(small()))
    # this rank's layers, built and never called: no process group needed
    shard = parallelize(small(), 2)
    assert not cacheable(shard)
    with pytest.raises(CompileError, match="tensor-parallel models are not compiled"):
        compile_for_decoding(shard, (1,))
