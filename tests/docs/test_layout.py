"""docs/layout.md lists what is registered: its tables are the registries' (tests/support/registries.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.registries import tables, written

ROOT = Path(__file__).resolve().parents[2]


def test_the_tables_are_the_registries() -> None:
    assert written() == tables(), (
        "docs/layout.md's tables are stale: run `python -m tests.support.registries`"
    )
    assert "`model`" in written() and "`token`" in written()


def path_rows() -> list[tuple[str, str, str, int]]:
    """docs/layout.md's reader's path: (what it explains, file, function or class, lines)."""
    text = (ROOT / "docs" / "layout.md").read_text()
    table = text.split("<!-- reader's path: begin -->")[1].split("<!-- reader's path: end -->")[0]
    rows = []
    for line in table.strip().splitlines()[2:]:
        purpose, path, name, lines = [
            cell.strip().strip("`") for cell in line.strip("|").split("|")
        ]
        rows.append((purpose, path, name, int(lines)))
    return rows


def spans(path: str) -> dict[str, list[int]]:
    """The line counts of every function and class in ``path`` by name (several for a name used twice)."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.setdefault(node.name, []).append(node.end_lineno - node.lineno + 1)
    return found


def stale(rows: list[tuple[str, str, str, int]]) -> list[str]:
    """The rows whose function or class is not as long as the row says."""
    return [
        f"{path}'s {name} is not {lines} lines long"
        for _, path, name, lines in rows
        if lines not in spans(path).get(name, [])
    ]


def test_the_reader_s_path_is_the_source_s() -> None:
    rows = path_rows()
    assert {purpose for purpose, *_ in rows} == {"Algorithm 1", "one production iteration"}
    assert stale(rows) == [], "docs/layout.md's reader's path is stale"
    totals: dict[str, int] = {}
    for purpose, _, _, lines in rows:
        totals[purpose] = totals.get(purpose, 0) + lines
    text = (ROOT / "docs" / "layout.md").read_text()
    assert (
        f"In all: {totals['Algorithm 1']} lines for Algorithm 1, and "
        f"{totals['one production iteration']} for one production iteration" in text
    )


def test_the_path_check_finds_a_stale_row() -> None:
    rows = [
        ("Algorithm 1", "speculative/reference.py", "speculative_decode", 3),
        ("Algorithm 1", "speculative/reference.py", "no_such_function", 5),
    ]
    assert stale(rows) == [
        "speculative/reference.py's speculative_decode is not 3 lines long",
        "speculative/reference.py's no_such_function is not 5 lines long",
    ]
