"""generate.py with every drafter and verification rule: --draft lookup, --draft with a feature
head, --verify block, --tree; their greedy output is the target's own, and their bad
inputs are one error line with exit status 2 (or one warning where a flag changes nothing).

Runs go in-process through ``generate.main(argv)`` with --json (one document on stdout),
in float64 where tokens are compared, so that the greedy identity is exact (docs/algorithm.md,
numerics policy).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

import generate
from tests.support.cli import TARGET, main_error, needs_pair

NEW = "24"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict[str, Any], str]:
    status = generate.main(["--target", str(TARGET), "--max-new-tokens", NEW, "--json", *argv])
    out = capsys.readouterr()
    assert status == 0, out.err
    return json.loads(out.out), out.err


@pytest.fixture(scope="module")
def alone_float64() -> list[int]:
    """The target's own greedy tokens in float64 (module-scoped, so without capsys)."""
    if not (TARGET / "config.json").is_file():
        pytest.skip("the shipped target is absent")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert (
            generate.main(
                [
                    "--target",
                    str(TARGET),
                    "--no-draft",
                    "--max-new-tokens",
                    NEW,
                    "--dtype",
                    "float64",
                    "--json",
                ]
            )
            == 0
        )
    return json.loads(buffer.getvalue())["tokens"]


@needs_pair
@pytest.mark.parametrize(
    "argv",
    [
        ["--draft", "lookup"],
        ["--draft", "lookup", "--gamma", "auto"],
        ["--verify", "block"],
        ["--tree", "3,2,1,1"],
        ["--tree", "2,2", "--tree-mode", "iid"],
        ["--tree", "auto"],
    ],
)
def test_greedy_output_is_the_target_alone(
    capsys: pytest.CaptureFixture[str], alone_float64: list[int], argv: list[str]
) -> None:
    doc, _ = run(capsys, "--dtype", "float64", *argv)
    assert doc["tokens"] == alone_float64
    assert doc["stats"]["tokens_per_target_call"] >= 1
    # what auto chose, by shape
    assert bool(doc["stats"]["tree_shapes"]) == (argv == ["--tree", "auto"])


@needs_pair
def test_a_feature_head_drafts_and_greedy_is_the_target_alone(
    capsys: pytest.CaptureFixture[str], alone_float64: list[int], head_folder: Path
) -> None:
    for extra in ([], ["--tree", "2,1"]):
        doc, _ = run(capsys, "--dtype", "float64", "--draft", str(head_folder), *extra)
        assert doc["tokens"] == alone_float64
        assert doc["stats"]["draft_calls"] > 0 and doc["settings"]["draft"] == str(head_folder)


@needs_pair
@pytest.mark.parametrize(
    "argv",
    [
        ["--verify", "block", "--temperature", "1", "--seed", "3"],
        ["--tree", "3,2,1", "--temperature", "1", "--seed", "3"],
        ["--tree", "2,2", "--tree-mode", "deterministic", "--temperature", "0.8", "--seed", "1"],
        ["--draft", "lookup", "--temperature", "1", "--seed", "2"],
    ],
)
def test_sampled_runs_with_every_rule_complete_and_repeat(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    first, _ = run(capsys, *argv)
    second, _ = run(capsys, *argv)
    assert len(first["tokens"]) == int(NEW) and first["tokens"] == second["tokens"]
    assert first["stats"]["stop_reason"] == "max_new_tokens"


@needs_pair
def test_the_invariant_rule_repeats_a_seed_whatever_the_drafter(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--verify invariant (speculative.verify.invariant): for a seed, the same sampled tokens with
    the tiny draft at gamma 1 and 4 and with prompt lookup (float64: no near-tie can flip a token)."""
    same = ["--dtype", "float64", "--verify", "invariant", "--temperature", "1", "--seed", "3"]
    runs = [
        run(capsys, *same, *argv)[0]["tokens"]
        for argv in (["--gamma", "1"], ["--gamma", "4"], ["--draft", "lookup"])
    ]
    assert len(runs[0]) == int(NEW) and runs[0] == runs[1] == runs[2]


@needs_pair
@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--tree", "3,x"], ["--tree", "3,2,1,1"]),
        (["--tree", "0,2"], ["--tree", "integers >= 1"]),
        (["--tree", ""], ["--tree"]),
        (["--draft", "lookup", "--tree", "2,2"], ["--tree", "lookup"]),
        (["--draft", "lookup", "--tree", "auto"], ["--tree", "lookup"]),
        (["--tree", "best"], ["--tree", "or auto"]),
        (["--tree", "8,8,8"], ["584 nodes", "context"]),
        (["--tree", "2,2", "--verify", "block"], ["block verification", "chain"]),
        (["--verify", "blocks"], ["--verify", "invalid choice"]),
    ],
)
def test_bad_tree_and_verify_inputs(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragments: list[str]
) -> None:
    main_error(capsys, ["--target", str(TARGET), "--max-new-tokens", "4", *argv], *fragments)


@needs_pair
def test_a_head_for_another_target_is_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, head_folder: Path
) -> None:
    config = json.loads((head_folder / "config.json").read_text())
    config["target"]["fingerprint"] = [v + 1.0 for v in config["target"]["fingerprint"]]
    other = tmp_path / "other-head"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    (other / "model.safetensors").write_bytes((head_folder / "model.safetensors").read_bytes())
    main_error(
        capsys,
        ["--target", str(TARGET), "--draft", str(other), "--max-new-tokens", "4"],
        "feature head",
        "tiny-target",
        "fingerprint",
    )


@needs_pair
@pytest.mark.parametrize(
    "argv, warning",
    [
        (["--tree-mode", "iid"], "--tree-mode has no effect without --tree"),
        (["--tree", "2,1", "--gamma", "5"], "--gamma has no effect with --tree"),
        (["--no-draft", "--verify", "block"], "--verify has no effect with --no-draft"),
    ],
)
def test_flags_that_change_nothing_warn(
    capsys: pytest.CaptureFixture[str], argv: list[str], warning: str
) -> None:
    _, err = run(capsys, *argv)
    assert f"warning: {warning}" in err
