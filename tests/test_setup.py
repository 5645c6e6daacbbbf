"""Choosing a model's decoding set-up by measurement (model/setup.py): the fastest measured
candidate is the one kept, each set-up is what its name says, and what cannot be measured
or does not apply is said, not guessed."""

from __future__ import annotations

import pytest
import torch
from toy_models import random_llama

import model.setup as setup_lib
from model.prepack import PrepackedLinear, prepack_supported
from model.setup import SETUPS, apply_setup, choose_setup
from speculative import calls

torch.set_num_threads(1)


def kinds(model: torch.nn.Module) -> set[str]:
    attention = model.layers[0].self_attn
    out = {"stacked" if attention.qkv_proj is not None else "separate"}
    if any(isinstance(m, PrepackedLinear) for m in model.modules()):
        out.add("packed")
    return out


def small() -> torch.nn.Module:
    return random_llama(vocab=16, dim=512, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=512, max_seq_len=32)


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
def test_the_fastest_measured_candidate_is_kept(fastest: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """step_ms is replaced by a clock that makes ``fastest`` the fastest: the chooser must keep
    that set-up's model (seen in its structure) and report every time it took."""
    if fastest == "prepacked" and not prepack_supported():
        pytest.skip("prepacking needs oneDNN")
    times = {"plain": 3.0, "stacked": 2.0, "prepacked": 2.5}
    times[fastest] = 1.0

    def fake_step_ms(model, widths, hidden, calls=15):
        packed = any(isinstance(m, PrepackedLinear) for m in model.modules())
        name = "prepacked" if packed else "stacked" if model.layers[0].self_attn.qkv_proj is not None else "plain"
        return times[name]

    monkeypatch.setattr(setup_lib, "step_ms", fake_step_ms)
    model, choice = choose_setup(small(), ("plain", "stacked", "prepacked"), (1, 3), 24)
    assert choice.chosen == fastest and choice.times_ms == times and choice.widths == 2
    assert kinds(model) == {"plain": {"separate"}, "stacked": {"stacked"}, "prepacked": {"stacked", "packed"}}[fastest]
    assert choice.line("target").endswith(f"-> {fastest}")
    with torch.inference_mode():  # the kept model decodes
        model.setup_cache(1, 24)
        assert model(torch.tensor([[1, 2, 3]]), calls.chain(0, 3, "cpu")).shape == (1, 3, 16)


def test_one_candidate_or_a_large_model_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(setup_lib, "step_ms", lambda *a, **k: pytest.fail("nothing should be timed"))
    model, choice = choose_setup(small(), ("stacked",), (1,), 24)
    assert choice.chosen == "stacked" and not choice.times_ms and "only set-up asked for" in choice.line("draft")
    monkeypatch.setattr(setup_lib, "MAX_COPY_BYTES", 1)
    model, choice = choose_setup(small(), ("plain", "stacked"), (1,), 24)
    assert choice.chosen == "stacked" and "too large to time copies" in choice.why


def test_a_setup_that_does_not_apply_is_refused() -> None:
    model = random_llama(vocab=16, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32, dtype=torch.float64)
    with pytest.raises(ValueError, match="prepacked set-up does not apply"):
        choose_setup(model, ("prepacked",), (1,), 24)
    assert set(SETUPS) == {"plain", "stacked", "prepacked", "compiled"}
