"""speculative/reference.py, Algorithm 1 alone, proved the way the engine is.

* **Exact enumeration of speculative_decode itself.** Its only random draws are ``sample``
  (lines 3 and 9) and ``torch.rand`` (line 5), both looked up in the module's namespace. A
  replaying enumerator replaces them: a sample forks over every token of positive
  probability (weight probs[token]), and a uniform r forks when it is compared: r < a is
  True with weight a and False with weight 1 - a. The function is run once per path of
  choices (replaying a recorded prefix), the weights are summed per emitted token tuple, and
  the sums must be the target's own autoregressive distribution, computed with the
  plain-Python reference warp, to 1e-12 in float64.
* **Mutants.** The file's source text is edited (each edit asserts it changed the text) and
  executed as a fresh module; the enumeration must reject each one. ``r <= p/q`` differs from
  ``r < p/q`` only when r equals the ratio, which has probability 0 for a continuous r, so no
  enumeration or sample sees it: a test forces r = 0 against a drafted token the target
  rules out (SGLang #35771).
* **Chi-square** on sampled runs at temperature 1 and with top-k/top-p, and its power on mutants.
* **Greedy identity** with the engine (speculative_generate) and with the target's own greedy
  output, on toy models and on the shipped tiny pair.
* Stopping at max_new_tokens and max_seq_len, and bad input.

The reference takes only ``temperature``. For top-k/top-p the tests replace the module's
``warp`` with one that adds them: the algorithm is exact for any warp applied to both models
alike, and truncated distributions bring the zeros in p and q that temperature alone does not.
"""

from __future__ import annotations

import math
import re
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import speculative.reference as reference
from speculative import autoregressive_generate, speculative_generate
from speculative.sampling import Sampling, warp
from tests.support.mutation import mutated
from tests.support.paths import ROOT
from tests.support.proofs import proof
from tests.support.strategies import max_gap, samplings, toy_table
from tests.support.toy_models import (
    NGramModel,
    Recording,
    chi_square_pvalue,
    ref_warp,
    reference_greedy,
    target_distribution,
)
from weights import load_model, load_tokenizer

torch.set_num_threads(1)

SOURCE = Path(reference.__file__).read_text()
TOL = 1e-12
P_VALUE = 1e-3


# ----------------------------------------------------------------------------- the enumerator
class Enumerator:
    """Runs a function once per path through its random choices. Each choice calls
    :meth:`choose` with (value, weight) options; a run replays a recorded prefix of choices,
    takes the first option after it, and queues every other option for a later run."""

    def explore(self, run: Callable[[], tuple[int, ...]]) -> dict[tuple[int, ...], float]:
        out: dict[tuple[int, ...], float] = {}
        todo: list[list[int]] = [[]]
        self.runs = 0
        while todo:
            self.prefix, self.path, self.widths, self.weight = todo.pop(), [], [], 1.0
            key = run()
            self.runs += 1
            out[key] = out.get(key, 0.0) + self.weight
            for depth in range(len(self.prefix), len(self.path)):
                todo.extend(self.path[:depth] + [other] for other in range(1, self.widths[depth]))
        return out

    def choose(self, options: list[tuple[Any, float]]) -> Any:
        options = [
            (value, weight) for value, weight in options if weight > 0
        ]  # impossible branches: not run
        depth = len(self.path)
        pick = self.prefix[depth] if depth < len(self.prefix) else 0
        self.path.append(pick)
        self.widths.append(len(options))
        value, weight = options[pick]
        self.weight *= weight
        return value

    def sample(self, probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """speculative.sampling.sample for one distribution [V]: every token of positive probability."""
        return torch.tensor(self.choose(list(enumerate(probs.tolist()))))

    def rand(self, *size: int, **kwargs: Any) -> list[Uniform]:
        """torch.rand(g, ...): g uniforms that fork when compared."""
        (count,) = size
        return [Uniform(self) for _ in range(count)]


class Uniform:
    """r ~ U[0, 1) that forks at its comparison: r < a holds with probability min(1, max(0, a))."""

    def __init__(self, enumerator: Enumerator) -> None:
        self.enumerator = enumerator

    def __lt__(self, ratio: Any) -> bool:
        a = min(1.0, max(0.0, float(ratio)))
        return self.enumerator.choose([(True, a), (False, 1.0 - a)])

    __le__ = (
        __lt__  # the same probability for a continuous r: see test_a_token_the_target_rules_out_...
    )


class TorchWithRand:
    """The torch module as the reference's namespace sees it, with ``rand`` replaced."""

    def __init__(self, rand: Callable[..., Any]) -> None:
        self.rand = rand

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def truncating_warp(setting: Sampling) -> Callable[[torch.Tensor, Sampling], torch.Tensor]:
    """warp with the reference's temperature and the setting's top-k and top-p, for both models."""
    return lambda logits, sampling: warp(
        logits, Sampling(sampling.temperature, setting.top_k, setting.top_p)
    )


def decode_distribution(
    module: types.ModuleType,
    target: Any,
    draft: Any,
    prompt: tuple[int, ...],
    length: int,
    gamma: int,
    sampling: Sampling,
) -> dict[tuple[int, ...], float]:
    """Exact P(the `length` tokens) of ``module.speculative_decode``, by running every path."""
    enumerator = Enumerator()

    def run() -> tuple[int, ...]:
        tokens = module.speculative_decode(
            target,
            draft,
            list(prompt),
            length,
            gamma=gamma,
            temperature=sampling.temperature,
            seed=0,
        )
        assert len(tokens) == length
        return tuple(tokens)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "sample", enumerator.sample)
        mp.setattr(module, "torch", TorchWithRand(enumerator.rand))
        if sampling.top_k is not None or sampling.top_p is not None:
            mp.setattr(module, "warp", truncating_warp(sampling))
        got = enumerator.explore(run)
    assert math.isclose(sum(got.values()), 1.0, abs_tol=TOL)
    return got


def test_the_enumerator_runs_every_path() -> None:
    """Two draws of a fair coin, then one more only after heads: 2 + 2 * 2 = 6 paths, by hand."""
    enumerator = Enumerator()

    def run() -> tuple[int, ...]:
        first = enumerator.choose([(0, 0.5), (1, 0.5)])
        second = enumerator.choose([(0, 0.25), (1, 0.75), (2, 0.0)])
        return (
            (first, second)
            if first == 0
            else (first, second, enumerator.choose([(0, 0.5), (1, 0.5)]))
        )

    got = enumerator.explore(run)
    assert enumerator.runs == 6
    assert got == {
        (0, 0): 0.125,
        (0, 1): 0.375,
        (1, 0, 0): 0.0625,
        (1, 0, 1): 0.0625,
        (1, 1, 0): 0.1875,
        (1, 1, 1): 0.1875,
    }


# ----------------------------------------------------------------------------- exactness
@proof(
    "speculative/reference.py (Algorithm 1 alone) emits exactly the target's law",
    "exact enumeration, float64, to 1e-12, every random choice of the function enumerated",
)
@settings(max_examples=100, derandomize=True, deadline=None)
@given(
    vocab=st.integers(2, 4),
    gamma=st.integers(1, 4),
    orders=st.sampled_from([(2, 2), (3, 2), (2, 3)]),
    seed=st.integers(0, 10_000),
    holes=st.sampled_from([0.0, 0.3]),
    relation=st.sampled_from(["other", "same"]),
    sampling=samplings,
)
def test_reference_emits_exactly_the_target_distribution(
    vocab: int,
    gamma: int,
    orders: tuple[int, int],
    seed: int,
    holes: float,
    relation: str,
    sampling: Sampling,
) -> None:
    target = NGramModel(toy_table(vocab, orders[0], seed, holes))
    other = toy_table(vocab, orders[1], seed + 1, holes)
    # "same": a second object, its own cache
    draft = NGramModel(target.table if relation == "same" else other)
    # long enough that the first iteration drafts all gamma tokens, short enough to enumerate quickly
    prompt, length = (1 % vocab,), 1 + min(gamma, {2: 4, 3: 3, 4: 2}[vocab])
    got = decode_distribution(reference, target, draft, prompt, length, gamma, sampling)
    assert max_gap(got, target_distribution(target, prompt, length, sampling)) < TOL


@proof(
    "reference.py is exact when every token comes from the residual",
    "exact enumeration, float64, to 1e-12",
)
def test_disjoint_supports() -> None:
    """The draft proposes only tokens the target never emits: every token comes from the residual."""
    neg = -math.inf
    target = NGramModel(torch.tensor([[0.0, 1.0, neg, neg]] * 4, dtype=torch.float64))
    draft = NGramModel(torch.tensor([[neg, neg, 0.5, 0.0]] * 4, dtype=torch.float64))
    for gamma in (1, 3):
        got = decode_distribution(reference, target, draft, (0,), 3, gamma, Sampling())
        assert max_gap(got, target_distribution(target, (0,), 3, Sampling())) < TOL


# ----------------------------------------------------------------------------- mutants
# Each mutant: (text of reference.py, its replacement) pairs, applied to the source.
MUTANTS: dict[str, list[tuple[str, str]]] = {
    "r <= ratio": [("r[n] < p[n][xs[n]] / q[n][xs[n]]", "r[n] <= p[n][xs[n]] / q[n][xs[n]]")],
    "inverted ratio": [("p[n][xs[n]] / q[n][xs[n]]", "q[n][xs[n]] / p[n][xs[n]]")],
    "residual is p": [("residual = (p[n] - q[n]).clamp(min=0)", "residual = p[n]")],
    # when all g are accepted, t from the draft's next distribution (x_g fed to the draft) instead of p_{g+1}
    "bonus from the draft": [
        (
            "p_prime = p[n] ",
            "p_prime = p[n] if n < g or g == 0 else "
            "warp(call(draft, seq + xs, len(seq) + g - 1, device)[-1], sampling) ",
        )
    ],
    # drafted from the tempered q, judged with the untempered one (transformers #47932, vLLM #10198)
    "temperature on p only": [
        ("q.append(warp(logits, sampling))", "q.append(torch.softmax(logits, -1))"),
        ("sample(q[-1], generator)", "sample(warp(logits, sampling), generator)"),
    ],
    # the residual subtracts a one-hot q on the drafted token (a wiring slip, as in xLLM #2175)
    "residual against a one-hot q": [
        (
            "(p[n] - q[n])",
            "(p[n] - torch.nn.functional.one_hot(torch.tensor(xs[n], device=device), p.shape[-1]))",
        )
    ],
}


def mutant(name: str) -> types.ModuleType:
    """reference.py with MUTANTS[name] applied to its source text, as a fresh module ("unmodified": none)."""
    return mutated(reference, *MUTANTS.get(name, []))


ENUMERATED_MUTANTS = [
    name for name in MUTANTS if name != "r <= ratio"
]  # measure zero: see the forced-r test


@proof(
    "the enumeration of reference.py can fail",
    "exact, source-level mutants of reference.py",
    rejects=(
        "ratio inverted",
        "residual = p",
        "bonus from the draft",
        "temperature on p only",
        "stale q",
    ),
)
@pytest.mark.parametrize("name", ["unmodified"] + ENUMERATED_MUTANTS)
def test_enumeration_rejects_each_mutant(name: str) -> None:
    """Temperature 0.5 (where "temperature on p only" is not a no-op), gamma 2, three tokens: the
    first iteration drafts two, so the bonus, the residual and the ratio all have their say."""
    target, draft = NGramModel(toy_table(3, 2, 24, 0.0)), NGramModel(toy_table(3, 2, 25, 0.0))
    sampling = Sampling(temperature=0.5)
    got = decode_distribution(mutant(name), target, draft, (0,), 3, 2, sampling)
    gap = max_gap(got, target_distribution(target, (0,), 3, sampling))
    if name == "unmodified":
        assert gap < TOL
    else:
        assert gap > 1e-2, f"the enumeration did not catch {name!r} (gap {gap:.3g})"


def forced_zero_violations(module: types.ModuleType) -> int:
    """Tokens the target rules out that ``module`` emits when every uniform r is exactly 0
    (torch.rand can return 0). The target gives token 2 probability 0 after every context; the
    draft proposes nothing else."""
    neg = -math.inf
    target = NGramModel(torch.tensor([[0.0, 0.5, neg]] * 3, dtype=torch.float64))
    draft = NGramModel(torch.tensor([[neg, neg, 0.0]] * 3, dtype=torch.float64))
    zeros = TorchWithRand(
        lambda *size, **kwargs: torch.zeros(
            *size, dtype=kwargs.get("dtype"), device=kwargs.get("device")
        )
    )
    emitted = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "torch", zeros)
        for gamma in (1, 2, 4):
            for temperature in (1.0, 0.7):
                emitted += module.speculative_decode(
                    target, draft, [0], 10, gamma=gamma, temperature=temperature, seed=gamma
                )
    return emitted.count(2)


@proof(
    "reference.py never accepts a token of target probability 0",
    "exact: r forced to 0",
    rejects=("r <= p/q (SGLang #35771)",),
)
def test_a_token_the_target_rules_out_is_never_accepted_even_at_r_zero() -> None:
    """SGLang #35771: accepting on r <= p/q keeps a token of target probability 0 when r = 0."""
    assert forced_zero_violations(reference) == 0
    assert forced_zero_violations(mutant("r <= ratio")) > 0


def test_every_mutant_edits_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every mutant builds (each edit found exactly once in reference.py), and an edit whose text
    is gone is refused: a refactor cannot silently turn a mutant into the real file."""
    for name in MUTANTS:
        mutant(name)
    monkeypatch.setitem(MUTANTS, "stale", [("r[n] < ratio", "r[n] <= ratio")])
    with pytest.raises(AssertionError, match="occurs 0 times, not once"):
        mutant("stale")


# ----------------------------------------------------------------------------- chi-square
TOY_RUNS = 2000
MUTANT_RUNS = 1000  # each mutant then gives p < 1e-7 (at 2000 runs: < 1e-18)
TOP = Sampling(temperature=0.8, top_k=2, top_p=0.8)


@pytest.fixture(scope="module")
def toy_pair() -> tuple[NGramModel, NGramModel]:
    """The statistical tests' bigram pair over 3 tokens (tests/speculative/engine/test_generation_statistical.py)."""
    return NGramModel.random(3, 2, seed=10, scale=1.0), NGramModel.random(
        3, 2, seed=1010, scale=1.0
    )


def sampled_pvalue(
    module: types.ModuleType, pair: tuple[NGramModel, NGramModel], sampling: Sampling, runs: int
) -> float:
    """Chi-square p-value of the first 3 tokens of ``runs`` seeded runs (gamma 2) against the target's."""
    target, draft = pair
    with pytest.MonkeyPatch.context() as mp:
        if sampling.top_k is not None or sampling.top_p is not None:
            mp.setattr(module, "warp", truncating_warp(sampling))
        counts = Counter(
            tuple(
                module.speculative_decode(
                    target, draft, [0], 3, gamma=2, temperature=sampling.temperature, seed=seed
                )
            )
            for seed in range(runs)
        )
    return chi_square_pvalue(counts, target_distribution(target, (0,), 3, sampling))


@proof(
    "reference.py's sampled runs follow the target's law", "chi-square, p > 1e-3, 2000 seeded runs"
)
@pytest.mark.parametrize("sampling", [Sampling(), TOP], ids=["temperature-1", "top-k-top-p"])
def test_sampled_runs_pass_the_chi_square_test(
    toy_pair: tuple[NGramModel, NGramModel], sampling: Sampling
) -> None:
    assert sampled_pvalue(reference, toy_pair, sampling, TOY_RUNS) > P_VALUE


@proof(
    "the chi-square test of reference.py has power",
    "chi-square, p > 1e-3 rejected, 1000 runs per mutant",
    rejects=("each enumerated mutant",),
)
@pytest.mark.parametrize(
    "name, sampling",
    [
        # a no-op at temperature 1
        pytest.param(name, TOP if name == "temperature on p only" else Sampling(), id=name)
        for name in ENUMERATED_MUTANTS
    ],
)
def test_chi_square_rejects_mutants(
    toy_pair: tuple[NGramModel, NGramModel], name: str, sampling: Sampling
) -> None:
    p_value = sampled_pvalue(mutant(name), toy_pair, sampling, MUTANT_RUNS)
    assert p_value < P_VALUE, f"the chi-square test did not catch {name!r} (p = {p_value:.3g})"


# ----------------------------------------------------------------------------- greedy
def toy_greedy(target: NGramModel, prompt: list[int], count: int) -> list[int]:
    """The target's own greedy output, by the reference warp at temperature 0 (first index of the maximum)."""
    seq = list(prompt)
    for _ in range(count):
        seq.append(ref_warp(target.next_logits(seq).tolist(), 0.0).index(1.0))
    return seq[len(prompt) :]


@proof(
    "at temperature 0 reference.py gives the engine's tokens and the target's greedy tokens, call for call",
    "exact identity, toy models",
)
@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("kind", ["independent", "close", "same"])
def test_greedy_toy_is_the_engine_and_the_target(gamma: int, kind: str) -> None:
    """Token for token, and call for call: the reference feeds both models exactly what the engine feeds them."""
    table = toy_table(5, 3, 11, 0.3)
    noise = 0.3 * torch.randn(
        table.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64
    )
    draft_table = {"independent": toy_table(5, 2, 13, 0.0), "close": table + noise, "same": table}[
        kind
    ]
    prompt, count = [1, 4], 30
    ours = [Recording(NGramModel(table)), Recording(NGramModel(draft_table))]
    engine = [Recording(NGramModel(table)), Recording(NGramModel(draft_table))]
    tokens = reference.speculative_decode(*ours, prompt, count, gamma=gamma, temperature=0, seed=1)
    assert (
        tokens
        == speculative_generate(*engine, prompt, count, gamma=gamma, temperature=0, seed=2).tokens
    )
    assert tokens == toy_greedy(NGramModel(table), prompt, count)
    assert [model.calls for model in ours] == [model.calls for model in engine]


SHIPPED = [ROOT / "weights" / "tiny-target", ROOT / "weights" / "tiny-draft"]
needs_shipped = pytest.mark.skipif(
    not all((path / "model.safetensors").is_file() for path in SHIPPED),
    reason="the shipped pair weights/tiny-target + weights/tiny-draft is absent",
)
TEXTS = ["Once upon a time", "The little dog ran to the park and", "Lily had a red ball. One day"]


def shipped_pair(dtype: torch.dtype) -> tuple[Any, Any, list[list[int]]]:
    tokenizer = load_tokenizer(SHIPPED[0])
    return (
        load_model(SHIPPED[0], dtype=dtype),
        load_model(SHIPPED[1], dtype=dtype),
        list(map(tokenizer.encode, TEXTS)),
    )


@proof(
    "on the shipped pair, reference.py, the engine and the target's greedy decoding agree",
    "exact identity in float64; float32 up to near-ties",
)
@needs_shipped
def test_greedy_shipped_pair_is_the_engine_and_the_target() -> None:
    """float64: the reference, the engine and the target's own greedy decoding (the plain
    autoregressive loop; for the first prompt also a no-cache forward per token, which costs more)
    agree token for token. float32: the reference and the engine make the same calls, so they agree
    too (the target's own float32 greedy output may differ at near-ties: docs/algorithm.md,
    numerics policy)."""
    count = 40
    target, draft, prompts = shipped_pair(torch.float64)
    for i, (prompt, gamma) in enumerate(zip(prompts, (4, 2, 5))):
        ours = reference.speculative_decode(
            target, draft, prompt, count, gamma=gamma, temperature=0
        )
        assert (
            ours
            == speculative_generate(target, draft, prompt, count, gamma=gamma, temperature=0).tokens
        )
        assert ours == autoregressive_generate(target, prompt, count, temperature=0).tokens
        if i == 0:
            assert ours == reference_greedy(target, prompt, count)
    target, draft, prompts = shipped_pair(torch.float32)
    for prompt in prompts:
        ours = reference.speculative_decode(target, draft, prompt, count, gamma=4, temperature=0)
        assert (
            ours
            == speculative_generate(target, draft, prompt, count, gamma=4, temperature=0).tokens
        )


# ----------------------------------------------------------------------------- stopping and bad input
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stops_at_max_new_tokens_and_max_seq_len(temperature: float) -> None:
    target = NGramModel.random(4, 2, seed=3, max_seq_len=12)
    draft = NGramModel.random(4, 2, seed=4, max_seq_len=10)  # the smaller max_seq_len is the limit
    for gamma in (1, 2, 5):
        for max_new in range(8):
            tokens = reference.speculative_decode(
                target, draft, [1, 2], max_new, gamma=gamma, temperature=temperature, seed=max_new
            )
            assert len(tokens) == max_new and all(0 <= t < 4 for t in tokens)
        assert (
            len(
                reference.speculative_decode(
                    target, draft, [1, 2, 3], 50, gamma=gamma, temperature=temperature, seed=0
                )
            )
            == 10 - 3
        )
        assert (
            reference.speculative_decode(
                target, draft, [1] * 10, 5, gamma=gamma, temperature=temperature
            )
            == []
        )


def test_same_seed_same_output() -> None:
    target, draft = NGramModel.random(6, 2, seed=5), NGramModel.random(6, 2, seed=6)
    runs = [reference.speculative_decode(target, draft, [0], 20, seed=seed) for seed in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gamma": 0}, "gamma must be an integer >= 1"),
        ({"gamma": -2}, "gamma must be an integer >= 1"),
        ({"gamma": 2.5}, "gamma must be an integer >= 1"),
        ({"gamma": "auto"}, "gamma must be an integer >= 1"),
        ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0"),
        ({"max_new_tokens": 3.0}, "max_new_tokens must be an integer >= 0"),
        ({"prompt_ids": []}, "the prompt is empty"),
        ({"prompt_ids": [0, 4]}, r"prompt ids must lie in \[0, 4\)"),
        ({"prompt_ids": [-1]}, r"prompt ids must lie in \[0, 4\)"),
        ({"prompt_ids": [0] * 65}, "more than max_seq_len"),
        ({"temperature": -1.0}, "temperature must be a finite number"),
        ({"draft": "vocab"}, "vocabulary has 5 tokens but the target's has 4"),
        ({"draft": "target"}, "the same object"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs: dict, match: str) -> None:
    target = NGramModel.random(4, 2, seed=0)
    drafts = {
        "vocab": NGramModel.random(5, 2, seed=1),
        "target": target,
        None: NGramModel.random(4, 2, seed=1),
    }
    args = {"prompt_ids": [0], "max_new_tokens": 4, **kwargs, "draft": drafts[kwargs.get("draft")]}
    with pytest.raises(ValueError, match=match):
        reference.speculative_decode(target, **args)
    assert target.calls == 0  # refused before any model runs


# ----------------------------------------------------------------------------- docs
def test_docs_show_reference_verbatim() -> None:
    """docs/algorithm.md shows reference.py whole, in the one ```python block that defines speculative_decode."""
    docs = (ROOT / "docs" / "algorithm.md").read_text()
    blocks = [
        block
        for block in re.findall(r"^```python\n(.*?)^```$", docs, flags=re.S | re.M)
        if "def speculative_decode(" in block
    ]
    assert len(blocks) == 1, (
        f"{len(blocks)} python blocks of docs/algorithm.md define speculative_decode"
    )
    # byte for byte, up to the file's trailing newline (the block ends with exactly one)
    assert blocks[0] == SOURCE.rstrip("\n") + "\n", (
        "docs/algorithm.md's copy of reference.py has drifted"
    )
