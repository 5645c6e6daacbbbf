"""Source-level mutants: a module's own source with a few lines changed, run as a fresh module;
and the catalogue of bugs that the proofs must catch, with the maintained mutation run:

    python tests/support/mutation.py            # every catalogued bug, each in a fresh copy of the source
    python tests/support/mutation.py --bug "r <= p/q"

A mutant made this way breaks the code the loop actually runs (a comparison, a wiring slip
inside a function), which patching a module attribute cannot reach. Every replacement must
match the source exactly once, so that a refactor cannot silently turn a mutant into the
original code."""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

_COUNT = itertools.count()


def mutated(module: types.ModuleType, *replacements: tuple[str, str]) -> types.ModuleType:
    """A copy of ``module`` whose source has each ``old`` replaced by ``new``."""
    source = inspect.getsource(module)
    for old, new in replacements:
        if source.count(old) != 1:
            raise AssertionError(
                f"mutant of {module.__name__}: {old!r} occurs {source.count(old)} times, not once"
            )
        source = source.replace(old, new)
    mutant = types.ModuleType(f"{module.__name__}_mutant{next(_COUNT)}")
    mutant.__file__ = module.__file__
    sys.modules[mutant.__name__] = (
        mutant  # dataclasses look their module up while the class is made
    )
    exec(compile(source, f"<mutant of {module.__name__}>", "exec"), mutant.__dict__)
    return mutant


# ----------------------------------------------------------------------------- the catalogue
@dataclass(frozen=True)
class Bug:
    """One catalogued bug, as a source edit: ``old`` (exactly once in ``path``) becomes ``new``."""

    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    public: str  # the public bug it reproduces, or why it is catalogued
    exactness: bool = True  # False: a behaviour change that keeps the output exact


CATALOGUE = [
    Bug(
        "r <= p/q",
        "speculative/verify/token.py",
        "accepted = r < ratio",
        "accepted = r <= ratio",
        "SGLang #35771: a token the target rules out is accepted when r = 0",
    ),
    Bug(
        "q unwarped",
        "speculative/draft/protocol.py",
        "    probs.append(q)\n    return sample_rows(",
        "    probs.append(torch.softmax(logits, -1))\n    return sample_rows(",
        "transformers #47932 / vLLM #10198: drawn from the warped q, judged with the raw softmax",
    ),
    Bug(
        "residual against a one-hot q",
        "speculative/verify/token.py",
        "fallback = torch.cat([residual_distribution(p[:gamma], q), p[gamma:]])",
        "fallback = torch.cat([residual_distribution(p[:gamma], torch.nn.functional.one_hot(drafted, p.shape[-1])"
        ".to(p.dtype)), p[gamma:]])",
        "a wiring slip: the residual of a deterministic drafter used for a sampled one",
    ),
    Bug(
        "block done token-wise",
        "speculative/verify/block.py",
        "    return (running - running.cummax(0).values).exp()",
        "    return F.pad(ratio.clamp(max=1), (1, 0), value=1.0).cumprod(0)",
        "vllm-ascend #7807: block verification computed with the token-wise rule (exact, accepts less)",
    ),
    Bug(
        "wrong block stop rule",
        "speculative/verify/block.py",
        "inner = torch.where(denominator > 0, inner_mass / denominator, 0.0)",
        "inner = torch.where(denominator > 0, inner_mass, 0.0)",
        "h_i = m_i instead of m_i / (m_i + 1 - w_i)",
    ),
    Bug(
        "siblings tested against the original p",
        "speculative/verify/tree.py",
        "    p_next = residual_distribution(p_cur, q_child)",
        "    p_next = p_cur",
        "xLLM #2175: the residual not updated between siblings of a tree",
    ),
    Bug(
        "without-replacement q not renormalised",
        "speculative/verify/tree.py",
        "    return p_next, torch.where(mass > 0, removed / mass, removed)",
        "    return p_next, removed",
        "siblings drawn without replacement judged with the removed q left unnormalised (not a law)",
    ),
    Bug(
        "another row's q",
        "speculative/engine/judging.py",
        "q = None if draft.q is None else draft.q[b, :g]",
        "q = None if draft.q is None else draft.q[b - 1, :g]",
        "a batch bug: row b judged with the q of row b - 1",
    ),
    Bug(
        "another row's cache position",
        "speculative/engine/engine.py",
        "        for row in rows:\n            row.target_next = row.length - 1\n",
        "        for b, row in enumerate(rows):\n            row.target_next = row.length - 1 - steps[b].accepted"
        " + steps[(b + 1) % len(rows)].accepted\n",
        "a batch bug: a row's position advanced by another row's count",
    ),
    Bug(
        "the bonus drawn from p_gamma",
        "speculative/verify/token.py",
        "residual_distribution(p[:gamma], q), p[gamma:]])",
        "residual_distribution(p[:gamma], q), p[max(gamma - 1, 0):max(gamma - 1, 0) + 1]])",
        "an off-by-one in the bonus row: all accepted, t drawn from p_gamma",
    ),
    Bug(
        "greedy off by one",
        "speculative/verify/token.py",
        "matches = [x == y for x, y in zip(xs, ys)]",
        "matches = [x == y for x, y in zip(xs, ys[1:])]",
        "x_i compared with the target's choice one position later",
    ),
    Bug(
        "the server drops top_k",
        "speculative/serving/streaming.py",
        "Sampling(temperature, top_k, top_p),\n            body.seed,",
        "Sampling(temperature, None, top_p),\n            body.seed,",
        "a server that accepts a sampling field and does not apply it: not the law asked for",
    ),
    Bug(
        "unseeded requests seeded alike",
        "speculative/serving/streaming.py",
        "top_p),\n            body.seed,\n            body.speculative_gamma,",
        "top_p),\n            0 if body.seed is None else body.seed,\n            body.speculative_gamma,",
        "a server that gives every request without a seed the same one: each answer is one sample of the law, "
        "all of them the same sample",
    ),
    Bug(
        "lookup's first occurrence",
        "speculative/draft/lookup.py",
        "                table[tuple(ids[i : i + n])] = i",
        "                table.setdefault(tuple(ids[i : i + n]), i)",
        "prompt lookup copies after the first occurrence, not the latest: slower drafts, still exact",
        exactness=False,
    ),
    Bug(
        "suffix's latest occurrence",
        "speculative/draft/suffix.py",
        "    return max(children, key=lambda t: (children[t].count, children[t].last))",
        "    return max(children, key=lambda t: children[t].last)",
        "suffix decoding follows the latest occurrence, not the most frequent continuation: "
        "slower drafts, still exact",
        exactness=False,
    ),
]


# Left out of the copy: at the top of the repository only (tests/weights/ is a test folder, not the
# checkpoints), and caches anywhere. weights/ itself is linked into the copy, not copied.
_TOP_LEVEL = {".venv", ".git", "runs", "cache", "weights"}
_ANYWHERE = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info")


def _ignored(root: Path):
    def ignore(folder: str, names: list[str]) -> set[str]:
        top = set(names) & _TOP_LEVEL if Path(folder) == root else set()
        return top | set(_ANYWHERE(folder, names))

    return ignore


def run_catalogue(
    root: Path, names: list[str] | None, timeout: float
) -> list[tuple[Bug, str, str, float]]:
    """Write each bug into a fresh copy of the repository and run ``pytest -m proof -x`` there.
    Returns (bug, "caught" / "survived", the first failing test, seconds) per bug."""
    results = []
    for bug in CATALOGUE:
        if names and bug.name not in names:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / "repo"
            shutil.copytree(root, copy, ignore=_ignored(root))
            (copy / "weights").symlink_to(root / "weights")  # read-only data, the largest part
            source = (copy / bug.path).read_text()
            if source.count(bug.old) != 1:
                raise SystemExit(
                    f"error: bug {bug.name!r}: its line occurs {source.count(bug.old)} times in "
                    f"{bug.path}, not once (the source moved: update the catalogue)"
                )
            (copy / bug.path).write_text(source.replace(bug.old, bug.new))
            start = time.perf_counter()
            env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
            try:
                command = [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-m",
                    "proof",
                    "-x",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "tests",
                ]
                out = subprocess.run(
                    command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout
                )
                failed = re.search(r"^FAILED (\S+)", out.stdout, re.MULTILINE)
                if failed:
                    first = failed.group(1)
                elif out.returncode == 0:
                    first = ""
                else:
                    first = out.stdout.strip()[-200:]  # it failed without a FAILED line
                verdict = "survived" if out.returncode == 0 else "caught"
            except subprocess.TimeoutExpired:
                first = f"timed out after {timeout:.0f} s"
                verdict = "survived"
            results.append((bug, verdict, first, time.perf_counter() - start))
    return results


def main(argv: list[str] | None = None) -> int:
    """python tests/support/mutation.py [--bug NAME ...]: the maintained mutation run (minutes per bug)."""
    parser = argparse.ArgumentParser(
        description="Write each catalogued bug into a copy of the source and run the "
        "proofs (pytest -m proof) against it."
    )
    parser.add_argument(
        "--bug", action="append", help="run only this bug (repeatable); default: all"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per bug")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[2]  # tests/support/mutation.py -> the repository
    results = run_catalogue(root, args.bug, args.timeout)
    print("| bug | reproduces | result | first failing proof | seconds |\n|---|---|---|---|---:|")
    for bug, verdict, first, seconds in results:
        kind = "" if bug.exactness else " (behaviour, not exactness)"
        print(f"| {bug.name}{kind} | {bug.public} | {verdict} | `{first}` | {seconds:.0f} |")
    caught = sum(verdict == "caught" for _, verdict, _, _ in results)
    print(f"\n{caught} of {len(results)} caught")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
