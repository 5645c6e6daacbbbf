"""The suite's own distribution under ``pytest -n`` (CI's command).

pyproject.toml's ``--dist loadgroup`` sends every test of a module marked ``xdist_group`` to one
worker, so that the module's fixtures (compiled steps, a running server) are built once. pytest-xdist
tells its scheduler a test's group by a suffix on the test's node id, ``@group``. Under pytest 9.2 that
suffix is lost (pytest-xdist issue #1386): the marked modules are dealt out test by test again, without
a word, and each of their fixtures is built on both workers. pyproject.toml keeps pytest below 9.2 for
that; this test is what notices if the grouping stops again.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("workers")


def test_a_marked_module_is_one_unit_of_work(request: pytest.FixtureRequest) -> None:
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip(
            "checks pytest -n under --dist loadgroup (CI's command); this run is not distributed so"
        )
    assert request.node.nodeid.endswith("@workers"), (
        f"{request.node.nodeid}: no group suffix, so --dist loadgroup deals the marked modules out test by test "
        "(pytest-xdist #1386; see pyproject.toml's pin of pytest)"
    )
