"""Teaching text that stays true: every path that the code, the README and the docs cite exists,
and every relative link in the docs resolves.

A cited path is a ``docs/...`` page or image, or a source file of this repository
(``speculative/engine/engine.py``, ``tests/bugs/...py``, ``benchmarks/NAME.py``), written anywhere
in a .py file, README.md or a page of docs/ or weights/. Test modules (``tests/**/test_*.py``) are
not read: some name files that are not there on purpose, to check the errors about them. A
relative link is a Markdown link ``[text](target)`` whose target is not a URL or an anchor
alone; it resolves against the page's folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("docs", "model", "speculative", "weights", "tests", "benchmarks")
CITED = re.compile(r"(?<![\w./-])((?:" + "|".join(PACKAGES) + r")/[\w./-]*\w\.(?:py|md|png|json))")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
IGNORED = (".venv", ".git", "runs", "build", "dist")


def sources() -> list[Path]:
    files = [ROOT / "README.md", *ROOT.glob("*.py")]
    for folder in PACKAGES:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    return sorted(p for p in files if not set(p.relative_to(ROOT).parts) & set(IGNORED)
                  and not (p.parts[len(ROOT.parts)] == "tests" and p.name.startswith("test_")))


def missing_citations(text: str, root: Path = ROOT) -> list[str]:
    """The cited repository paths in ``text`` that do not exist under ``root``."""
    return sorted({path for path in CITED.findall(text) if not (root / path).exists()})


def broken_links(text: str, folder: Path) -> list[str]:
    """The relative Markdown links in ``text`` that do not resolve from ``folder``."""
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path and not (folder / path).exists():
            broken.append(target)
    return broken


def test_the_checks_find_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("x")
    text = "see docs/here.md and docs/gone.md, speculative/nowhere.py; [a](here.md) [b](gone.md#x) [c](#top)"
    assert missing_citations(text, tmp_path) == ["docs/gone.md", "speculative/nowhere.py"]
    assert broken_links(text, tmp_path / "docs") == ["gone.md#x"]


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_paths_exist(path: Path) -> None:
    assert missing_citations(path.read_text()) == [], f"{path.relative_to(ROOT)} cites paths that do not exist"


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path.read_text(), path.parent) == [], f"{path.relative_to(ROOT)} has broken links"
