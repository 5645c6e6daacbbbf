"""Running generate.py in the tests: in a subprocess with one thread (:func:`cli`), or in-process
through ``generate.main(argv)`` (:func:`main_ok`, :func:`main_error`), which is what the script
runs; and the contract every bad input keeps: exit status 2 and one ``error:`` line, no traceback
(:func:`assert_one_error_line`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

import generate
from speculative.cli import options as cmdline
from tests.support.paths import DRAFT, ROOT, TARGET

__all__ = [
    "DRAFT",
    "PAIR",
    "ROOT",
    "TARGET",
    "assert_one_error_line",
    "assert_unused_flags",
    "cli",
    "main_error",
    "main_json",
    "main_ok",
    "needs_pair",
    "warnings_in",
]

PAIR = ["--target", str(TARGET), "--draft", str(DRAFT)]
needs_pair = pytest.mark.skipif(
    not (TARGET / "config.json").is_file() or not (DRAFT / "config.json").is_file(),
    reason="the shipped pair weights/tiny-target + weights/tiny-draft is absent (it is committed once trained)",
)


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run generate.py in a subprocess with one CPU thread (``stdin``: its standard input, not a
    terminal)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    full_env.pop("NO_COLOR", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=timeout,
    )


def assert_one_error_line(status: int, stderr: str, stdout: str, *fragments: str) -> None:
    assert status == 2, stderr
    assert "Traceback" not in stderr
    lines = without_progress(stderr)
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), (fragment, lines[0])
    assert stdout == ""


# progress lines that may come before an error: loading, a compile's steps (model/fast/progress.py)
PROGRESS = ("load: ", "compile: ")


def without_progress(stderr: str) -> list[str]:
    """``stderr``'s lines less the progress lines that may come before an error (:data:`PROGRESS`)."""
    return [line for line in stderr.strip("\n").splitlines() if not line.startswith(PROGRESS)]


def main_error(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> str:
    """generate.main(argv) in-process: must return 2 with one error line naming ``fragments``."""
    status = generate.main(argv)
    out = capsys.readouterr()
    assert_one_error_line(status, out.err, out.out, *fragments)
    return out.err


def main_ok(
    capsys: pytest.CaptureFixture[str], argv: list[str], status: int = 0
) -> tuple[str, list[str]]:
    """generate.main(argv) in-process: the status, then (stdout, stderr lines); never a traceback."""
    got = generate.main(argv)
    out = capsys.readouterr()
    assert got == status, out.err
    assert "Traceback" not in out.err
    return out.out, out.err.strip("\n").splitlines()


def main_json(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> tuple[dict[str, Any], list[str]]:
    out, err = main_ok(capsys, [*argv, "--json"])
    return json.loads(out), err


def warnings_in(err: list[str]) -> list[str]:
    return [line for line in err if line.startswith("warning: ")]


def assert_unused_flags(argv: list[str], expected: list[str]) -> None:
    """cmdline.unused_flags for ``argv``: one warning per expected fragment, each starting with it."""
    args = generate.build_parser().parse_args(argv)
    got = cmdline.unused_flags(args, generate.given_flags(argv))
    assert len(got) == len(expected), got
    for line, fragment in zip(got, expected):
        assert line.startswith(fragment), (line, fragment)
