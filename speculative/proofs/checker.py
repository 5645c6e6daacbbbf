"""Is your verification rule or drafter exact? The proofs of this repository, pointed at your code.

    python -m speculative.prove MODULE:OBJECT [--quick]
    python -m speculative.prove NAME [--quick]     # a registered rule or drafter: token, block, model, ...

NAME is a verification rule or a drafter kind as registered (speculative.verify.RULES,
speculative.draft.DRAFTERS, whose ``toy`` says what to build for the toy target). MODULE is a
dotted module name or a path to a .py file; OBJECT names, in it, either

* a **verifier**: a function with the built-in verifiers' signature, ``rule(p [g+1, V], q [g, V],
  drafted [g], generator) -> speculative.verify.Verdict`` (speculative.verify.verify_step,
  speculative.verify.block.verify_block), or
* a **drafter**: an object of the drafter protocol (start / propose / commit / keep_rows,
  speculative.draft), or a function or class that makes one, called with no argument when it
  can be, else with the toy target (``factory(target) -> drafter``; the target is a small float64
  model.Llama, and :func:`toy_draft` / :func:`toy_head` build a draft model or a feature head for
  it). The registered drafters are checked by name (``python -m speculative.prove lookup``),
  each as its registration's ``toy`` builds it (``speculative.prove:model_drafter`` for a draft
  model, ``speculative.prove:feature_drafter`` for a feature head).

The properties (docs/proofs_checker.md says what each one proves and how):

* **exact law**: the exact law of the first tokens, computed by running the code once per branch
  of its randomness (speculative.proofs.exact), equals the target's, to 1e-9, on small random float64
  targets: several vocabularies, gammas and decoding settings, drafts that are sometimes right,
  probabilities of 0 in p and q. A verifier is enumerated by itself, iteration after iteration;
  a drafter through the real engine (speculative.engine.generation.speculative_generate), with every
  draw of the drafter, every uniform and token of the verification enumerated.
* **zero draw** (verifiers): torch.rand can return exactly 0. With every uniform at 0, nothing the
  verifier emits may have probability 0 under the target.
* **chi-square**: the real engine, seeded, run many times on a small LLaMA; its first tokens
  against the target's exact law (Pearson, p < 1e-3 fails).
* **greedy identity**: at temperature 0 the engine's tokens are the target's greedy tokens.

Exit status 0 when no property fails (one that cannot be applied is listed as N/A, with why),
1 when one fails (with the case and by how much), 2 with one line ``error: ...`` for bad input:
a missing module, file or object, an object of the wrong kind, a rule that raises.
:func:`check` is the same as a library function.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from speculative.proofs.cases import (
    CHI_SQUARE_CASES,
    DRAFTER_CASES,
    VERIFIER_CASES,
    LlamaCase,
    quick_cases,
)
from speculative.proofs.properties import (
    Result,
    chi_square,
    drafter_law,
    exact_law,
    greedy_identity,
    verifier_laws,
    zero_draw,
)
from speculative.proofs.subject import InputError, load, subject
from speculative.sampling import Sampling


@dataclass
class Report:
    label: str
    kind: str
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every property holds (one that cannot be applied does not)."""
        return all(r.status == "PASS" for r in self.results)

    def names(self, status: str) -> list[str]:
        return [r.name for r in self.results if r.status == status]

    def summary(self) -> str:
        skipped = self.names("N/A")
        note = f"not applicable: {', '.join(skipped)}" if skipped else ""
        took = f"({self.seconds:.1f} s)"
        if self.names("FAIL"):
            failed = f"FAIL: {', '.join(self.names('FAIL'))}"
            if note:
                failed += f"; {note}"
            return f"{failed} {took}"
        if skipped:
            return f"NOT PROVEN: {note} {took}"
        return f"PASS: all {len(self.results)} properties hold {took}"


VERIFIER_PROPERTIES = ("exact", "zero", "chi-square", "greedy")
DRAFTER_PROPERTIES = ("exact", "chi-square", "greedy")


def check(
    obj: Any,
    *,
    label: str | None = None,
    quick: bool = False,
    properties: Sequence[str] | None = None,
    echo: Callable[[str], None] | None = None,
) -> Report:
    """Check a verifier or a drafter (see the module docstring); ``properties`` chooses among
    "exact", "zero", "chi-square" and "greedy" (default: all that apply). ``echo`` sees each
    line as it is made. Raises InputError for an object that cannot be checked."""
    start = time.perf_counter()
    label = label or getattr(obj, "__qualname__", None) or type(obj).__name__
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the toys are far too small to gain from threads
    try:
        return checked(obj, label, quick, properties, echo or (lambda line: None), start)
    finally:
        torch.set_num_threads(threads)


def checked(
    obj: Any,
    label: str,
    quick: bool,
    properties: Sequence[str] | None,
    echo: Callable[[str], None],
    start: float,
) -> Report:
    s = subject(obj, label)
    known = VERIFIER_PROPERTIES if s.kind == "verifier" else DRAFTER_PROPERTIES
    wanted = properties or known
    report = Report(label, s.kind)
    if s.kind == "drafter":
        s.drafter(LlamaCase(2, 1, 1, Sampling(), seed=0).target())  # the wrong kind is told at once
    echo(f"checking {label}, a {s.kind}{' (--quick)' if quick else ''}")
    pick = quick_cases if quick else list

    def exact() -> Result:
        if s.kind == "verifier":
            return exact_law(
                lambda cases, seed: verifier_laws(s.verifier, cases, s.label, seed),
                pick(VERIFIER_CASES),
                "cases",
            )
        return exact_law(
            lambda cases, seed: [drafter_law(s, case, seed) for case in cases],
            pick(DRAFTER_CASES),
            "cases through the engine",
        )

    steps = {
        "exact": exact,
        "zero": lambda: zero_draw(s, pick(VERIFIER_CASES)),
        "chi-square": lambda: chi_square(s, pick(CHI_SQUARE_CASES)),
        "greedy": lambda: greedy_identity(s),
    }
    for key in wanted:
        if key not in steps or (key == "zero" and s.kind != "verifier"):
            raise InputError(f"no property {key!r} for a {s.kind} (properties: {', '.join(known)})")
    for key in wanted:
        report.results.append(steps[key]())
        echo(report.results[-1].line())
    report.seconds = time.perf_counter() - start
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m speculative.prove",
        description="Check that a verification rule or a drafter is exact: exact "
        "enumeration, chi-square through the engine, greedy identity.",
    )
    parser.add_argument(
        "target",
        metavar="MODULE:OBJECT",
        help="a dotted module or a .py file, then a verifier or a drafter in it; or the name of a "
        "registered rule or drafter",
    )
    parser.add_argument(
        "--quick", action="store_true", help="half the toy cases and fewer chi-square runs"
    )
    parser.add_argument(
        "--only",
        metavar="PROPERTIES",
        help="a comma-separated subset of: exact, zero (verifiers), chi-square, greedy",
    )
    args = parser.parse_args(argv)
    lines: list[str] = []  # printed at the end: bad input found on the way is then the only line
    try:
        obj, label = load(args.target)
        report = check(
            obj,
            label=label,
            quick=args.quick,
            echo=lines.append,
            properties=args.only.split(",") if args.only else None,
        )
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines + [report.summary()]))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
