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
import importlib
import importlib.util
import inspect
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy
import torch

from speculative.draft.eagle import FeatureDrafter
from speculative.draft.model import ModelDrafter
from speculative.draft.parallel import ParallelDrafter, ParallelFeatureDrafter
from speculative.draft.registry import DRAFTERS, find
from speculative.engine.generation import speculative_generate, speculative_generate_batch
from speculative.proofs.exact import Branching, Broken, Contract, NotApplicable, verifier_distribution
from speculative.proofs.toys import (
    NGramModel,
    chi_square_pvalue,
    llama_next_logits,
    max_gap,
    noisy_copy,
    parallel_copy,
    random_eagle3_head,
    random_head,
    random_llama,
    random_peagle_head,
    ref_warp,
    sequence_distribution,
    toy_table,
)
from speculative.sampling import Sampling
from speculative.verify.registry import RULES

TOLERANCE = 1e-9  # exact laws: float64 sums, a few ulps per branch
P_VALUE = 1e-3  # chi-square: reject below
DRAFTER_METHODS = ("start", "propose", "commit", "keep_rows")


class InputError(Exception):
    """The object cannot be checked; the message is the one line the command prints."""


# ----------------------------------------------------------------------------- the toy cases
def describe(sampling: Sampling) -> str:
    if sampling.greedy:
        return "temperature 0"
    parts = [f"temperature {sampling.temperature:g}"]
    if sampling.top_k is not None:
        parts.append(f"top-k {sampling.top_k}")
    if sampling.top_p is not None:
        parts.append(f"top-p {sampling.top_p:g}")
    return ", ".join(parts)


@dataclass(frozen=True)
class TableCase:
    """A verifier's toy case: order-2 n-gram tables (target and draft), the draft's rows equal to
    the target's in a fraction ``agree`` of the contexts (a draft that is sometimes right), and
    -inf logits (probability 0) in a fraction ``holes`` of the target's entries and
    ``draft_holes`` of the draft's (None: the same fraction)."""

    vocab: int
    gamma: int
    length: int
    sampling: Sampling
    seed: int
    holes: float = 0.0
    agree: float = 0.5
    draft_holes: float | None = None

    def models(self) -> tuple[NGramModel, NGramModel]:
        target = toy_table(self.vocab, 2, self.seed, self.holes)
        other = toy_table(self.vocab, 2, self.seed + 1000, self.holes if self.draft_holes is None else self.draft_holes)
        same = torch.rand(self.vocab, generator=torch.Generator().manual_seed(self.seed)) < self.agree
        return NGramModel(target), NGramModel(torch.where(same[:, None], target, other))

    def __str__(self) -> str:
        q_holes = self.holes if self.draft_holes is None else self.draft_holes
        zeros = "" if not (self.holes or q_holes) else f", zeros in {self.holes:.0%} of p and {q_holes:.0%} of q"
        return (f"vocab {self.vocab}, gamma {self.gamma}, first {self.length} tokens, {describe(self.sampling)}"
                f"{zeros}, n-gram tables seed {self.seed}")


@dataclass(frozen=True)
class LlamaCase:
    """A case through the engine: a float64 random LLaMA target of ``vocab`` tokens (weights
    N(0, std)); one prompt, or several as the rows of one batch."""

    vocab: int
    gamma: int
    length: int  # tokens emitted (exact law) or counted (chi-square), per row
    sampling: Sampling
    seed: int
    prompts: tuple[tuple[int, ...], ...] = ((1, 0, 1),)
    runs: int = 0  # chi-square: seeds 0..runs-1
    std: float = 0.6

    def target(self) -> torch.nn.Module:
        return random_llama(vocab=self.vocab, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32,
                            max_seq_len=64, seed=self.seed, std=self.std, dtype=torch.float64)

    def __str__(self) -> str:
        runs = f", {self.runs} runs (seeds 0-{self.runs - 1})" if self.runs else ""
        prompts = (f"prompt {list(self.prompts[0])}" if len(self.prompts) == 1 else
                   f"a batch of {len(self.prompts)} rows, prompts {', '.join(str(list(p)) for p in self.prompts)}")
        return (f"vocab {self.vocab}, gamma {self.gamma}, first {self.length} tokens, {describe(self.sampling)}, "
                f"{prompts}, toy LLaMA seed {self.seed} (std {self.std:g}){runs}")


VERIFIER_CASES = [
    TableCase(2, 1, 3, Sampling(), seed=1),
    TableCase(3, 2, 3, Sampling(), seed=2, holes=0.3, agree=0.3),
    TableCase(3, 3, 4, Sampling(temperature=0.7, top_k=2), seed=3),
    TableCase(4, 2, 3, Sampling(temperature=1.3, top_p=0.8), seed=4, holes=0.3),
    TableCase(2, 4, 5, Sampling(temperature=1.5), seed=5, agree=0.5),
    TableCase(5, 2, 2, Sampling(temperature=0.8), seed=6, holes=0.4, agree=0.2),
    TableCase(3, 2, 3, Sampling(temperature=0), seed=7),
]
DRAFTER_CASES = [
    LlamaCase(3, 2, 3, Sampling(temperature=0.7, top_k=2), seed=12),
    LlamaCase(2, 3, 4, Sampling(), seed=11),
    LlamaCase(3, 2, 4, Sampling(temperature=1.3, top_p=0.9), seed=13, prompts=((2, 1, 2),)),
    LlamaCase(4, 2, 3, Sampling(temperature=0.6), seed=14),
    LlamaCase(2, 2, 2, Sampling(temperature=0.8), seed=15, prompts=((1, 0, 1), (0, 0))),
]
CHI_SQUARE_CASES = [
    LlamaCase(8, 1, 2, Sampling(temperature=0.5, top_k=4), seed=21, prompts=((1, 5, 1),), runs=2000, std=0.4),
    LlamaCase(8, 2, 2, Sampling(temperature=0.8, top_k=5), seed=23, prompts=((1, 5, 1),), runs=2000),
]
GREEDY_PROMPTS = [(1,), (3, 7, 3), (2, 2, 9, 4, 2, 2)]
GREEDY_GAMMAS = [1, 3, 5]


def quick_cases(cases: list, runs: int = 600) -> list:
    """--quick: the first half of the cases, chi-square with fewer runs."""
    return [LlamaCase(**{**vars(c), "runs": runs}) if isinstance(c, LlamaCase) and c.runs else c
            for c in cases[:max(1, (len(cases) + 1) // 2)]]


# ----------------------------------------------------------------------------- toy drafts
def toy_draft(target: torch.nn.Module, std: float = 0.5, seed: int = 7) -> torch.nn.Module:
    """A draft model for the toy target: a noisy copy, often right and often wrong."""
    return noisy_copy(target, std=std, seed=seed)


def toy_head(target: torch.nn.Module, seed: int = 5) -> torch.nn.Module:
    """A feature head (model.feature_head.FeatureHead) with random weights for the toy target."""
    return random_head(target, seed=seed, std=0.3)


def model_drafter(target: torch.nn.Module) -> ModelDrafter:
    """The draft-model drafter (speculative.draft.ModelDrafter) over a toy draft of the target."""
    return ModelDrafter(toy_draft(target))


def parallel_drafter(target: torch.nn.Module) -> ParallelDrafter:
    """The parallel drafter (speculative.draft.parallel.ParallelDrafter) over a toy draft of the
    target with one more id, its mask: every chain from one call."""
    draft = parallel_copy(target, std=0.5, seed=7)
    return ParallelDrafter(draft, draft.config.extra["pard_token"], target.config.vocab_size)


def feature_drafter(target: torch.nn.Module) -> FeatureDrafter:
    """The feature drafter (speculative.draft.eagle.FeatureDrafter) with a random head for the target."""
    return FeatureDrafter(toy_head(target), target)


def eagle3_drafter(target: torch.nn.Module) -> FeatureDrafter:
    """The feature drafter around a random EAGLE-3 head (model.eagle3_head.Eagle3Head) whose draft
    vocabulary leaves out token 1: fused features of three target layers, its own output layer."""
    return FeatureDrafter(random_eagle3_head(target, seed=5, std=0.3), target)


def peagle_drafter(target: torch.nn.Module) -> ParallelFeatureDrafter:
    """The parallel feature drafter (P-EAGLE) around a random head whose draft vocabulary leaves
    out token 1: every chain from one head call."""
    return ParallelFeatureDrafter(random_peagle_head(target, seed=5, std=0.3), target)


# ----------------------------------------------------------------------------- results
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
            return f"FAIL: {', '.join(self.names('FAIL'))}{'; ' + note if note else ''} {took}"
        if skipped:
            return f"NOT PROVEN: {note} {took}"
        return f"PASS: all {len(self.results)} properties hold {took}"


# ----------------------------------------------------------------------------- what is checked
@dataclass
class Subject:
    """The object under check: a verifier, or a way to get a drafter for a toy target."""

    label: str
    kind: str  # "verifier" or "drafter"
    verifier: Callable | None = None
    make: Callable[[torch.nn.Module], Any] | None = None

    def drafter(self, target: torch.nn.Module) -> Any:
        try:
            drafter = self.make(target)
        except Exception as error:
            raise InputError(f"making the drafter {self.label} raised {type(error).__name__}: {error}") from None
        if isinstance(drafter, type) or not all(callable(getattr(drafter, m, None)) for m in DRAFTER_METHODS):
            raise InputError(f"{self.label} made {kind_of(drafter)}, not a drafter "
                             f"(an object with {', '.join(DRAFTER_METHODS)})")
        if getattr(drafter, "model", None) is target:
            raise InputError(f"{self.label} called with the toy target drafts with the target itself; pass a "
                             "function that builds a draft for it, e.g. speculative.prove:model_drafter")
        return drafter


def can_call(function: Callable, count: int) -> bool | None:
    try:
        inspect.signature(function).bind(*range(count))
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins)
        return None
    return True


def subject(obj: Any, label: str) -> Subject:
    """What ``obj`` is: a drafter, a drafter factory or a verifier; InputError for anything else."""
    if not isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in DRAFTER_METHODS):
        return Subject(label, "drafter", make=lambda target: obj)
    if callable(obj):
        if can_call(obj, 4) and not can_call(obj, 1):
            return Subject(label, "verifier", verifier=obj)
        if can_call(obj, 0):
            return Subject(label, "drafter", make=lambda target: obj())
        if can_call(obj, 1):
            return Subject(label, "drafter", make=obj)
    raise InputError(f"{label} ({kind_of(obj)}) is neither a verifier (rule(p, q, drafted, generator) -> Verdict) "
                     "nor a drafter (an object with start/propose/commit/keep_rows, or a function or class that "
                     "makes one from nothing or from the target)")


def kind_of(obj: Any) -> str:
    """'an int', 'a class of 2 arguments', ... for the message about the wrong kind of object."""
    if callable(obj):
        try:
            count = sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                        for p in inspect.signature(obj).parameters.values())
        except ValueError:
            return "a callable of unknown arguments"
        return f"a {'class' if isinstance(obj, type) else 'callable'} of {count} argument{'s' * (count != 1)}"
    name = type(obj).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def load(spec: str) -> tuple[Any, str]:
    """The object named by MODULE:OBJECT (a dotted module or a .py file), or by a registered
    name: a verification rule (speculative.verify.RULES) or a drafter kind, whose toy instance
    is checked (speculative.draft.DRAFTERS); InputError otherwise."""
    if ":" not in spec and spec in RULES:
        return RULES[spec].verify, f"rule {spec}"
    if ":" not in spec and find(spec) is not None:  # registered, or an installed drafter package's
        toy = DRAFTERS[spec].toy
        return (load(toy)[0] if isinstance(toy, str) else toy), f"drafter {spec}"
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise InputError(f"expected MODULE:OBJECT (a dotted module name or a .py file, then a name in it), or a "
                         f"registered rule ({', '.join(RULES)}) or drafter ({', '.join(DRAFTERS)}), got {spec!r}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise InputError(f"no file {where}")
        module_name = f"_prove_{path.stem}"
        if str(path.resolve().parent) not in sys.path:  # its own imports of files beside it, as `python file.py`
            sys.path.append(str(path.resolve().parent))
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module  # so that its functions find their module (dataclasses, the patches)
        try:
            loader.loader.exec_module(module)
        except Exception as error:
            del sys.modules[module_name]
            raise InputError(f"importing {where} raised {type(error).__name__}: {error}") from None
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as error:
            if error.name and (where == error.name or where.startswith(error.name + ".")):
                raise InputError(f"no module named {where!r}") from None
            raise InputError(f"importing {where} raised ModuleNotFoundError: {error}") from None
        except Exception as error:
            raise InputError(f"importing {where} raised {type(error).__name__}: {error}") from None
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise InputError(f"{where} has no {name!r}")
        obj = getattr(obj, part)
    return obj, spec


@contextmanager
def blaming(what: str, case: Any) -> Iterator[None]:
    """An exception of the code under check, turned into InputError (one line, with the case)."""
    try:
        yield
    except Broken as error:
        error.where = str(case)
        raise
    except (InputError, NotApplicable):
        raise
    except Contract as error:
        raise InputError(f"{what} {error} ({case})") from None
    except Exception as error:
        raise InputError(f"{what} raised {type(error).__name__}: {error} ({case})") from None


# ----------------------------------------------------------------------------- the properties
def target_law(next_logits: Callable, prompt: Sequence[int], length: int, sampling: Sampling) -> dict:
    """The target's own law of its first ``length`` tokens: reference warp, no cache."""
    return sequence_distribution(lambda ctx: ref_warp(next_logits(ctx).tolist(), sampling.temperature,
                                                      sampling.top_k, sampling.top_p), prompt, length)


def worst(got: dict, expected: dict) -> tuple[float, tuple, float, float]:
    key = max(set(got) | set(expected), key=lambda k: abs(got.get(k, 0.0) - expected.get(k, 0.0)))
    return abs(got.get(key, 0.0) - expected.get(key, 0.0)), key, got.get(key, 0.0), expected.get(key, 0.0)


def exact_result(name: str, laws: list[tuple[Any, dict, dict]], unit: str) -> Result:
    """The worst gap over the cases' (case, emitted law, target law)."""
    gaps = [(worst(got, expected), case) for case, got, expected in laws]
    (gap, key, got, expected), case = max(gaps, key=lambda g: g[0][0])
    total = max(abs(sum(got_law.values()) - 1) for _, got_law, _ in laws)
    if gap <= TOLERANCE and total <= TOLERANCE:
        return Result(name, "PASS", f"worst gap {gap:.1e} <= {TOLERANCE:.0e} over {len(laws)} {unit}")
    number = [c for c, _, _ in laws].index(case) + 1
    return Result(name, "FAIL", f"worst gap {gap:.3g} > {TOLERANCE:.0e}: P(first tokens {key}) is {got:.6g}, "
                                f"the target's {expected:.6g}", f"{case} (case {number} of {len(laws)})")


def verifier_laws(rule: Callable, cases: list[TableCase], label: str, seed: int = 0) -> list[tuple]:
    laws = []
    for case in cases:
        target, draft = case.models()
        with Branching(seed=seed) as branching, blaming(f"the verifier {label}", case):
            got = verifier_distribution(target, draft, (0,), case.gamma, case.length, case.sampling, rule, branching)
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
        raise NotApplicable("its outcome changes with the seeds although every draw the checker sees is the same: "
                            "it draws randomness the enumeration cannot follow (Python's random, numpy, or a torch "
                            "function imported by name)")


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
                emitted = verifier_distribution(target, draft, (0,), case.gamma, case.length, case.sampling,
                                                s.verifier, branching)
            expected = target_law(target.next_logits, (0,), case.length, case.sampling)
            impossible = sorted(k for k in emitted if expected.get(k, 0.0) <= 0)
            if impossible:
                return Result(name, "FAIL", f"with r = 0 (torch.rand can return it) it emits {impossible[0]}, of "
                                            f"probability 0 under the target ({len(impossible)} such sequences)",
                              str(case))
    except NotApplicable as why:
        return Result(name, "N/A", f"not applicable: {why.reason}")
    except Broken as error:
        return Result(name, "FAIL", str(error), getattr(error, "where", ""))
    return Result(name, "PASS", f"nothing of target probability 0 emitted with r = 0, over {len(cases)} cases")


def drafter_law(s: Subject, case: LlamaCase, seed: int) -> tuple:
    target = case.target()
    drafter = s.drafter(target)
    sampling = case.sampling
    settings = {"gamma": case.gamma, "temperature": sampling.temperature, "top_k": sampling.top_k,
                "top_p": sampling.top_p, "seed": seed}

    def run() -> tuple:
        if len(case.prompts) == 1:
            return tuple(speculative_generate(target, drafter, list(case.prompts[0]), case.length, **settings).tokens)
        out = speculative_generate_batch(target, drafter, [list(p) for p in case.prompts], case.length, **settings)
        return tuple(tuple(r.tokens) for r in out.results)

    with Branching(seed=seed) as branching, blaming(f"the drafter {s.label}", case):
        got = branching.enumerate(run)
    laws = [target_law(llama_next_logits(target), prompt, case.length, sampling) for prompt in case.prompts]
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
                out = speculative_generate(target, draft, list(case.prompts[0]), case.length, gamma=case.gamma,
                                           temperature=sampling.temperature, top_k=sampling.top_k,
                                           top_p=sampling.top_p, seed=seed, verify=rule)
            counts[tuple(out.tokens[:case.length])] += 1
        expected = target_law(llama_next_logits(target), case.prompts[0], case.length, sampling)
        results.append((chi_square_pvalue(counts, expected), case))
    p_value, case = min(results, key=lambda r: r[0])
    if p_value >= P_VALUE:
        return Result(name, "PASS", f"smallest p = {p_value:.3g} >= {P_VALUE:.0e} over {len(cases)} cases "
                                    f"({sum(c.runs for c in cases)} generations)")
    return Result(name, "FAIL", f"p = {p_value:.3g} < {P_VALUE:.0e}: the first tokens do not follow the target's law",
                  str(case))


def greedy_tokens(target: torch.nn.Module, prompt: Sequence[int], count: int) -> list[int]:
    """The target's own greedy output: argmax of a no-cache forward, float64."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            seq.append(int(target(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


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
                out = speculative_generate(target, draft, list(prompt), count, gamma=gamma, temperature=0, seed=0,
                                           verify=rule)
            runs += 1
            if out.tokens != expected:
                at = next((i for i, (a, b) in enumerate(zip(out.tokens, expected)) if a != b), len(expected))
                return Result(name, "FAIL", f"tokens {out.tokens} differ from the target's greedy {expected} from "
                                            f"token {at} on", case)
    return Result(name, "PASS", f"{runs} of {runs} generations are the target's greedy tokens "
                                f"({count} tokens, gammas {GREEDY_GAMMAS})")


VERIFIER_PROPERTIES = ("exact", "zero", "chi-square", "greedy")
DRAFTER_PROPERTIES = ("exact", "chi-square", "greedy")


def check(obj: Any, *, label: str | None = None, quick: bool = False, properties: Sequence[str] | None = None,
          echo: Callable[[str], None] | None = None) -> Report:
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


def checked(obj: Any, label: str, quick: bool, properties: Sequence[str] | None, echo: Callable[[str], None],
            start: float) -> Report:
    s = subject(obj, label)
    wanted = properties or (VERIFIER_PROPERTIES if s.kind == "verifier" else DRAFTER_PROPERTIES)
    report = Report(label, s.kind)
    if s.kind == "drafter":
        s.drafter(LlamaCase(2, 1, 1, Sampling(), seed=0).target())  # the wrong kind is told at once
    echo(f"checking {label}, a {s.kind}{' (--quick)' if quick else ''}")
    pick = quick_cases if quick else list
    steps = {
        "exact": lambda: (exact_law(lambda cases, seed: verifier_laws(s.verifier, cases, s.label, seed),
                                    pick(VERIFIER_CASES), "cases") if s.kind == "verifier" else
                          exact_law(lambda cases, seed: [drafter_law(s, case, seed) for case in cases],
                                    pick(DRAFTER_CASES), "cases through the engine")),
        "zero": lambda: zero_draw(s, pick(VERIFIER_CASES)),
        "chi-square": lambda: chi_square(s, pick(CHI_SQUARE_CASES)),
        "greedy": lambda: greedy_identity(s),
    }
    for key in wanted:
        if key not in steps or (key == "zero" and s.kind != "verifier"):
            raise InputError(f"no property {key!r} for a {s.kind} (properties: "
                             f"{', '.join(VERIFIER_PROPERTIES if s.kind == 'verifier' else DRAFTER_PROPERTIES)})")
    for key in wanted:
        report.results.append(steps[key]())
        echo(report.results[-1].line())
    report.seconds = time.perf_counter() - start
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speculative.prove",
                                     description="Check that a verification rule or a drafter is exact: exact "
                                                 "enumeration, chi-square through the engine, greedy identity.")
    parser.add_argument("target", metavar="MODULE:OBJECT",
                        help="a dotted module or a .py file, then a verifier or a drafter in it; or the name of a "
                             "registered rule or drafter")
    parser.add_argument("--quick", action="store_true", help="half the toy cases and fewer chi-square runs")
    parser.add_argument("--only", metavar="PROPERTIES",
                        help="a comma-separated subset of: exact, zero (verifiers), chi-square, greedy")
    args = parser.parse_args(argv)
    lines: list[str] = []  # printed at the end: bad input found on the way is then the only line
    try:
        obj, label = load(args.target)
        report = check(obj, label=label, quick=args.quick, echo=lines.append,
                       properties=args.only.split(",") if args.only else None)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines + [report.summary()]))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
