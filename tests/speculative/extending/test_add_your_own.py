"""The steps of docs/layout.md, "Add your own", done with a toy drafter and a toy rule: one file
each (toy_drafter.py, toy_rule.py), one registration each, and this folder. Each then works by
name through the command line (generate.py --draft / --verify) and the checker
(python -m speculative.prove NAME), which also rejects a broken variant of the rule.

The toys are imported inside a fixture and taken out of the registries afterwards, so that no
other test of the session sees them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator

import pytest

from speculative.draft import DRAFTERS, DrafterKind, register_drafter
from speculative.proofs import main as prove
from speculative.verify import RULES, register_rule
from tests.support.cli import main_json, main_ok, needs_pair


@pytest.fixture(scope="module")
def toys() -> Iterator[None]:
    names = [f"{__package__}.toy_drafter", f"{__package__}.toy_rule"]
    for name in names:
        importlib.import_module(name)
    yield
    DRAFTERS.pop("repeat", None)
    RULES.pop("product", None)
    for name in names:
        sys.modules.pop(name, None)


def test_one_registration_each_and_no_name_twice(toys: None) -> None:
    assert "repeat" in DRAFTERS and "product" in RULES
    with pytest.raises(ValueError, match="registered already"):
        register_drafter(
            DrafterKind(
                "repeat", "again", build=lambda network, target: None, toy=lambda target: None
            )
        )
    with pytest.raises(ValueError, match="registered already"):
        register_rule("product", RULES["product"].verify, "again")


def test_the_checker_proves_them_by_name(toys: None, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("repeat", "product"):
        assert prove([name, "--quick"]) == 0, capsys.readouterr().out
        assert "PASS: all" in capsys.readouterr().out


def test_the_checker_rejects_a_broken_rule(toys: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert prove([f"{__package__}.toy_rule:broken_rule", "--quick", "--only", "exact"]) == 1
    assert "FAIL" in capsys.readouterr().out


@needs_pair
def test_the_command_line_runs_them_by_name(toys: None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--max-new-tokens", "24", "--threads", "1"]
    alone, _ = main_json(capsys, [*argv, "--no-draft"])
    drafted, _ = main_json(capsys, [*argv, "--draft", "repeat"])
    assert drafted["tokens"] == alone["tokens"]  # greedy: the target's tokens, whatever the drafter
    assert drafted["stats"]["drafted_tokens"] > 0
    judged, err = main_json(capsys, [*argv, "--verify", "product", "--temperature", "0"])
    # greedy=False: the rule judged one-hot p and q itself
    assert judged["tokens"] == alone["tokens"]
    assert not any("--verify" in line for line in err)  # nothing to warn about: the rule ran
    sampled, _ = main_json(
        capsys, [*argv, "--verify", "product", "--temperature", "1", "--seed", "3"]
    )
    assert len(sampled["tokens"]) == 24
    # a rule that gives way at T = 0 says so
    _, err = main_ok(capsys, [*argv, "--verify", "block", "--no-color"])
    assert "note: at temperature 0, --verify block is the comparison of argmaxes" in "\n".join(err)
