"""Every script of benchmarks/ answers ``--help``: CI runs no benchmark, but it knows that each
one imports and builds its command line.

A script is a module of benchmarks/ that runs as ``python -m benchmarks.NAME``: one whose source
has an ``if __name__ == "__main__":`` block at its top level. The other modules (the harness, the
prompt sets, the report) have none; the scripts import them, so they are covered too. A script
added to the folder is found by this rule, never by a list of names here. Each runs in a process
of its own with a timeout, a few at a time.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.paths import ROOT

BENCHMARKS = ROOT / "benchmarks"
TIMEOUT_S = (
    120  # a script's imports (torch, the packages) on a busy 2-core machine: seconds, not minutes
)


def is_script(path: Path) -> bool:
    """Whether the module at ``path`` has a top-level ``if __name__ == "__main__":`` block."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        test = node.test if isinstance(node, ast.If) else None
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__"
        ):
            return True
    return False


def scripts(folder: Path = BENCHMARKS) -> list[str]:
    return sorted(path.stem for path in folder.glob("*.py") if is_script(path))


SCRIPTS = scripts()


def ask_for_help(name: str) -> tuple[int | None, str, str]:
    """``python -m benchmarks.NAME --help`` from the repository root: exit status (None: it ran past
    the timeout), stdout, stderr."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
    }  # the help needs no threads, and CI's cores are few
    try:
        proc = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{name}", "--help"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return None, "", f"no answer after {TIMEOUT_S} s"
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def answers() -> dict[str, tuple[int | None, str, str]]:
    """Every script's answer, asked a few at a time (each start is mostly importing torch)."""
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1))) as pool:
        return dict(zip(SCRIPTS, pool.map(ask_for_help, SCRIPTS)))


def test_the_rule_tells_scripts_from_modules(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(
        'def main():\n    return 0\n\n\nif __name__ == "__main__":\n    main()\n'
    )
    (tmp_path / "module.py").write_text(
        '"""Not run: if __name__ == "__main__" is only said here."""\nX = 1\n'
    )
    (tmp_path / "nested.py").write_text('def f():\n    if __name__ == "__main__":\n        pass\n')
    assert scripts(tmp_path) == ["script"]


def test_the_folder_has_scripts_and_the_harness_is_not_one() -> None:
    assert "benchmark" in SCRIPTS and "before_after" in SCRIPTS
    assert not {"harness", "__init__", "benchmark_prompts", "benchmark_report"} & set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_answers_help(
    name: str, answers: dict[str, tuple[int | None, str, str]]
) -> None:
    status, out, err = answers[name]
    assert status == 0, f"python -m benchmarks.{name} --help: exit status {status}\n{err[-2000:]}"
    assert out.startswith(f"usage: python -m benchmarks.{name} "), out[
        :200
    ]  # harness.script_parser's usage
