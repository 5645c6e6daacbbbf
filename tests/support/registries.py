"""The tables of docs/layout.md that list the registered drafter kinds and verification rules,
made from the registries themselves: ``python -m tests.support.registries`` rewrites them in
place, and tests/docs/test_layout.py fails while they are stale."""

from __future__ import annotations

import re

from speculative.draft import DRAFTERS
from speculative.verify import RULES
from tests.support.paths import ROOT

PAGE = ROOT / "docs" / "layout.md"
BLOCK = re.compile(r"(<!-- registry:begin[^>]*-->\n)(.*?)(<!-- registry:end -->)", re.S)
MEMORY = {
    "none": "nothing",
    "own": "its own config",
    "target-block": "one block of the target's shape",
}
FILES = {
    None: "none (named by `--draft NAME`)",
    "checkpoint": "a Llama checkpoint",
    "head": "a head's folder",
}


def tables() -> str:
    lines = ["| drafter kind | what it is | its files | in the memory plan |", "|---|---|---|---|"]
    for kind in DRAFTERS.values():
        files = FILES[kind.network] if kind.needs_files or kind.network is None else kind.network
        memory = MEMORY.get(kind.memory, kind.memory)
        lines.append(f"| `{kind.name}` | {kind.description} | {files} | {memory} |")
    lines += ["", "| rule (`--verify`) | what it is | at temperature 0 |", "|---|---|---|"]
    for rule in RULES.values():
        lines.append(f"| `{rule.name}` | {rule.description} | {rule.at_temperature_0} |")
    return "\n".join(lines) + "\n"


def written() -> str:
    match = BLOCK.search(PAGE.read_text())
    return match.group(2) if match else ""


if __name__ == "__main__":
    PAGE.write_text(BLOCK.sub(lambda m: m.group(1) + tables() + m.group(3), PAGE.read_text()))
