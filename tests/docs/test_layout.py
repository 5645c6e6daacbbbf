"""docs/layout.md lists what is registered: its tables are the registries' (tests/support/registries.py)."""

from __future__ import annotations

from tests.support.registries import tables, written


def test_the_tables_are_the_registries() -> None:
    assert written() == tables(), (
        "docs/layout.md's tables are stale: run `python -m tests.support.registries`"
    )
    assert "`model`" in written() and "`token`" in written()
