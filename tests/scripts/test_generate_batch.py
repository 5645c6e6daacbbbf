"""generate.py --prompts-file / --batch-size: many prompts decoded as one batch
(speculative/engine/engine.py). Prompt i's tokens are those of a --prompt run of its line with
seed + i, whatever the batch size; the output and --json shape; bad input is one error line
with exit status 2, and --batch-size without --prompts-file one warning.

Runs go in-process through ``generate.main(argv)``, in float64 where tokens are compared, so
that the identities are exact (docs/algorithm.md, numerics policy: in float32 a row's logits
come from a matmul of another shape than the single run's, and a near-tie may fall the other
way).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

import generate
from tests.support.cli import (
    TARGET,
    assert_one_error_line,
    assert_unused_flags,
    cli,
    main_error,
    main_ok,
    needs_pair,
    warnings_in,
)

NEW = "8"
LINES = ["Once upon a time", "The dog and the cat", "The little girl went to the park with her"]
EXACT = ["--target", str(TARGET), "--max-new-tokens", NEW, "--dtype", "float64"]


def prompts_file(folder: Path, text: str, name: str = "prompts.txt") -> str:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def quiet_main(argv: list[str]) -> tuple[str, str]:
    """generate.main(argv) with stdout and stderr captured (for module-scoped fixtures, which have no capsys)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = generate.main(argv)
    assert status == 0, err.getvalue()
    return out.getvalue(), err.getvalue()


def run_json(argv: list[str]) -> dict[str, Any]:
    return json.loads(quiet_main([*argv, "--json"])[0])  # the whole of stdout is one JSON document


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A prompts file of three lines of different lengths (the rows are padded), ending in a newline."""
    return prompts_file(tmp_path_factory.mktemp("prompts"), "\n".join(LINES) + "\n")


@pytest.fixture(scope="module")
def greedy_batch(three: str) -> dict[str, Any]:
    if not (TARGET / "config.json").is_file():
        pytest.skip("the shipped pair is absent")
    return run_json([*EXACT, "--prompts-file", three])


@pytest.fixture(scope="module")
def greedy_alone() -> list[list[int]]:
    """Each line run by itself with --prompt, greedy: the references of the batch's rows."""
    if not (TARGET / "config.json").is_file():
        pytest.skip("the shipped pair is absent")
    return [run_json([*EXACT, "--prompt", line, "--temperature", "0"])["tokens"] for line in LINES]


# ----------------------------------------------------------------------------- the tokens
@needs_pair
def test_greedy_batch_equals_each_prompt_run_alone(
    greedy_batch: dict[str, Any], greedy_alone: list[list[int]]
) -> None:
    rows = greedy_batch["prompts"]
    assert [row["tokens"] for row in rows] == greedy_alone
    assert all(len(tokens) == int(NEW) for tokens in greedy_alone)
    assert [row["prompt"] for row in rows] == LINES and [row["seed"] for row in rows] == [None] * 3


@needs_pair
def test_text_output_prints_each_completion_in_order_then_the_summary(
    capsys: pytest.CaptureFixture[str], greedy_batch: dict[str, Any], three: str
) -> None:
    out, err = main_ok(capsys, [*EXACT, "--prompts-file", three])
    expected = "".join(
        f"--- prompt {i} (line {i + 1}) ---\n{line}{row['text']}\n"
        for i, (line, row) in enumerate(zip(LINES, greedy_batch["prompts"]))
    )
    assert out == expected
    assert err[0].endswith(
        "greedy (temperature 0), gamma 4, token-wise verification, guarded (plain steps where "
        "speculating loses)"
    ), err[0]
    assert err[1] == f"3 prompts from {three}, decoded as a batch of at most 3 rows per target call"
    assert (
        err[2].startswith("batch: 3 prompts, batch size 3 (mean ")
        and f"{3 * int(NEW)} new tokens" in err[2]
    )
    assert "stopped: 3 max_new_tokens" in err[2] and err[3].startswith("alpha="), err


@needs_pair
def test_sampled_prompt_i_is_the_prompt_alone_with_seed_plus_i(
    capsys: pytest.CaptureFixture[str], three: str
) -> None:
    sampled = [*EXACT, "--temperature", "1", "--seed", "40"]
    batch = run_json([*sampled, "--prompts-file", three])
    # a sampled batch is not guarded; a prompt alone is, by recorded costs, unless --no-guard (docs/cli.md)
    alone = [
        run_json(
            [*EXACT, "--temperature", "1", "--seed", str(40 + i), "--prompt", line, "--no-guard"]
        )["tokens"]
        for i, line in enumerate(LINES)
    ]
    assert [row["tokens"] for row in batch["prompts"]] == alone
    assert [row["seed"] for row in batch["prompts"]] == [40, 41, 42] and batch["settings"][
        "seed"
    ] == 40
    in_twos = run_json([*sampled, "--prompts-file", three, "--batch-size", "2"])
    assert [
        row["tokens"] for row in in_twos["prompts"]
    ] == alone  # the batch size changes no row's tokens
    assert in_twos["batch"]["batch_size"] == 2 and max(in_twos["batch"]["rows_history"]) == 2
    out, err = main_ok(capsys, [*sampled, "--prompts-file", three, "--batch-size", "2"])
    assert "seed 40 (prompt i uses seed + i), gamma 4" in err[0], err[0]
    assert "at most 2 rows per target call" in err[1], err[1]
    assert f"--- prompt 2 (line 3, seed 42) ---\n{LINES[2]}{in_twos['prompts'][2]['text']}\n" in out


@needs_pair
@pytest.mark.parametrize(
    "argv", [["--no-draft"], ["--draft", "lookup"], ["--gamma", "auto", "--verify", "block"]]
)
def test_every_drafter_and_the_target_alone_batch(
    three: str, greedy_alone: list[list[int]], argv: list[str]
) -> None:
    doc = run_json([*EXACT, "--prompts-file", three, *argv])
    assert [
        row["tokens"] for row in doc["prompts"]
    ] == greedy_alone  # greedy: the target's own tokens
    if "--no-draft" in argv:
        assert doc["batch"]["draft_calls"] == 0 and doc["batch"]["acceptance_rate"] is None
        assert doc["settings"]["draft"] is None
        assert all(
            row["stats"]["draft_calls"] == 0 and row["stats"]["gamma"] is None
            for row in doc["prompts"]
        )
    elif "lookup" in argv:  # prompt lookup calls no model: it copies from the sequence, when it can
        assert doc["settings"]["draft"] == "lookup" and doc["batch"]["draft_calls"] == 0
    else:
        assert doc["batch"]["draft_calls"] > 0 and doc["batch"]["tokens_per_row_iteration"] > 1
        assert all(row["stats"]["gamma_setting"] == "auto" for row in doc["prompts"])


@needs_pair
def test_a_feature_head_batches(
    three: str, greedy_alone: list[list[int]], head_folder: Path
) -> None:
    doc = run_json([*EXACT, "--prompts-file", three, "--draft", str(head_folder)])
    assert [row["tokens"] for row in doc["prompts"]] == greedy_alone
    assert doc["batch"]["draft_calls"] > 0 and doc["settings"]["draft"] == str(head_folder)


# ----------------------------------------------------------------------------- --json
@needs_pair
def test_json_shape(greedy_batch: dict[str, Any], three: str) -> None:
    doc = greedy_batch
    assert list(doc) == ["prompts", "batch", "settings", "notes"]
    for i, row in enumerate(doc["prompts"]):
        assert set(row) == {
            "prompt_index",
            "line",
            "prompt",
            "seed",
            "text",
            "tokens",
            "prompt_tokens",
            "stats",
        }
        assert row["prompt_index"] == i and row["line"] == i + 1
        assert (
            row["stats"]["new_tokens"] == len(row["tokens"])
            and row["stats"]["stop_reason"] == "max_new_tokens"
        )
        assert row["prompt_tokens"] > 1 and isinstance(row["text"], str) and row["text"]
    batch = doc["batch"]
    assert (
        batch["prompts"] == 3 and batch["batch_size"] == 3 and batch["new_tokens"] == 3 * int(NEW)
    )
    for key in (
        "iterations",
        "row_iterations",
        "mean_batch",
        "tokens_per_second",
        "acceptance_rate",
        "tokens_per_row_iteration",
        "rows_history",
        "decode_time_s",
        "wall_time_s",
    ):
        assert key in batch, key
    assert doc["settings"]["prompts_file"] == three and doc["settings"]["batch_size"] == 3
    assert "batch" in doc["notes"] and "acceptance_rate" in doc["notes"]


@needs_pair
def test_compare_runs_the_batch_with_the_target_alone_too(three: str) -> None:
    doc = run_json([*EXACT, "--prompts-file", three, "--compare"])
    compare = doc["compare"]
    assert compare["measured_speedup"] == pytest.approx(
        compare["speculative_tokens_per_second"] / compare["baseline_tokens_per_second"]
    )
    # float64 greedy: exact
    assert compare["same_tokens"] is True and compare["differing_prompts"] == []
    assert compare["baseline_tokens"] == [row["tokens"] for row in doc["prompts"]]
    assert compare["baseline"]["draft_calls"] == 0 and doc["settings"]["compare"] is True


@needs_pair
def test_prompts_from_standard_input(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("The dog and the cat\r\nOnce upon a time\n"))
    out, _ = main_ok(capsys, [*EXACT, "--max-new-tokens", "2", "--prompts-file", "-", "--json"])
    doc = json.loads(out)
    assert [row["prompt"] for row in doc["prompts"]] == [
        "The dog and the cat",
        "Once upon a time",
    ]  # \r dropped
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    main_error(capsys, [*EXACT, "--prompts-file", "-"], "standard input", "no prompts")


# ----------------------------------------------------------------------------- bad input and warnings
@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("one\n\nthree\n", ["line 2 is empty"]),
        ("one\ntwo\n   \n", ["line 3 is empty"]),  # whitespace only
        ("one\ntwo\n\n", ["line 3 is empty"]),  # a second newline at the end is an empty line
        ("", ["no prompts"]),
    ],
)
def test_bad_prompts_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, fragments: list[str]
) -> None:
    path = prompts_file(tmp_path, text)
    main_error(capsys, ["--target", str(TARGET), "--prompts-file", path], path, *fragments)


def test_missing_prompts_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    main_error(
        capsys, ["--prompts-file", str(tmp_path / "nowhere.txt")], "nowhere.txt", "cannot be read"
    )


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--batch-size", "0"], ["--batch-size must be an integer >= 1", "got 0"]),
        (["--batch-size", "-2"], ["--batch-size must be an integer >= 1"]),
        (["--batch-size", "1.5"], ["--batch-size", "invalid int"]),
        (["--tree", "2,2"], ["token trees are not batched; drop --tree or --prompts-file"]),
        (["--prompt", "Hello"], ["give --prompt or --prompts-file, not both"]),
        (["--prompt", generate.DEFAULT_PROMPT], ["not both"]),  # given, even at its default value
    ],
)
def test_bad_batch_settings(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], fragments: list[str]
) -> None:
    path = prompts_file(tmp_path, "one\ntwo\n")
    main_error(capsys, ["--target", str(TARGET), "--prompts-file", path, *argv], *fragments)


@needs_pair
def test_a_prompt_too_long_for_the_context_names_its_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = prompts_file(tmp_path, "Once upon a time\n" + "the dog " * 400 + "\n")
    main_error(
        capsys,
        ["--target", str(TARGET), "--prompts-file", path],
        "--prompts-file line 2",
        "context",
    )


@needs_pair
def test_an_empty_line_in_a_real_process(tmp_path: Path) -> None:
    path = prompts_file(tmp_path, "one\n\n")
    proc = cli("--target", str(TARGET), "--prompts-file", path)
    assert_one_error_line(proc.returncode, proc.stderr, proc.stdout, "line 2 is empty")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--batch-size", "4"], ["--batch-size has no effect without --prompts-file"]),
        (["--batch-size", "4", "--prompts-file", "p.txt"], []),
        (
            ["--prompts-file", "p.txt", "--no-color"],
            ["--no-color has no effect with --prompts-file"],
        ),
        (
            ["--plan", "--prompts-file", "p.txt", "--batch-size", "2"],
            ["--prompts-file and --batch-size have no effect with --plan"],
        ),
    ],
)
def test_batch_flags_a_run_cannot_use_warn(argv: list[str], expected: list[str]) -> None:
    assert_unused_flags(argv, expected)


@needs_pair
def test_batch_size_without_a_prompts_file_warns_and_the_run_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out, err = main_ok(
        capsys, ["--target", str(TARGET), "--max-new-tokens", "2", "--batch-size", "2", "--json"]
    )
    assert warnings_in(err) == [
        "warning: --batch-size has no effect without --prompts-file: a single prompt is one row"
    ]
    assert len(json.loads(out)["tokens"]) == 2
