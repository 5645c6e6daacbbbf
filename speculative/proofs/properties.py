"""The four properties the checker proves, each a function from the subject and its cases
to a :class:`Result`: the exact law, the zero draw, chi-square and greedy identity
(docs/proofs_checker.md says what each proves).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy
import torch

from speculative.engine.generation import speculative_generate, speculative_generate_batch
from speculative.proofs.branching import Branching, Broken, NotApplicable
from speculative.proofs.cases import GREEDY_GAMMAS, GREEDY_PROMPTS, LlamaCase, TableCase, toy_draft
from speculative.proofs.exact import verifier_distribution
from speculative.proofs.subject import Subject, blaming
from speculative.proofs.toys import (
    chi_square_pvalue,
    llama_next_logits,
    max_gap,
    ref_warp,
    sequence_distribution,
)
from speculative.sampling import Sampling

TOLERANCE = 1e-9  # exact laws: float64 sums, a few ulps per branch
P_VALUE = 1e-3  # chi-square: reject below


@dataclass
class Result:
    """One property: PASS, FAIL or N/A, its worst deviation or p-value, and where."""

    name: str
    status: str
    measure: str
    where: str = ""

    def line(self) -> str:
        where = f" | {self.where}" if self.where else ""
        return f"{self.name:<16} {self.status:<4}  {self.measure}{where}"


def target_law(
    next_logits: Callable, prompt: Sequence[int], length: int, sampling: Sampling
) -> dict:
    """The target's own law of its first ``length`` tokens: reference warp, no cache."""
    return sequence_distribution(
        lambda ctx: ref_warp(
            next_logits(ctx).tolist(), sampling.temperature, sampling.top_k, sampling.top_p
        ),
        prompt,
        length,
    )


def worst(got: dict, expected: dict) -> tuple[float, tuple, float, float]:
    key = max(set(got) | set(expected), key=lambda k: abs(got.get(k, 0.0) - expected.get(k, 0.0)))
    return (
        abs(got.get(key, 0.0) - expected.get(key, 0.0)),
        key,
        got.get(key, 0.0),
        expected.get(key, 0.0),
    )


def exact_result(name: str, laws: list[tuple[Any, dict, dict]], unit: str) -> Result:
    """The worst gap over the cases' (case, emitted law, target law)."""
    gaps = [(worst(got, expected), case) for case, got, expected in laws]
    (gap, key, got, expected), case = max(gaps, key=lambda g: g[0][0])
    total = max(abs(sum(got_law.values()) - 1) for _, got_law, _ in laws)
    if gap <= TOLERANCE and total <= TOLERANCE:
        return Result(
            name, "PASS", f"worst gap {gap:.1e} <= {TOLERANCE:.0e} over {len(laws)} {unit}"
        )
    number = [c for c, _, _ in laws].index(case) + 1
    return Result(
        name,
        "FAIL",
        f"worst gap {gap:.3g} > {TOLERANCE:.0e}: P(first tokens {key}) is {got:.6g}, "
        f"the target's {expected:.6g}",
        f"{case} (case {number} of {len(laws)})",
    )


def verifier_laws(rule: Callable, cases: list[TableCase], label: str, seed: int = 0) -> list[tuple]:
    laws = []
    for case in cases:
        target, draft = case.models()
        with Branching(seed=seed) as branching, blaming(f"the verifier {label}", case):
            got = verifier_distribution(
                target, draft, (0,), case.gamma, case.length, case.sampling, rule, branching
            )
        laws.append((case, got, target_law(target.next_logits, (0,), case.length, case.sampling)))
    return laws


def reseed(seed: int) -> None:
    """Every global random stream a rule might draw from behind the checker's back."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        numpy.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def deterministic(first: list[tuple], again: list[tuple]) -> None:
    """Two enumerations with other generators and global seeds must agree, or the code draws
    randomness that the enumeration does not see."""
    if any(max_gap(a[1], b[1]) > TOLERANCE for a, b in zip(first, again)):
        raise NotApplicable(
            "its outcome changes with the seeds although every draw the checker sees is the same: "
            "it draws randomness the enumeration cannot follow (Python's random, numpy, or a torch "
            "function imported by name)"
        )


def exact_law(laws_of: Callable[[list, int], list[tuple]], cases: list, unit: str) -> Result:
    """The exact laws of the cases (``laws_of(cases, seed)``) against the target's; the first
    case again with other seeds, which must not change it."""
    name = "exact law"
    try:
        reseed(1)
        laws = laws_of(cases, 0)
        reseed(2)
        deterministic(laws[:1], laws_of(cases[:1], 1))
    except NotApplicable as why:
        return Result(name, "N/A", f"not applicable: {why.reason}")
    except Broken as error:
        return Result(name, "FAIL", str(error), getattr(error, "where", ""))
    return exact_result(name, laws, unit)


def zero_draw(s: Subject, cases: list[TableCase]) -> Result:
    """With torch.rand returning 0, every sequence the verifier can emit has target probability > 0.
    The target's tables get zeros where the draft's have none, so that drafts the target rules
    out are proposed."""
    name = "zero draw"
    try:
        for case in cases:
            case = replace(case, holes=max(case.holes, 0.3), draft_holes=0.0)
            target, draft = case.models()
            with Branching(zero=True) as branching, blaming(f"the verifier {s.label}", case):
                emitted = verifier_distribution(
                    target,
                    draft,
                    (0,),
                    case.gamma,
                    case.length,
                    case.sampling,
                    s.verifier,
                    branching,
                )
            expected = target_law(target.next_logits, (0,), case.length, case.sampling)
            impossible = sorted(k for k in emitted if expected.get(k, 0.0) <= 0)
            if impossible:
                return Result(
                    name,
                    "FAIL",
                    f"with r = 0 (torch.rand can return it) it emits {impossible[0]}, of "
                    f"probability 0 under the target ({len(impossible)} such sequences)",
                    str(case),
                )
    except NotApplicable as why:
        return Result(name, "N/A", f"not applicable: {why.reason}")
    except Broken as error:
        return Result(name, "FAIL", str(error), getattr(error, "where", ""))
    return Result(
        name, "PASS", f"nothing of target probability 0 emitted with r = 0, over {len(cases)} cases"
    )


def drafter_law(s: Subject, case: LlamaCase, seed: int) -> tuple:
    target = case.target()
    drafter = s.drafter(target)
    sampling = case.sampling
    settings = {
        "gamma": case.gamma,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": seed,
    }

    def run() -> tuple:
        if len(case.prompts) == 1:
            return tuple(
                speculative_generate(
                    target, drafter, list(case.prompts[0]), case.length, **settings
                ).tokens
            )
        out = speculative_generate_batch(
            target, drafter, [list(p) for p in case.prompts], case.length, **settings
        )
        return tuple(tuple(r.tokens) for r in out.results)

    with Branching(seed=seed) as branching, blaming(f"the drafter {s.label}", case):
        got = branching.enumerate(run)
    laws = [
        target_law(llama_next_logits(target), prompt, case.length, sampling)
        for prompt in case.prompts
    ]
    if len(laws) == 1:
        return case, got, laws[0]
    joint = {(): 1.0}  # the rows independent, each with the target's law
    for law in laws:
        joint = {rows + (row,): p * q for rows, p in joint.items() for row, q in law.items()}
    return case, got, joint


def chi_square(s: Subject, cases: list[LlamaCase]) -> Result:
    """The real engine with its real generators, seeds 0..runs-1: the first tokens' counts
    against the target's exact law."""
    name = "chi-square"
    results = []
    for case in cases:
        target = case.target()
        draft = s.drafter(target) if s.kind == "drafter" else toy_draft(target)
        rule = "token" if s.kind == "drafter" else s.verifier
        sampling = case.sampling
        counts: Counter = Counter()
        for seed in range(case.runs):
            with blaming(f"the {s.kind} {s.label}", f"{case}, seed {seed}"):
                out = speculative_generate(
                    target,
                    draft,
                    list(case.prompts[0]),
                    case.length,
                    gamma=case.gamma,
                    temperature=sampling.temperature,
                    top_k=sampling.top_k,
                    top_p=sampling.top_p,
                    seed=seed,
                    verify=rule,
                )
            counts[tuple(out.tokens[: case.length])] += 1
        expected = target_law(llama_next_logits(target), case.prompts[0], case.length, sampling)
        results.append((chi_square_pvalue(counts, expected), case))
    p_value, case = min(results, key=lambda r: r[0])
    if p_value >= P_VALUE:
        return Result(
            name,
            "PASS",
            f"smallest p = {p_value:.3g} >= {P_VALUE:.0e} over {len(cases)} cases "
            f"({sum(c.runs for c in cases)} generations)",
        )
    return Result(
        name,
        "FAIL",
        f"p = {p_value:.3g} < {P_VALUE:.0e}: the first tokens do not follow the target's law",
        str(case),
    )


def greedy_tokens(target: torch.nn.Module, prompt: Sequence[int], count: int) -> list[int]:
    """The target's own greedy output: argmax of a no-cache forward, float64."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            seq.append(int(target(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def greedy_identity(s: Subject, vocab: int = 16, count: int = 12, seed: int = 31) -> Result:
    name = "greedy identity"
    target = LlamaCase(vocab, 1, count, Sampling(temperature=0), seed=seed).target()
    draft = s.drafter(target) if s.kind == "drafter" else toy_draft(target, std=0.3)
    rule = "token" if s.kind == "drafter" else s.verifier
    runs = 0
    for prompt in GREEDY_PROMPTS:
        expected = greedy_tokens(target, prompt, count)
        for gamma in GREEDY_GAMMAS:
            case = f"vocab {vocab}, gamma {gamma}, prompt {list(prompt)}, toy LLaMA seed {seed}"
            with blaming(f"the {s.kind} {s.label}", case):
                out = speculative_generate(
                    target,
                    draft,
                    list(prompt),
                    count,
                    gamma=gamma,
                    temperature=0,
                    seed=0,
                    verify=rule,
                )
            runs += 1
            if out.tokens != expected:
                at = next(
                    (i for i, (a, b) in enumerate(zip(out.tokens, expected)) if a != b),
                    len(expected),
                )
                return Result(
                    name,
                    "FAIL",
                    f"tokens {out.tokens} differ from the target's greedy {expected} from "
                    f"token {at} on",
                    case,
                )
    return Result(
        name,
        "PASS",
        f"{runs} of {runs} generations are the target's greedy tokens "
        f"({count} tokens, gammas {GREEDY_GAMMAS})",
    )
