"""The drafter interface, prompt lookup and the feature drafter (speculative.draft,
speculative.draft.lookup, speculative.draft.eagle), and Algorithm 1's exactness over every drafter.

* The interface: a plain model and ModelDrafter around it are the same run, token for
  token; anything else is refused with a clear error.
* Prompt lookup: its incremental index against a brute-force scan written here.
* Exact enumeration with a deterministic drafter: q is one-hot on the drafted token, and
  the emitted distribution equals the target's to 1e-12 in float64 -- with the real
  prompt-lookup proposals, blocks shorter than gamma and empty blocks included; broken
  rules are caught by the same enumeration.
* Chi-square end to end, for lookup (toy bigram target) and for the feature drafter
  (a LLaMA target and a random head), with the mutants of test_speculative_statistical
  that apply to them (temperature-on-p-only is no bug for a one-hot q, and
  bonus-from-draft needs a draft model's distribution).
* Greedy identity for every drafter, and the feature drafter's bookkeeping: the features
  it keeps are the target's own, position by position.
"""

from __future__ import annotations

import copy
import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from proofs import proof
from strategies import max_gap, samplings, toy_table
from test_speculative_exact import TOL, target_distribution
from test_speculative_statistical import (
    BUGS,
    NOT_BUGS,
    P_VALUE,
    Setting,
    sample_counts,
    window_distribution,
)
from toy_models import NGramModel, chi_square_pvalue, llama_next_logits, random_llama, ref_warp, reference_greedy

from model.call import chain
from speculative import (
    Draft,
    FeatureDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    as_drafter,
    speculative_generate,
)
from speculative.draft.lookup import NgramIndex
from speculative.proofs.toys import random_head  # the feature head of the tests and of speculative.prove
from speculative.sampling import Sampling, warp

verify = importlib.import_module("speculative.verify.token")


# ----------------------------------------------------------------------------- interface
def test_a_plain_model_and_its_model_drafter_are_the_same_run() -> None:
    target, draft = NGramModel.random(5, 2, seed=1), NGramModel.random(5, 2, seed=2)
    for temperature in (0.0, 0.8):
        plain = speculative_generate(target, draft, [1, 2], 30, gamma=3, temperature=temperature, seed=4)
        wrapped = speculative_generate(target, ModelDrafter(draft), [1, 2], 30, gamma=3, temperature=temperature,
                                       seed=4)
        assert plain.tokens == wrapped.tokens
        assert plain.stats.gamma_history == wrapped.stats.gamma_history


def test_as_drafter() -> None:
    model = NGramModel.random(3, 2)
    lookup = PromptLookupDrafter()
    assert as_drafter(lookup) is lookup
    assert isinstance(as_drafter(model), ModelDrafter) and as_drafter(model).model is model
    with pytest.raises(TypeError, match="draft must be a model"):
        as_drafter("tiny-draft")


def test_a_drafter_for_another_vocabulary_is_refused() -> None:
    target = random_llama(vocab=8)
    head = random_head(random_llama(vocab=9))
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(target, FeatureDrafter(head, random_llama(vocab=9)), [1], 4)


@proof('a drafter that proposes fewer tokens, or none, stays exact',
       'exact identity, greedy')
def test_a_drafter_may_propose_fewer_tokens_or_none() -> None:
    """A drafter that proposes nothing turns every iteration into a plain target step; one
    that proposes a single token gets it verified like any block."""

    class Fixed:
        reads_features, vocab_size, max_seq_len = False, None, None

        def __init__(self, block: list[int]) -> None:
            self.block = block

        def start(self, max_rows, cache_len, target=None):
            pass

        def propose(self, ids, gammas, sampling, generators, device):
            return Draft(torch.tensor([self.block[:g] for g in gammas], dtype=torch.long).view(len(gammas), -1),
                         [len(self.block[:g]) for g in gammas])

        def commit(self, lengths, hidden=None, hidden_starts=None):
            pass

        def keep_rows(self, rows, new=0):
            pass

    target = NGramModel.random(4, 2, seed=3)
    greedy = speculative_generate(target, Fixed([]), [0], 10, gamma=4, temperature=0)
    assert greedy.stats.target_calls == 10 and greedy.stats.drafted_tokens == 0
    assert greedy.tokens == reference_greedy_toy(target, [0], 10)
    one = speculative_generate(target, Fixed([2]), [0], 10, gamma=4, temperature=0)
    assert one.tokens == greedy.tokens and set(one.stats.gamma_history) <= {0, 1}


def reference_greedy_toy(model: NGramModel, prompt: list[int], count: int) -> list[int]:
    seq = list(prompt)
    for _ in range(count):
        seq.append(int(model.next_logits(seq).argmax()))
    return seq[len(prompt):]


# ----------------------------------------------------------------------------- prompt lookup
def brute_force_lookup(ids: list[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Scan every earlier occurrence of every suffix, longest first, latest first."""
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        suffix = ids[len(ids) - n:]
        for start in range(len(ids) - n - 1, -1, -1):  # a match needs a token after it
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + gamma]
    return []


@settings(max_examples=200, derandomize=True, deadline=None)
@given(ids=st.lists(st.integers(0, 3), min_size=1, max_size=40), gamma=st.integers(1, 6),
       ngrams=st.sampled_from([(3, 1), (2, 2), (4, 2), (1, 1)]), split=st.integers(1, 40))
def test_lookup_matches_a_brute_force_scan(ids: list[int], gamma: int, ngrams: tuple[int, int], split: int) -> None:
    """Also when the sequence grows between calls (the index is updated incrementally)."""
    drafter = NgramIndex(*ngrams)
    first = ids[:min(split, len(ids))]
    assert drafter.lookup(first, gamma) == brute_force_lookup(first, gamma, *ngrams)
    assert drafter.lookup(ids, gamma) == brute_force_lookup(ids, gamma, *ngrams)


@proof('prompt lookup copies after the latest occurrence',
       'exact, by hand',
       rejects=("lookup's first occurrence (behaviour, not exactness)",))
def test_lookup_by_hand() -> None:
    drafter = NgramIndex(max_ngram=3, min_ngram=1)
    assert drafter.lookup([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]  # "5 6 7" followed by 8 9 5
    assert drafter.lookup([1, 2, 3, 4], 3) == []  # no suffix occurred before
    assert drafter.lookup([1, 2, 9, 1, 2, 8, 1, 2], 2) == [8, 1]  # the latest occurrence
    assert drafter.lookup([4, 4], 5) == [4]  # overlapping with the suffix itself
    assert NgramIndex(max_ngram=2, min_ngram=2).lookup([3, 1, 2, 3], 2) == []  # 1-grams not allowed


@pytest.mark.parametrize("kwargs, match", [
    ({"max_ngram": 0}, "max_ngram"), ({"min_ngram": 0}, "min_ngram"), ({"max_ngram": 2, "min_ngram": 3}, "exceed"),
    ({"max_ngram": 2.5}, "max_ngram"), ({"min_ngram": True}, "min_ngram"),
])
def test_lookup_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PromptLookupDrafter(**kwargs)


def test_lookup_copies_a_repeated_text_and_stays_exact_greedy() -> None:
    """A target that cycles through 0..5 is copied perfectly once one cycle is in the prompt."""
    table = torch.full((6, 6), -5.0, dtype=torch.float64)
    for a in range(6):
        table[a, (a + 1) % 6] = 5.0
    target = NGramModel(table)
    out = speculative_generate(target, PromptLookupDrafter(), [0, 1, 2, 3, 4, 5, 0], 24, gamma=4, temperature=0)
    assert out.tokens == reference_greedy_toy(target, [0, 1, 2, 3, 4, 5, 0], 24)
    assert out.stats.accepted_draft_tokens == out.stats.drafted_tokens > 0
    assert out.stats.draft_calls == 0 and out.stats.tokens_per_target_call > 4


# ----------------------------------------------------------------------------- exact, deterministic drafter
def lookup_distribution(target: NGramModel, prompt: tuple[int, ...], gamma: int, length: int, sampling: Sampling,
                        acceptance=verify.acceptance_probability,
                        residual=verify.residual_distribution) -> dict[tuple[int, ...], float]:
    """Exact P(first `length` emitted tokens) of Algorithm 1 with prompt lookup as the drafter:
    each iteration's block is the real drafter's proposal for the sequence so far (possibly
    shorter than gamma, or empty), q_i is one-hot on x_i, and every accept/reject outcome
    and every residual or bonus token is a branch."""
    out: dict[tuple[int, ...], float] = {}

    def p_of(context: tuple[int, ...]) -> torch.Tensor:
        return warp(target.next_logits(context), sampling)

    def emit(context: tuple[int, ...], prob: float) -> bool:
        if len(context) - len(prompt) < length:
            return False
        key = context[len(prompt):len(prompt) + length]
        out[key] = out.get(key, 0.0) + prob
        return True

    def iteration(context: tuple[int, ...], prob: float) -> None:
        if emit(context, prob):
            return
        block = NgramIndex().lookup(list(context), gamma)
        position(context, block, 0, prob)

    def position(context: tuple[int, ...], block: list[int], i: int, prob: float) -> None:
        if i > 0 and emit(context, prob):
            return
        p = p_of(context)
        if i == len(block):  # all accepted (or nothing proposed): the token comes from p
            for y in range(len(p)):
                if p[y] > 0:
                    iteration(context + (y,), prob * p[y].item())
            return
        x = block[i]
        q = torch.zeros_like(p)
        q[x] = 1.0
        keep = acceptance(p, q, x).item()
        if keep > 0:
            position(context + (x,), block, i + 1, prob * keep)
        if 1 - keep > 1e-15:
            r = residual(p, q)
            for y in range(len(r)):
                if r[y] > 0:
                    iteration(context + (y,), prob * (1 - keep) * r[y].item())

    iteration(prompt, 1.0)
    return out


@proof("prompt lookup emits exactly the target's law",
       'exact enumeration, float64, to 1e-12')
@settings(max_examples=120, derandomize=True, deadline=None)
@given(vocab=st.integers(2, 4), gamma=st.integers(1, 3), order=st.sampled_from([2, 3]),
       seed=st.integers(0, 10_000), holes=st.sampled_from([0.0, 0.3]),
       prompt=st.lists(st.integers(0, 3), min_size=1, max_size=5), sampling=samplings)
def test_lookup_emits_exactly_the_target_distribution(vocab: int, gamma: int, order: int, seed: int, holes: float,
                                                      prompt: list[int], sampling: Sampling) -> None:
    target = NGramModel(toy_table(vocab, order, seed, holes))
    prompt = tuple(t % vocab for t in prompt)
    got = lookup_distribution(target, prompt, gamma, 3, sampling)
    assert math.isclose(sum(got.values()), 1.0, abs_tol=TOL)
    assert max_gap(got, target_distribution(target, prompt, 3, sampling)) < TOL


def always_accept(p: torch.Tensor, q: torch.Tensor, token: int) -> torch.Tensor:
    """The lookup's tokens taken as right: acceptance 1 wherever the target allows them."""
    return (p[token] > 0).to(p.dtype)


@proof('the lookup enumeration can fail',
       'exact',
       rejects=('residual from p', 'always accept', 'ratio inverted'))
@pytest.mark.parametrize("name, acceptance, residual", [
    ("residual-from-p", verify.acceptance_probability, lambda p, q: p),
    ("always-accept", always_accept, verify.residual_distribution),
    ("inverted-ratio", lambda p, q, x: verify.acceptance_probability(q, p, x), verify.residual_distribution),
])
def test_lookup_enumeration_catches_broken_rules(name: str, acceptance, residual) -> None:
    target = NGramModel(toy_table(3, 2, 5, 0.0))
    prompt = (0, 1, 2, 0, 1)  # lookup proposes from the first iteration on
    got = lookup_distribution(target, prompt, 2, 3, Sampling(), acceptance, residual)
    assert max_gap(got, target_distribution(target, prompt, 3, Sampling())) > 1e-3, name


# ----------------------------------------------------------------------------- chi-square, lookup
LOOKUP_RUNS = 2000
LOOKUP_PROMPT = [0, 1, 2, 0, 1]
LOOKUP_SAMPLING = Sampling(temperature=0.7)
LOOKUP_BUGS = ["inverted-ratio", "residual-from-p", "q-of-next-position"]  # the others need a draft model's q


@pytest.fixture(scope="module")
def lookup_toy() -> dict:
    target = NGramModel.random(3, 2, seed=10, scale=1.0)
    s = LOOKUP_SAMPLING

    def next_probs(ctx: tuple[int, ...]) -> list[float]:
        return ref_warp(target.next_logits(ctx).tolist(), s.temperature, s.top_k, s.top_p)

    return {"target": target, "next_probs": next_probs}


@proof("the engine with prompt lookup follows the target's law",
       'chi-square, p > 1e-3, 2000 seeded runs',
       rejects=('ratio inverted', 'residual from p', 'q of the next position'))
@pytest.mark.parametrize("variant", ["correct", "gamma-auto", "ratio-without-min", "no-bonus-token"] + LOOKUP_BUGS)
def test_lookup_first_tokens_have_the_target_distribution(lookup_toy: dict, variant: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    patch = BUGS.get(variant) or NOT_BUGS[variant]
    if patch is not None:
        patch(monkeypatch, Setting(LOOKUP_SAMPLING, draft_after=lambda drafted: None))
    gamma = "auto" if variant == "gamma-auto" else 2
    s = LOOKUP_SAMPLING
    drafted = 0

    def generate(seed: int) -> list[int]:
        nonlocal drafted
        out = speculative_generate(lookup_toy["target"], PromptLookupDrafter(), LOOKUP_PROMPT, 3, gamma=gamma,
                                   temperature=s.temperature, seed=seed)
        drafted += out.stats.drafted_tokens
        return out.tokens

    counts = sample_counts(generate, LOOKUP_RUNS, 0, 3)
    assert drafted >= LOOKUP_RUNS  # the lookup did propose
    p_value = chi_square_pvalue(counts, window_distribution(lookup_toy["next_probs"], LOOKUP_PROMPT, 0, 3))
    if variant in BUGS:
        assert p_value < P_VALUE, f"the test did not catch {variant} (p = {p_value:.3g})"
    else:
        assert p_value > P_VALUE, f"{variant} rejected (p = {p_value:.3g})"


# ----------------------------------------------------------------------------- feature drafter
FEATURE_RUNS = 1000
FEATURE_CASES = [
    ("correct", Sampling()),
    ("correct", Sampling(temperature=0.8, top_k=5, top_p=0.9)),
    ("inverted-ratio", Sampling()),
    ("residual-from-p", Sampling()),
    ("q-of-next-position", Sampling()),
    ("temperature-on-p-only", Sampling(temperature=0.4)),
]


@pytest.fixture(scope="module")
def feature_pair() -> dict:
    target = random_llama(vocab=8, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32, seed=0)
    return {"target": target, "head": random_head(target), "logits": llama_next_logits(target)}


@proof("the engine with the feature head follows the target's law",
       'chi-square, p > 1e-3, 1000 seeded runs',
       rejects=('the same bugs as the draft model',))
@pytest.mark.parametrize("variant, sampling", FEATURE_CASES, ids=[f"{v}-{s}" for v, s in FEATURE_CASES])
def test_feature_drafter_first_tokens_have_the_target_distribution(feature_pair: dict, variant: str,
                                                                   sampling: Sampling,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """gamma 2, tokens 2 and 3 jointly (64 cells): the first iteration reads the prompt and
    drafts nothing, so the drafted tokens (and the bugs) start at token 2."""
    if variant in BUGS:
        BUGS[variant](monkeypatch, Setting(sampling, draft_after=lambda drafted: None))
    target = feature_pair["target"]
    drafter = FeatureDrafter(feature_pair["head"], target)
    drafted = 0

    def generate(seed: int) -> list[int]:
        nonlocal drafted
        out = speculative_generate(target, drafter, [1, 5], 4, gamma=2, temperature=sampling.temperature,
                                   top_k=sampling.top_k, top_p=sampling.top_p, seed=seed)
        drafted += out.stats.drafted_tokens
        return out.tokens

    counts = sample_counts(generate, FEATURE_RUNS, 1, 2)

    def next_probs(ctx: tuple[int, ...]) -> list[float]:
        return ref_warp(feature_pair["logits"](ctx).tolist(), sampling.temperature, sampling.top_k, sampling.top_p)

    p_value = chi_square_pvalue(counts, window_distribution(next_probs, [1, 5], 1, 2))
    assert drafted >= FEATURE_RUNS  # the drafter did draft
    if variant in BUGS:
        assert p_value < P_VALUE, f"the test did not catch {variant} (p = {p_value:.3g})"
    else:
        assert p_value > P_VALUE, f"{variant} rejected (p = {p_value:.3g})"


@pytest.fixture(scope="module")
def llama64() -> dict:
    target = random_llama(vocab=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=64,
                          seed=3, dtype=torch.float64)
    return {"target": target, "head": random_head(target, std=0.2)}


@proof("every drafter's greedy output is the target's",
       'exact identity')
@settings(max_examples=25, derandomize=True, deadline=None)
@given(prompt=st.lists(st.integers(0, 15), min_size=1, max_size=8), gamma=st.integers(1, 6),
       kind=st.sampled_from(["lookup", "feature"]))
def test_greedy_output_of_every_drafter_is_the_target_greedy_output(llama64: dict, prompt: list[int], gamma: int,
                                                                    kind: str) -> None:
    target = llama64["target"]
    drafter = PromptLookupDrafter() if kind == "lookup" else FeatureDrafter(llama64["head"], target)
    out = speculative_generate(target, drafter, prompt, 16, gamma=gamma, temperature=0)
    assert out.tokens == reference_greedy(target, prompt, 16)


@proof("the feature drafter keeps the target's features of the accepted path only",
       'exact, to 1e-9')
def test_feature_drafter_keeps_the_target_features_of_the_accepted_path(llama64: dict) -> None:
    """After every iteration the features it holds for positions 0..L-2 are the target's own
    (a no-cache forward over the final sequence), and the head read every position once
    with a true feature: a drafter that kept the features of rejected tokens, or that did
    not re-read positions it had drafted from predicted features, fails here."""
    target = llama64["target"]
    head = copy.deepcopy(llama64["head"])
    drafter = FeatureDrafter(head, target)
    calls: list[tuple[int, int]] = []
    real_forward = head.forward

    def recording(features, embeddings, call=None):
        calls.append((None if call is None else int(call.slots[0, 0]), features.shape[1]))
        return real_forward(features, embeddings, call)

    head.forward = recording
    snapshots = []

    def known(drafter: FeatureDrafter) -> torch.Tensor:  # the features it holds for its row
        return drafter.features[0, :drafter.known[0]].clone()

    out = speculative_generate(target, drafter, [3, 1, 4], 30, gamma=3, temperature=1.0, seed=2,
                               callback=lambda ids, flags: snapshots.append(known(drafter)))
    assert 0 < out.stats.accepted_draft_tokens < out.stats.drafted_tokens  # accepted and rejected both happened
    sequence = [3, 1, 4] + out.tokens
    with torch.no_grad():
        _, hidden = target(torch.tensor([sequence]), return_hidden=True)
    for kept in snapshots:
        torch.testing.assert_close(kept, hidden[0, :kept.shape[0]], rtol=1e-9, atol=1e-9)
    assert snapshots[-1].shape[0] == len(sequence) - 1
    # Catch-up calls (the first of each iteration) start where the true inputs end.
    firsts = [start for start, width in calls if width > 1 or start == 0]
    assert firsts == sorted(firsts)


def test_feature_drafter_needs_the_target_features() -> None:
    target = random_llama(vocab=8)
    drafter = FeatureDrafter(random_head(target), target)
    drafter.start(1, 8, target)
    with pytest.raises(ValueError, match="hidden states"):
        drafter.commit([3], None, [0])
    with pytest.raises(ValueError, match="another target"):
        drafter.start(1, 8, random_llama(vocab=8))


def test_return_hidden_is_what_the_output_head_reads() -> None:
    model = random_llama(vocab=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, dtype=torch.float64)
    tokens = torch.tensor([[1, 5, 2, 7, 3]])
    with torch.no_grad():
        logits, hidden = model(tokens, return_hidden=True)
        torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)
        torch.testing.assert_close(model.lm_head(hidden), logits, rtol=0, atol=0)
        model.setup_cache(1, 8)
        first, h1 = model(tokens[:, :3], chain(0, 3, "cpu"), return_hidden=True)
        second, h2 = model(tokens[:, 3:], chain(3, 2, "cpu"), return_hidden=True)
    torch.testing.assert_close(torch.cat([h1, h2], dim=1), hidden, rtol=1e-12, atol=1e-12)


def test_seeded_runs_of_lookup_and_feature_drafters_repeat() -> None:
    target = random_llama(vocab=8, max_seq_len=40)
    for drafter in (PromptLookupDrafter(), FeatureDrafter(random_head(target), target)):
        runs = [speculative_generate(target, drafter, [1, 2, 1, 2], 20, gamma=3, seed=9).tokens for _ in range(2)]
        assert runs[0] == runs[1]
        other = speculative_generate(target, drafter, [1, 2, 1, 2], 20, gamma=3, seed=10).tokens
        assert other != runs[0]


# ----------------------------------------------------------------------------- loading
def test_feature_head_round_trip_and_load_drafter(tmp_path) -> None:
    from weights import load_drafter
    from weights.drafters import load_feature_head, save_feature_head

    target = random_llama(vocab=8, dim=16, n_layers=2, max_seq_len=32)
    head = random_head(target)
    save_feature_head(head, tmp_path / "head", target, target_name="toy-target")
    loaded = load_feature_head(tmp_path / "head", target)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert (tmp_path / "head" / "model.safetensors").stat().st_mode & 0o044  # readable by others, like config.json
    assert isinstance(load_drafter(tmp_path / "head", target), FeatureDrafter)
    assert isinstance(load_drafter("lookup", target), PromptLookupDrafter)


@pytest.mark.parametrize("other, what", [
    ({"dim": 32, "n_heads": 2}, "hidden_size"),
    ({"vocab": 9}, "vocab_size"),
    ({"n_layers": 3}, "num_hidden_layers"),
    ({"seed": 11}, "fingerprint"),
])
def test_a_head_trained_for_another_target_is_refused(tmp_path, other: dict, what: str) -> None:
    from weights import CheckpointError
    from weights.drafters import load_feature_head, save_feature_head

    shape = {"vocab": 8, "dim": 16, "n_layers": 2, "n_heads": 2, "seed": 0}
    trained_for = random_llama(vocab=8, dim=16, n_layers=2, n_heads=2, seed=0)
    save_feature_head(random_head(trained_for), tmp_path / "head", trained_for, target_name="target-a")
    another = random_llama(**{**shape, **other})
    with pytest.raises(CheckpointError, match=f"target-a.*{what}|{what}.*target-a") as err:
        load_feature_head(tmp_path / "head", another, "target-b")
    assert "target-b" in str(err.value) and "target-a" in str(err.value)
    # The same target, cast to bfloat16, is still the one the head was trained for.
    load_feature_head(tmp_path / "head", copy.deepcopy(trained_for).to(torch.bfloat16))


def test_a_broken_head_folder_is_a_checkpoint_error(tmp_path) -> None:
    from weights import CheckpointError
    from weights.drafters import load_feature_head, save_feature_head

    target = random_llama(vocab=8, dim=16)
    save_feature_head(random_head(target), tmp_path / "head", target)
    path = tmp_path / "head" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-64:] = b"\xff" * 64  # NaN in float32
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="non-finite"):
        load_feature_head(tmp_path / "head", target)
    (tmp_path / "head" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="feature head"):
        load_feature_head(tmp_path / "head", target)
