"""Suffix decoding (speculative/draft/suffix.py): its index, its proposals, and the exactness of
the engine with it.

* The proposal against a brute-force scan written here (every occurrence of every suffix, the
  next tokens counted): the same match, tokens and frequencies, also when the sequence grows
  between calls and when the window evicts its oldest starts; the incremental trie equals one
  built at once; and by hand.
* Greedy identity with the target alone, through speculative_generate and the command line.
* Chi-square end to end (a toy bigram target, the token-wise rule) with the variants of
  tests/support/statistical.py that apply to a deterministic drafter, as for prompt lookup.
* Three mutants of the module: two speed-only (a proposal that ignores the counts, and an index
  that keeps its own drafts after they were rejected: still exact, since any proposal made from
  the past is, with a one-hot q), and one exactness bug (the frequencies reported as q).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import generate
from speculative import speculative_generate
from speculative.draft.registry import drafter_kind
from speculative.proofs import check
from speculative.sampling import Sampling
from tests.support.cli import TARGET, needs_pair
from tests.support.mutation import mutated
from tests.support.proofs import proof
from tests.support.statistical import (
    BUGS,
    NOT_BUGS,
    P_VALUE,
    Setting,
    sample_counts,
    window_distribution,
)
from tests.support.toy_models import (
    NGramModel,
    chi_square_pvalue,
    ref_warp,
    reference_greedy_toy,
)

suffix = importlib.import_module("speculative.draft.suffix")


# ----------------------------------------------------------------------------- the reference
def brute_force(
    ids: list[int],
    gamma: int,
    max_tokens: int,
    max_match: int,
    max_depth: int,
    spec_factor: float,
    min_score: float,
) -> tuple[int, list[int], list[float]]:
    """(match length, tokens, frequencies) by scanning every start of the window each time."""
    n = len(ids)
    first = max(0, n - max_tokens)

    def followers(context: list[int]) -> dict[int, tuple[int, int]]:
        """token -> (how often it followed context, the position of its latest occurrence)."""
        out: dict[int, tuple[int, int]] = {}
        if len(context) >= max_depth:  # the trie keeps no children below max_depth
            return out
        for i in range(first, n - len(context)):
            if ids[i : i + len(context)] == context:
                end = i + len(context)
                count, _ = out.get(ids[end], (0, -1))
                out[ids[end]] = (count + 1, end)
        return out

    match = 0
    for k in range(min(max_match, n), 0, -1):
        if followers(ids[n - k :]):
            match = k
            break
    tokens: list[int] = []
    frequencies: list[float] = []
    if match == 0:
        return match, tokens, frequencies
    context = ids[n - match :]
    score = 1.0
    while len(tokens) < min(gamma, int(spec_factor * match)):
        after = followers(context)
        if not after:
            break
        best = max(after, key=lambda t: after[t])
        frequency = after[best][0] / sum(count for count, _ in after.values())
        if score * frequency < min_score:
            break
        score *= frequency
        tokens.append(best)
        frequencies.append(frequency)
        context = context + [best]
    return match, tokens, frequencies


SETTINGS = [  # max_tokens, max_match, max_depth, spec_factor, min_score
    (4096, 8, 32, 1.0, 0.1),
    (4096, 3, 6, 2.0, 0.0),
    (12, 4, 8, 1.5, 0.2),  # a window shorter than the sequences: eviction
    (8, 1, 8, 4.0, 0.05),
    (6, 2, 3, 3.0, 0.3),  # a shallow trie: the depth stops the chain
]


def disagreement(module, ids: list[int], split: int, gamma: int, setting: tuple) -> str | None:
    """Where ``module``'s SuffixIndex, fed ``ids[:split]`` then ``ids``, differs from the brute
    force (None: nowhere). Between the two calls the index also proposes, as the engine makes it."""
    index = module.SuffixIndex(*setting)
    for seq in (ids[:split], ids):
        got = index.continuation(list(seq), gamma)
        want = brute_force(list(seq), gamma, *setting)
        if (got.match, got.tokens, got.frequencies) != want:
            return f"{seq}, gamma {gamma}, {setting}: {got} != {want}"
    return None


def seeded_cases(count: int = 300, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(count):
        vocab = rng.choice([2, 3, 4])
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        yield ids, rng.randint(1, len(ids)), rng.randint(1, 8), rng.choice(SETTINGS)


def first_disagreement(module) -> str | None:
    return next(
        (d for case in seeded_cases() if (d := disagreement(module, *case)) is not None), None
    )


def dump(node, path: tuple[int, ...] = ()) -> dict[tuple[int, ...], tuple[int, int]]:
    """Every node of a trie as path -> (count, latest position)."""
    out = {path: (node.count, node.last)} if path else {}
    for token, child in node.children.items():
        out.update(dump(child, path + (token,)))
    return out


# ----------------------------------------------------------------------------- the index
@proof(
    "suffix decoding proposes the most frequent continuation of the longest recurring suffix",
    "exact, against a brute-force scan, 200 sequences plus 300 seeded ones",
    rejects=("suffix's latest occurrence (behaviour, not exactness)",),
)
@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    split=st.integers(1, 40),
    gamma=st.integers(1, 8),
    setting=st.sampled_from(SETTINGS),
)
def test_the_proposal_is_the_brute_force_one(
    ids: list[int], split: int, gamma: int, setting: tuple
) -> None:
    assert disagreement(suffix, ids, min(split, len(ids)), gamma, setting) is None


def test_the_seeded_cases_agree_with_the_brute_force() -> None:
    assert first_disagreement(suffix) is None


@settings(max_examples=150, derandomize=True, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), min_size=1, max_size=50),
    cuts=st.lists(st.integers(1, 50), max_size=4),
    setting=st.sampled_from(SETTINGS),
)
def test_incremental_updates_equal_a_rebuild(ids: list[int], cuts: list[int], setting) -> None:
    grown = suffix.SuffixIndex(*setting)
    for cut in sorted(cuts) + [len(ids)]:
        grown.update(ids[:cut])
    built = suffix.SuffixIndex(*setting)
    built.update(list(ids))
    assert dump(grown.root) == dump(built.root)
    assert len(grown.suffixes) == len(built.suffixes)
    assert grown.start == built.start == max(0, len(ids) - setting[0])
    # what the window holds is what a trie of its tokens alone holds, positions aside
    alone = suffix.SuffixIndex(*setting)
    alone.update(ids[built.start :])
    assert {p: c for p, (c, _) in dump(alone.root).items()} == {
        p: c for p, (c, _) in dump(built.root).items()
    }


def test_another_sequence_starts_the_index_over() -> None:
    index = suffix.SuffixIndex()
    index.update([1, 2, 3, 1, 2])
    index.update([7, 7, 7])
    fresh = suffix.SuffixIndex()
    fresh.update([7, 7, 7])
    assert dump(index.root) == dump(fresh.root) and index.seen == [7, 7, 7]


@proof(
    "suffix decoding's proposals by hand",
    "exact, by hand",
    rejects=("suffix's latest occurrence (behaviour, not exactness)",),
)
def test_suffix_by_hand() -> None:
    def propose(ids: list[int], gamma: int = 8, **kw) -> tuple[list[int], list[float]]:
        setting = {"max_match": 8, "max_depth": 32, "spec_factor": 1.0, "min_score": 0.1, **kw}
        found = suffix.SuffixIndex(**setting).continuation(ids, gamma)
        return found.tokens, found.frequencies

    # "5 6 7" is followed by 8 twice and by 9 once: the count wins over the latest occurrence
    assert propose([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7], 1) == ([8], [2 / 3])
    assert propose([1, 2, 3, 4]) == ([], [])  # no suffix occurred before
    assert propose([4, 4]) == ([4], [1.0])  # an occurrence overlapping the suffix itself
    # adaptive length: a match of 2 drafts at most 2 tokens with spec_factor 1, 4 with 2
    text = [1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert propose(text) == ([3, 4], [1.0, 1.0])
    assert propose(text, spec_factor=2.0) == ([3, 4, 5, 6], [1.0] * 4)
    # the score: "3" was followed by 9, 9, 8, 8 (the tie goes to the latest, 8), "3 8" by 1 and 2;
    # 0.5 * 0.5 < 0.3 stops the chain; at 0.2 it goes on until the match's 4 tokens
    text = [3, 9, 1, 3, 9, 2, 3, 8, 1, 3, 8, 2, 4, 3]
    assert propose(text, spec_factor=4.0, min_score=0.3) == ([8], [0.5])
    assert propose(text, spec_factor=4.0, min_score=0.2) == ([8, 2, 4, 3], [0.5, 0.5, 1.0, 1.0])
    # ties go to the latest occurrence, as prompt lookup's
    assert propose([1, 2, 9, 1, 2, 8, 1, 2], 2, min_score=0.0) == ([8, 1], [0.5, 1.0])


def test_the_window_bounds_the_trie() -> None:
    index = suffix.SuffixIndex(max_tokens=16, max_match=2, max_depth=4)
    rng = random.Random(3)
    for _ in range(300):
        index.update(index.seen + [rng.randrange(50)])
        assert len(dump(index.root)) <= 16 * 4
    assert index.start == 300 - 16
    assert sum(child.count for child in index.root.children.values()) == 16


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_match": 0}, "max_match"),
        ({"max_depth": 2.5}, "max_depth"),
        ({"max_match": 4, "max_depth": 4}, "room to continue"),
        ({"max_tokens": 10}, "at least max_depth"),
        ({"max_tokens": True}, "max_tokens"),
        ({"spec_factor": 0}, "spec_factor"),
        ({"min_score": 1.5}, "min_score"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        suffix.SuffixDrafter(**kwargs)


def test_the_window_defaults_to_the_engines_cache_length() -> None:
    drafter = suffix.SuffixDrafter()
    drafter.start(2, 700, None)
    drafter.keep_rows([], 2)
    assert [row.max_tokens for row in drafter.rows] == [700, 700]
    assert suffix.SuffixDrafter(max_tokens=64).index().max_tokens == 64


def test_it_is_registered() -> None:
    kind = drafter_kind("suffix")
    assert isinstance(kind.build(None, None), suffix.SuffixDrafter) and not kind.needs_files


# ----------------------------------------------------------------------------- greedy identity
def cycle_target() -> NGramModel:
    """A target that cycles through 0..5."""
    table = torch.full((6, 6), -5.0, dtype=torch.float64)
    for a in range(6):
        table[a, (a + 1) % 6] = 5.0
    return NGramModel(table)


def test_suffix_copies_a_repeated_text_and_stays_exact_greedy() -> None:
    target = cycle_target()
    prompt = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0]
    out = speculative_generate(
        target, suffix.SuffixDrafter(spec_factor=4.0), prompt, 24, gamma=4, temperature=0
    )
    assert out.tokens == reference_greedy_toy(target, prompt, 24)
    assert out.stats.accepted_draft_tokens == out.stats.drafted_tokens > 0
    assert out.stats.draft_calls == 0 and out.stats.tokens_per_target_call > 4


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_output_is_the_target_alone(seed: int, gamma) -> None:
    target = NGramModel.random(4, 2, seed=seed, scale=2.0)
    prompt = [seed % 4, 1, 2, 1, 2, 3, 1, 2]
    out = speculative_generate(
        target, suffix.SuffixDrafter(), prompt, 30, gamma=gamma, temperature=0
    )
    assert out.tokens == reference_greedy_toy(target, prompt, 30)


@needs_pair
def test_the_command_line_greedy_is_the_target_alone() -> None:
    def tokens(*argv: str) -> dict:
        buffer = io.StringIO()
        common = ["--target", str(TARGET), "--max-new-tokens", "24", "--dtype", "float64"]
        with contextlib.redirect_stdout(buffer):
            assert generate.main([*common, "--json", *argv]) == 0
        return json.loads(buffer.getvalue())

    alone = tokens("--no-draft")["tokens"]
    for argv in (["--draft", "suffix"], ["--draft", "suffix", "--gamma", "auto"]):
        doc = tokens(*argv)
        assert doc["tokens"] == alone and doc["stats"]["draft_calls"] == 0
        assert doc["settings"]["draft"] == "suffix"


def test_the_checker_passes_it() -> None:
    """python -m speculative.prove suffix, quick: the exact law by enumeration through the engine
    on small random targets, and greedy identity (the full run adds the chi-square)."""
    report = check(suffix.SuffixDrafter, quick=True, properties=["exact", "greedy"])
    assert report.ok, [result.line() for result in report.results]


# ----------------------------------------------------------------------------- chi-square
RUNS = 2000
PROMPT = [0, 1, 0, 2, 0]  # "0" was followed by 1 and by 2: frequencies of 1/2 from the start
SPEC_FACTOR = 2.0  # two tokens after a match of one: q-of-next-position needs a second one
SAMPLING = Sampling(temperature=0.7)
APPLICABLE_BUGS = ["inverted-ratio", "residual-from-p", "q-of-next-position"]  # as for lookup


@pytest.fixture(scope="module")
def toy() -> dict:
    target = NGramModel.random(3, 2, seed=10, scale=1.0)

    def next_probs(ctx: tuple[int, ...]) -> list[float]:
        s = SAMPLING
        return ref_warp(target.next_logits(ctx).tolist(), s.temperature, s.top_k, s.top_p)

    return {"target": target, "law": window_distribution(next_probs, PROMPT, 0, 3)}


def chi_square(toy: dict, module, gamma=2) -> float:
    """The p-value of the first 3 tokens of RUNS seeded runs against the target's law."""
    drafted = 0

    def run(seed: int) -> list[int]:
        nonlocal drafted
        out = speculative_generate(
            toy["target"],
            module.SuffixDrafter(spec_factor=SPEC_FACTOR),
            PROMPT,
            3,
            gamma=gamma,
            temperature=SAMPLING.temperature,
            seed=seed,
            verify="token",  # the bugs catalogued are of the token-wise rule
        )
        drafted += out.stats.drafted_tokens
        return out.tokens

    counts = sample_counts(run, RUNS, 0, 3)
    assert drafted >= RUNS  # the drafter did propose
    return chi_square_pvalue(counts, toy["law"])


@proof(
    "the engine with suffix decoding follows the target's law",
    "chi-square, p > 1e-3, 2000 seeded runs",
    rejects=("ratio inverted", "residual from p", "q of the next position"),
)
@pytest.mark.parametrize(
    "variant", ["correct", "gamma-auto", "ratio-without-min", "no-bonus-token"] + APPLICABLE_BUGS
)
def test_suffix_first_tokens_have_the_target_distribution(
    toy: dict, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    patch = BUGS.get(variant) or NOT_BUGS[variant]
    if patch is not None:
        patch(monkeypatch, Setting(SAMPLING, draft_after=lambda drafted: None))
    gamma = "auto" if variant == "gamma-auto" else 2
    p_value = chi_square(toy, suffix, gamma)
    if variant in BUGS:
        assert p_value < P_VALUE, f"the test did not catch {variant} (p = {p_value:.3g})"
    else:
        assert p_value > P_VALUE, f"{variant} rejected (p = {p_value:.3g})"


# ----------------------------------------------------------------------------- mutants
# Speed-only: the chain follows the latest occurrence, whatever the counts (prompt lookup's
# rule). Its proposals are still made from the past alone, so the output stays exact.
LATEST_OCCURRENCE = (
    "    return max(children, key=lambda t: (children[t].count, children[t].last))",
    "    return max(children, key=lambda t: children[t].last)",
)
# Speed-only: the index takes in its own drafts and never checks that the sequence it is given
# extends what it indexed, so rejected drafts stay in it (a rollback forgotten). Still exact:
# every proposal depends on the past only.
STALE_AFTER_ROLLBACK = (
    (
        "        if ids[: len(self.seen)] != self.seen:\n            self.reset()",
        "        pass",
    ),
    (
        "        return follow(self.suffixes[match], match, gamma, self.spec_factor, self.min_score)",
        "        found = follow(self.suffixes[match], match, gamma, self.spec_factor, self.min_score)\n"
        "        self.update(self.seen + found.tokens)\n        return found",
    ),
)
# Exactness: the frequencies reported as q (one frequency on the drafted token, the rest spread
# evenly), while the token is the argmax: Algorithm 1 then accepts min(1, p(x) / f) > p(x).
FREQUENCIES_AS_Q = (
    (
        "            found.append(chain.tokens)",
        "            found.append(chain)",
    ),
    (
        "        return copied_chains(found, device)",
        "        from speculative.draft.protocol import pad_rows\n\n"
        "        width = max((len(f.tokens) for f in found), default=0)\n"
        "        tokens = pad_rows([f.tokens for f in found], device, width)\n"
        "        return Draft(tokens, [len(f.tokens) for f in found], frequency_q(found, width))",
    ),
)


def mutant(*replacements: tuple[str, str]):
    """The module with ``replacements``, its registration left out (the name is taken)."""
    return mutated(suffix, *replacements, ("register_drafter(\n", "(\n"))


def frequency_q(found: list, width: int, vocab: int = 3) -> torch.Tensor:
    """q [B, width, V]: the chain's frequency on each drafted token, the rest spread evenly."""
    q = torch.full((len(found), width, vocab), 1.0 / vocab, dtype=torch.float64)
    for b, chain in enumerate(found):
        for i, (token, f) in enumerate(zip(chain.tokens, chain.frequencies)):
            q[b, i] = (1 - f) / (vocab - 1)
            q[b, i, token] = f
    return q


@proof(
    "the brute-force comparison rejects two speed-only mutants of suffix decoding",
    "exact, 300 seeded sequences",
    rejects=(
        "suffix's latest occurrence (behaviour, not exactness)",
        "suffix's stale index after a rollback (behaviour, not exactness)",
    ),
)
@pytest.mark.parametrize(
    "replacements",
    [(LATEST_OCCURRENCE,), STALE_AFTER_ROLLBACK],
    ids=["latest-occurrence", "stale-after-rollback"],
)
def test_the_brute_force_comparison_rejects_speed_only_mutants(replacements) -> None:
    assert first_disagreement(mutant(*replacements)) is not None


def test_the_speed_only_mutants_stay_exact_greedy() -> None:
    """They are behaviour, not exactness: the greedy output is still the target's."""
    target = NGramModel.random(4, 2, seed=1, scale=2.0)
    prompt = [1, 2, 1, 2, 3, 1, 2]
    for replacements in ((LATEST_OCCURRENCE,), STALE_AFTER_ROLLBACK):
        drafter = mutant(*replacements).SuffixDrafter()
        out = speculative_generate(target, drafter, prompt, 30, gamma=3, temperature=0)
        assert out.tokens == reference_greedy_toy(target, prompt, 30)


@proof(
    "the chi-square test rejects suffix decoding reporting its frequencies as q",
    "chi-square, p < 1e-3, 2000 seeded runs",
    rejects=("suffix's frequencies as q",),
)
def test_the_chi_square_rejects_frequencies_reported_as_q(toy: dict) -> None:
    module = mutant(*FREQUENCIES_AS_Q)
    module.frequency_q = frequency_q
    p_value = chi_square(toy, module)
    assert p_value < P_VALUE, f"frequencies-as-q not caught (p = {p_value:.3g})"


# ----------------------------------------------------------------------------- across requests
# speculative/draft/responses.py: the store of earlier responses that serve.py keeps per API key.
responses = importlib.import_module("speculative.draft.responses")


def substring_counts(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Every substring of at most ``depth`` tokens of the sequences, with its occurrences."""
    counts: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] = counts.get(tuple(seq[start:end]), 0) + 1
    return counts


def kept_by_budget(
    history: list[tuple[str, list[int]]], budget: int
) -> list[tuple[str, list[int]]]:
    """The newest responses that fit in ``budget`` tokens together (each cut to its last budget
    tokens): the oldest leave first."""
    kept: list[tuple[str, list[int]]] = []
    total = 0
    for key, seq in reversed([(k, s[-budget:]) for k, s in history]):
        if total + len(seq) > budget:
            break
        kept.insert(0, (key, seq))
        total += len(seq)
    return kept


@pytest.mark.parametrize("budget, depth", [(40, 4), (25, 6), (200, 16), (7, 3)])
def test_eviction_keeps_the_budget_and_the_counts_of_the_responses_kept(budget, depth) -> None:
    """After every response: the tokens held stay within the budget, the responses kept are the
    newest that fit, and each key's trie is exactly the substring counts of its kept responses,
    recounted here from scratch (the nodes counted too)."""
    rng = random.Random(budget)
    store = responses.ResponseStore(budget, max_match=depth - 1, max_depth=depth)
    history: list[tuple[str, list[int]]] = []
    for _ in range(60):
        key = rng.choice("abc")
        seq = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        store.add(key, seq)
        history.append((key, seq))
        kept = kept_by_budget(history, budget)
        assert store.tokens == sum(len(s) for _, s in kept) <= budget
        for key in "abc":
            want = substring_counts([s for k, s in kept if k == key], depth)
            trie = store.tries.get(key)
            got = {p: count for p, (count, _) in dump(trie.root).items()} if trie else {}
            assert got == want
            assert (trie.nodes if trie else 0) == len(want)
        figures = store.figures()
        assert figures.tokens == store.tokens and figures.nodes == sum(
            len(substring_counts([s for k, s in kept if k == key], depth)) for key in "abc"
        )
        assert figures.partitions == {
            key: (sum(1 for k, _ in kept if k == key), sum(len(s) for k, s in kept if k == key))
            for key in "abc"
            if any(k == key for k, _ in kept)
        }


def leaks(module) -> list[int]:
    """What key "b" is proposed after key "a" alone left a response: [] unless text crosses."""
    store = module.ResponseStore(1000, max_match=3, max_depth=8)
    store.partition("a").add([9, 9, 1, 2, 3, 4, 5, 6, 7], 2)
    # a match of 3, continued up to gamma (the default factor allows 4 x 3)
    assert store.partition("a").continuation([1, 2, 3], 4).tokens == [4, 5, 6, 7]
    drafter = suffix.SuffixDrafter()
    drafter.keep_rows([], 1)
    drafter.joined([store.partition("b")])
    return (
        drafter.continuation(0, [8, 1, 2, 3], 4).tokens
        + store.partition("b").continuation([1, 2, 3], 4).tokens
    )


MERGED_PARTITIONS = (
    (
        "        return self.store.continuation(self.key, ids, gamma)",
        "        return self.store.continuation(None, ids, gamma)",
    ),
    (
        "            self.store.add(self.key, ids[",
        "            self.store.add(None, ids[",
    ),
)


def test_one_keys_responses_are_never_proposed_for_another_key() -> None:
    assert leaks(responses) == []
    assert leaks(mutated(responses, *MERGED_PARTITIONS)) == [4, 5, 6, 7, 4, 5, 6, 7]


def test_a_response_is_stored_after_its_prompts_last_match_tokens() -> None:
    store = responses.ResponseStore(100, max_match=2, max_depth=4)
    store.partition(None).add([1, 2, 3, 4, 5, 6], 4)  # prompt 1 2 3 4, response 5 6
    assert list(store.order) == [(None, [3, 4, 5, 6])]
    store.partition(None).add([7, 8], 2)  # nothing generated: nothing stored
    assert store.tokens == 4 and store.figures().partitions == {"anonymous": (1, 4)}


def test_the_proposal_with_more_tokens_expected_wins_and_a_tie_keeps_the_rows_own() -> None:
    c = suffix.Continuation([1, 2], [0.5, 0.5], 2)
    assert c.expected == pytest.approx(0.75) and suffix.Continuation().expected == 0
    store = responses.ResponseStore(100, max_match=2, max_depth=8, spec_factor=4.0, min_score=0.0)
    memory = store.partition("k")
    memory.add([0, 0, 5, 6, 7, 8], 2)  # after "0 5": 6 7 8, seen once
    drafter = suffix.SuffixDrafter(max_match=2, max_depth=8, spec_factor=4.0, min_score=0.0)
    drafter.keep_rows([], 1)
    drafter.joined([memory])
    # the row's own text has "5" followed by 9 then by 6: the store's "0 5" -> 6 7 8 expects more
    assert drafter.continuation(0, [5, 9, 5, 6, 4, 0, 5], 3).tokens == [6, 7, 8]
    # the same chain in the row's own text: a tie, the row's own is kept (its frequencies equal)
    own = [0, 5, 6, 7, 8, 0, 5]
    assert drafter.continuation(0, own, 3) == drafter.rows[0].continuation(own, 3)


def test_a_warm_store_keeps_greedy_outputs_the_target_alones_and_drafts_from_it() -> None:
    """Through the engine (memory rows, the joined and finished hooks): requests under one key
    repeat an earlier one's answer, drafted from the store, and every output is the target's."""
    from speculative import Engine

    target = NGramModel.random(5, 2, seed=3, scale=3.0)
    store = responses.ResponseStore(500, spec_factor=1.0)
    engine = Engine(
        target, suffix.SuffixDrafter(spec_factor=1.0), gamma=4, temperature=0, cache_len=64
    )
    prompts = [[1, 2, 3], [4, 0, 1], [1, 2, 3], [4, 0, 1], [1, 2, 3]]
    rows = [engine.add(p, 24, memory=store.partition("k")) for p in prompts[:2]]
    engine.run()
    first = sum(row.stats.drafted_tokens for row in rows)
    assert store.figures().partitions["k"][0] == 2
    again = [engine.add(p, 24, memory=store.partition("k")) for p in prompts[2:]]
    engine.run()
    for row, prompt in zip(rows + again, prompts):
        assert row.result().tokens == reference_greedy_toy(target, prompt, 24)
    # the repeats were drafted from the store: more per row than the first requests, all accepted
    assert min(row.stats.drafted_tokens for row in again) > first / 2
    cold = Engine(
        target, suffix.SuffixDrafter(spec_factor=1.0), gamma=4, temperature=0, cache_len=64
    )
    alone = cold.add(prompts[2], 24)
    cold.run()
    assert again[0].stats.accepted_draft_tokens > alone.stats.accepted_draft_tokens
