"""What the formatter does not check: a choice among several cases is statements or a named
function, never a nested conditional expression (CONTRIBUTING.md)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def nested_conditionals(source: str) -> list[int]:
    """The lines of every conditional expression with another inside it (in its test or either branch)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.IfExp):
            parts = (node.test, node.body, node.orelse)
            if any(isinstance(part, ast.IfExp) for part in parts):
                lines.append(node.lineno)
    return lines


def test_the_check_finds_a_nested_conditional() -> None:
    # nested in a branch (line 2, continued on 3), and in the test (line 4, continued on 5)
    source = "\n".join(
        [
            "x = 1 if a else 2",
            "y = 'a' if a else \\",
            "    'b' if b else 'c'",
            "z = (1 if a else 2) \\",
            "    if b else 3",
        ]
    )
    assert nested_conditionals(source) == [2, 4]


def test_no_nested_conditional_expression_in_the_project() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found = []
    for name in listed:
        path = ROOT / name
        if path.exists():
            found += [f"{name}:{line}" for line in nested_conditionals(path.read_text())]
    assert listed and found == [], "write these as statements or a named function"
