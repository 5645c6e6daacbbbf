"""--draft when none is named (weights.load.default_draft): the shipped pair's draft for the shipped target,
the shipped head trained for a model of the target's shape where there is one, and a clear error, naming the
default, where the target has that shape but other weights (its fingerprint)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

import weights.load
import weights.registry
from model import ModelConfig
from model.eagle3_head import Eagle3Head, default_layers
from weights import CheckpointError, load_model, save_model
from weights.eagle3 import save_eagle3_head
from weights.load import DEFAULT_DRAFT, default_draft, load_named_pair, read_named_pair
from weights.registry import WEIGHTS_DIR


@pytest.fixture
def shipped_for_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A weights/ folder whose one head for other targets was made for tiny-target."""
    target = load_model("tiny-target")
    config = ModelConfig(**{**vars(target.config), "n_layers": 1, "extra": {}})
    head = Eagle3Head(config, default_layers(target.config.n_layers), draft_vocab=64)
    head.set_vocabulary(torch.arange(64))
    save_eagle3_head(head, tmp_path / "weights" / "head", target, target_name="tiny-target")
    monkeypatch.setattr(weights.load, "WEIGHTS_DIR", tmp_path / "weights")
    monkeypatch.setattr(weights.load, "FOR_OTHER_TARGETS", ("head",))
    # where names are found
    monkeypatch.setattr(weights.registry, "WEIGHTS_DIR", tmp_path / "weights")
    monkeypatch.setattr(weights.registry, "SHIPPED", ("head",))
    return tmp_path


def test_a_target_of_the_head_s_shape_gets_the_head_and_others_the_pair_s_draft(
    shipped_for_tiny: Path,
) -> None:
    assert default_draft(WEIGHTS_DIR / "tiny-target") == "head"
    assert default_draft(WEIGHTS_DIR / "tiny-draft") == DEFAULT_DRAFT  # another shape
    # the pair's reading says what is wrong
    assert default_draft(shipped_for_tiny / "missing") == DEFAULT_DRAFT


def test_the_default_head_for_another_model_of_its_shape_is_refused_naming_the_default(
    shipped_for_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = copy.deepcopy(load_model(WEIGHTS_DIR / "tiny-target"))
    with torch.no_grad():
        other.norm.weight.mul_(1.5)  # the same shape, other weights
    folder = save_model(other, shipped_for_tiny / "other")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        if (WEIGHTS_DIR / "tiny-target" / name).exists():
            shutil.copy(WEIGHTS_DIR / "tiny-target" / name, folder / name)
    with pytest.raises(CheckpointError, match="fingerprint mismatch.*--draft defaulted to head"):
        named = read_named_pair(str(folder), None, 4, gamma_given=False)
        load_named_pair(
            named,
            torch.device("cpu"),
            torch.float32,
            positions=32,
            rows=1,
            gamma=4,
            gamma_max=4,
            flag="--setup",
        )


def test_the_default_head_brings_its_own_draft_length_unless_one_is_given(
    shipped_for_tiny: Path,
) -> None:
    """speculators' proposal_methods[0].speculative_tokens (what vLLM drafts by default) is --gamma's default
    for the default head; a --gamma given, or a head named, keeps --gamma."""
    config = shipped_for_tiny / "weights" / "head" / "config.json"
    data = json.loads(config.read_text())
    data["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 3
    config.write_text(json.dumps(data))
    target = str(WEIGHTS_DIR / "tiny-target")
    defaulted = read_named_pair(target, None, 4, gamma_given=False)
    assert defaulted.draft == "head" and defaulted.spec.draft == "head" and defaulted.gamma == 3
    assert defaulted.defaulted
    assert read_named_pair(target, None, 6, gamma_given=True).gamma == 6
    named = read_named_pair(target, "lookup", 4, gamma_given=False)
    assert named.gamma == 4 and not named.defaulted
    alone = read_named_pair(target, "lookup", 4, no_draft=True, gamma_given=False)
    assert alone.draft is None and alone.spec.kind is None and not alone.defaulted


@pytest.mark.parametrize(
    "draft, gamma, widths",
    [
        ("lookup", 4, (1, 2, 5)),  # a fixed draft length: its one verification width
        ("suffix", 16, (1, 2, 3, 5, 9, 17)),  # chains of any length: the ladder
        ("suffix", 6, (1, 2, 3, 5, 7)),
    ],
)
def test_a_drafter_whose_length_varies_is_compiled_for_the_ladder_of_widths(
    draft: str, gamma: int, widths: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = []
    monkeypatch.setattr(
        weights.load.Pair, "set_up", lambda self, setup, widths, *a, **k: asked.append(widths)
    )
    named = read_named_pair(str(WEIGHTS_DIR / "tiny-target"), draft, gamma, gamma_given=True)
    load_named_pair(
        named,
        torch.device("cpu"),
        torch.float32,
        positions=64,
        rows=1,
        gamma=gamma,
        gamma_max=gamma,
        flag="--setup",
    )
    assert asked == [widths]


@pytest.mark.parametrize(
    "measured, default",
    [({}, "head"), ({"head": "suffix"}, "suffix"), ({"head": "hybrid"}, "suffix+head")],
)
def test_a_measured_default_replaces_the_head_and_hybrid_keeps_the_head(
    shipped_for_tiny: Path, monkeypatch: pytest.MonkeyPatch, measured: dict, default: str
) -> None:
    monkeypatch.setattr(weights.load, "MEASURED_DEFAULTS", measured)
    target = str(WEIGHTS_DIR / "tiny-target")
    assert weights.load.own_drafter(target) == "head"
    assert default_draft(target) == default
    assert weights.load.named_draft(target, "hybrid") == "suffix+head"
