"""docs/proofs.md is what the tests' proof markers say, and the mutation catalogue still
matches the source it mutates.

* The page is generated (``python tests/support/proofs.py > docs/proofs.md``); a new, changed or
  removed proof makes this test fail until the page is regenerated.
* Every test file that carries a ``proof`` marker, in any folder of tests/, has a section on the
  page: a proof cannot be left off it.
* Every catalogued bug (tests/support/mutation.py) edits a line that occurs exactly once in its
  file, so that the maintained mutation run cannot silently mutate nothing.
"""

from __future__ import annotations

import re

from tests.support.mutation import CATALOGUE
from tests.support.proofs import ROOT, SECTIONS, TESTS, marked_tests, page


def test_the_page_is_what_the_markers_say() -> None:
    written = (ROOT / "docs" / "proofs.md").read_text()
    assert written == page(), (
        "docs/proofs.md is stale: run `python tests/support/proofs.py > docs/proofs.md`"
    )


def test_every_file_with_proofs_has_a_section() -> None:
    listed = {name for files in SECTIONS.values() for name in files}
    with_proofs = {
        path.relative_to(ROOT).as_posix()
        for path in TESTS.rglob("test_*.py")
        if re.search(r"^@proof\(", path.read_text(), re.M)
    }
    assert with_proofs <= listed, (
        f"proofs in files the page leaves out: {sorted(with_proofs - listed)}"
    )
    assert all((ROOT / name).is_file() for name in listed), (
        "a section lists a file that is not there"
    )
    assert all(marked_tests(ROOT / name) for name in listed), (
        "a section lists a file without proofs"
    )


def test_the_page_has_a_row_per_proof_and_names_the_public_bugs() -> None:
    written = (ROOT / "docs" / "proofs.md").read_text()
    count = sum(len(marked_tests(ROOT / name)) for files in SECTIONS.values() for name in files)
    assert len(re.findall(r"^\| .* \| `tests/[\w/]+\.py::\w+` \|", written, re.M)) == count >= 60
    for bug in (
        "SGLang #35771",
        "transformers #47932",
        "vLLM #10198",
        "xLLM #2175",
        "vllm-ascend #7807",
    ):
        assert bug in written


def test_every_catalogued_bug_edits_one_line_of_the_source() -> None:
    assert len(CATALOGUE) >= 12 and len({bug.name for bug in CATALOGUE}) == len(CATALOGUE)
    for bug in CATALOGUE:
        source = (ROOT / bug.path).read_text()
        assert source.count(bug.old) == 1, (
            f"{bug.name}: its line occurs {source.count(bug.old)} times in {bug.path}"
        )
        assert bug.new != bug.old
