"""Where things are, for every test folder: the repository root, the read-only data beside it,
the shipped pair, and the skip markers for when they are absent.

* ``SHARED_DATA`` / ``needs_shared``: the read-only data folder that sits beside the repo
  (``../shared/data``). A fresh clone does not have it, so tests that read it skip with a
  reason instead of failing; CI provides it.
* ``TARGET`` / ``DRAFT`` / ``needs_pair``: the shipped tiny pair in weights/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # tests/support/paths.py -> the repository
REPO_ROOT = ROOT
TESTS = ROOT / "tests"

SHARED_DATA = ROOT.parent / "shared" / "data"
needs_shared = pytest.mark.skipif(
    not SHARED_DATA.is_dir(), reason="../shared/data is absent (a fresh clone); CI provides it"
)

TARGET = ROOT / "weights" / "tiny-target"
DRAFT = ROOT / "weights" / "tiny-draft"
