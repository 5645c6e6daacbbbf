"""A drafter with files of its own touches its file and its test folder, nothing else: found from an
installed package's entry point (simulated here) or ``--draft MODULE:OBJECT``, its folder recognized
by ``--draft FOLDER``, proven by the checker and run by the command line."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from speculative.draft import DRAFTERS
from speculative.proofs import main as prove
from tests.support.cli import main_json, needs_pair

MODULE = f"{__package__}.unigram_drafter"


@pytest.fixture()
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The drafter as an installed package would offer it: an entry point of the group the registry reads,
    nothing imported until a name or a folder asks for it."""
    sys.modules.pop(MODULE, None)
    DRAFTERS.pop("unigram", None)
    point = importlib.metadata.EntryPoint("unigram", f"{MODULE}:KIND", "speculative_llama.drafters")
    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda **kw: [point] if kw.get("group") == "speculative_llama.drafters" else real(**kw),
    )
    yield
    DRAFTERS.pop("unigram", None)
    sys.modules.pop(MODULE, None)


@needs_pair
def test_its_folder_runs_through_the_command_line(
    installed: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from weights import load_model

    vocab = load_model("tiny-target").config.vocab_size
    assert "unigram" not in DRAFTERS  # nothing registered it yet
    module = importlib.import_module(MODULE)
    DRAFTERS.pop("unigram")  # as if never imported: the folder must find it through the entry point
    sys.modules.pop(MODULE)
    folder = module.save(torch.linspace(-3, 3, vocab), tmp_path / "unigram")
    argv = ["--max-new-tokens", "16", "--threads", "1"]
    alone, _ = main_json(capsys, [*argv, "--no-draft"])
    drafted, _ = main_json(capsys, [*argv, "--draft", str(folder), "--gamma", "2"])
    assert drafted["tokens"] == alone["tokens"] and drafted["stats"]["drafted_tokens"] > 0
    sampled, _ = main_json(
        capsys, [*argv, "--draft", str(folder), "--temperature", "1", "--seed", "2"]
    )
    assert len(sampled["tokens"]) == 16


def test_the_checker_proves_it_by_name(installed: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert prove(["unigram", "--quick"]) == 0, capsys.readouterr().out
    assert "PASS: all" in capsys.readouterr().out


@needs_pair
def test_a_drafter_class_by_module_and_name(capsys: pytest.CaptureFixture[str]) -> None:
    """--draft MODULE:OBJECT: a drafter class of one's own, no registration written."""
    spec = f"{__package__}.toy_drafter:RepeatDrafter"
    try:
        argv = ["--max-new-tokens", "12", "--threads", "1"]
        alone, _ = main_json(capsys, [*argv, "--no-draft"])
        drafted, _ = main_json(capsys, [*argv, "--draft", spec])
        assert drafted["tokens"] == alone["tokens"] and drafted["stats"]["drafted_tokens"] > 0
    finally:
        DRAFTERS.pop(spec, None)
        DRAFTERS.pop("repeat", None)
        sys.modules.pop(f"{__package__}.toy_drafter", None)
