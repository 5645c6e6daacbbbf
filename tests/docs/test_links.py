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
    return sorted(
        p
        for p in files
        if not set(p.relative_to(ROOT).parts) & set(IGNORED)
        and not (p.parts[len(ROOT.parts)] == "tests" and p.name.startswith("test_"))
    )


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
    assert missing_citations(path.read_text()) == [], (
        f"{path.relative_to(ROOT)} cites paths that do not exist"
    )


@pytest.mark.parametrize(
    "path",
    [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path.read_text(), path.parent) == [], (
        f"{path.relative_to(ROOT)} has broken links"
    )


# ----------------------------------------------------------------------------- one machine per page
# A figure is only comparable with figures measured on the same machine. A page names the machine its
# figures come from (a results page in its machine table, a docs page in words), and a page that quotes a
# results page quotes that page's machine; these are the ways a page names one, each mapped to one machine. An AMD part is named by its family and model as lscpu gives them.
MACHINE = re.compile(r"\bZen ?(\d)|cpu family (\d+), model (\d+)|\b(Xeon)")
ZEN = {("25", "1"): "3", ("25", "17"): "4", ("26", "2"): "5"}  # (family, model) -> Zen generation


def machines(text: str) -> set[str]:
    """The machines a page names: 'Zen 4', 'Zen 5', 'family F model M' (another AMD part), 'Xeon'."""
    found = set()
    for zen, family, model, xeon in MACHINE.findall(text):
        if xeon:
            found.add("Xeon")
        elif zen:
            found.add(f"Zen {zen}")
        else:
            found.add(
                f"Zen {ZEN[family, model]}"
                if (family, model) in ZEN
                else f"family {family} model {model}"
            )
    return found


def cited_pages(text: str, folder: Path, root: Path = ROOT) -> set[Path]:
    """The pages under docs/ that ``text`` links to (relative links) or names (docs/....md)."""
    pages = {
        (folder / target.split("#", 1)[0]).resolve()
        for target in LINK.findall(text)
        if not re.match(r"[a-z]+:", target)
        and not target.startswith("#")
        and target.split("#", 1)[0]
    }
    pages |= {(root / path).resolve() for path in CITED.findall(text)}
    return {p for p in pages if p.suffix == ".md" and p.is_file() and (root / "docs") in p.parents}


INDEXES = ("docs/README.md", "docs/results/README.md")  # they list pages and give no figures


def cited_machines(page: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """The machines of the results pages ``page`` cites (links or names), by page: the figures it quotes
    from them are theirs."""
    results = root / "docs" / "results"
    cited = {}
    for p in sorted(cited_pages(page.read_text(), page.parent, root)):
        name = str(p.relative_to(root))
        if results in p.parents and p.resolve() != page.resolve() and name not in INDEXES:
            cited[name] = machines(p.read_text())
    return cited


def mixed_machines(page: Path, root: Path = ROOT) -> list[str]:
    """What makes ``page`` mix machines' figures: it names two machines; it names one and cites (links or
    names) a docs page that names another; or the results pages it cites are of two machines or more.
    An index (docs/README.md, docs/results/README.md) lists pages of every machine and is not judged."""
    if str(page.relative_to(root)) in INDEXES:
        return []
    text = page.read_text()
    here = machines(text)
    if len(here) > 1:
        return [f"names {len(here)} machines: {', '.join(sorted(here))}"]
    if here:
        (name,) = here
        return [
            f"cites {p.relative_to(root)} ({', '.join(sorted(machines(p.read_text())))}) from a page of {name}"
            for p in sorted(cited_pages(text, page.parent, root))
            if str(p.relative_to(root)) not in INDEXES
            and machines(p.read_text())
            and machines(p.read_text()) != here
        ]
    by_machine: dict[str, list[str]] = {}
    for cited, named in cited_machines(page, root).items():
        for machine in named:
            by_machine.setdefault(machine, []).append(cited)
    if len(by_machine) < 2:
        return []
    return [
        f"cites results pages of {len(by_machine)} machines: "
        + "; ".join(f"{m}: {', '.join(pages)}" for m, pages in sorted(by_machine.items()))
    ]


def test_the_machine_check_finds_a_page_that_mixes_machines(tmp_path: Path) -> None:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    zen4 = tmp_path / "docs" / "results" / "zen4.md"
    zen4.write_text("| CPU | AMD EPYC (cpu family 25, model 17, stepping 1) |")
    (tmp_path / "docs" / "results" / "zen5.md").write_text("On a 2-core Zen 5: 438 tokens/s.")
    (tmp_path / "docs" / "plain.md").write_text("No figures here.")
    mixed = tmp_path / "docs" / "mixed.md"
    mixed.write_text("On this Zen 4 ... and on the Zen 5 (cpu family 26, model 2) ...")
    citing = tmp_path / "docs" / "citing.md"
    citing.write_text(
        "Measured on a Zen 5: [zen4](results/zen4.md), [plain](plain.md), docs/results/zen5.md."
    )
    same = tmp_path / "docs" / "same.md"
    same.write_text(
        "On a Zen 4 (see [the run](results/zen4.md#setup), [every run](results/README.md))."
    )
    (tmp_path / "docs" / "results" / "README.md").write_text(
        "[a](zen4.md) [b](zen5.md): Zen 4, Zen 5"
    )
    assert machines(zen4.read_text()) == {"Zen 4"} and machines("cpu family 26, model 9") == {
        "family 26 model 9"
    }
    assert mixed_machines(mixed, tmp_path) == ["names 2 machines: Zen 4, Zen 5"]
    assert mixed_machines(citing, tmp_path) == [
        "cites docs/results/zen4.md (Zen 4) from a page of Zen 5"
    ]
    assert (
        mixed_machines(same, tmp_path) == []
        and mixed_machines(tmp_path / "docs" / "plain.md", tmp_path) == []
    )


def test_the_machine_check_finds_a_page_that_cites_two_machines_results(tmp_path: Path) -> None:
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "README.md").write_text("[a](a_zen4.md) [b](b_zen5.md)")
    (results / "a_zen4.md").write_text("| CPU | AMD EPYC (cpu family 25, model 17) | 2026-12-05 |")
    (results / "b_zen5.md").write_text("2 cores of a Zen 5, 2026-12-04: 1.46x.")
    (results / "c_zen4.md").write_text("Zen 4 again, 2026-12-05.")
    teaching = tmp_path / "docs" / "teaching.md"
    teaching.write_text(
        "The guard gains 1.10x ([a](results/a_zen4.md)) and 1.46x (docs/results/b_zen5.md)."
    )
    one = tmp_path / "docs" / "one.md"
    one.write_text("1.10x ([a](results/a_zen4.md)), 0.97x ([c](results/c_zen4.md#x)).")
    assert cited_machines(teaching, tmp_path) == {
        "docs/results/a_zen4.md": {"Zen 4"},
        "docs/results/b_zen5.md": {"Zen 5"},
    }
    assert mixed_machines(teaching, tmp_path) == [
        "cites results pages of 2 machines: Zen 4: docs/results/a_zen4.md; Zen 5: docs/results/b_zen5.md"
    ]
    assert mixed_machines(one, tmp_path) == []
    assert mixed_machines(results / "README.md", tmp_path) == []  # an index is not judged


@pytest.mark.parametrize(
    "path",
    [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "weights").glob("*/README.md")),
    ],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_page_is_one_machines_run(path: Path) -> None:
    assert mixed_machines(path) == [], f"{path.relative_to(ROOT)} mixes machines"


@pytest.mark.parametrize(
    "path",
    sorted(p for p in (ROOT / "docs" / "results").glob("*.md") if p.name != "README.md"),
    ids=lambda p: p.name,
)
def test_every_results_page_names_its_machine_and_date(path: Path) -> None:
    text = path.read_text()
    assert len(machines(text)) == 1, f"{path.name} names no machine, or several"
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{path.name} gives no date for its run"
