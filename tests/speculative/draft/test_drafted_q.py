"""Each drafter hands the verifier the distribution its tokens were drawn from.

Algorithm 1 is exact for any q, but only if x_i ~ q_i and the ratio and residual use that
same q_i. transformers #47932 (vLLM #10198 had the same slip) drew the draft token from the
warped distribution and handed the verifier the raw softmax: at temperature 1 with no
top-k/top-p the two coincide, so only a decoding setting shows it, and before this file only
one chi-square test did. Here each drafter's q is compared, row by row, with the reference
warp (tests/support/toy_models.py: ref_warp, plain Python) of the logits it drew from, for a chain and
for a batch of rows, under temperature, top-k and top-p; and the check is shown to fail on
that bug written into the drafters' sampling step."""

from __future__ import annotations

import pytest
import torch

import speculative.draft.eagle as eagle_module
import speculative.draft.model as model_module
import speculative.draft.protocol as drafter_module
from model.call import chain
from speculative.draft.eagle import FeatureDrafter
from speculative.draft.lookup import PromptLookupDrafter
from speculative.draft.model import ModelDrafter
from speculative.sampling import Sampling
from tests.support.mutation import mutated
from tests.support.proofs import proof
from tests.support.toy_models import noisy_copy, random_head, random_llama, ref_warp

torch.set_num_threads(1)
SETTINGS = [
    Sampling(temperature=0.6),
    Sampling(temperature=1.0, top_k=4),
    Sampling(temperature=1.4, top_p=0.7),
    Sampling(temperature=0.8, top_k=6, top_p=0.9),
]
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = random_llama(
        vocab=12,
        dim=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        hidden_dim=32,
        max_seq_len=64,
        seed=3,
        std=0.6,
        dtype=torch.float64,
    )
    return target, noisy_copy(target, std=0.3, seed=4)


def gap(q: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> float:
    """max |q - ref_warp(logits)|; every token must also have positive probability under its q."""
    expected = torch.tensor(
        [
            ref_warp(row.tolist(), sampling.temperature, sampling.top_k, sampling.top_p)
            for row in logits
        ],
        dtype=torch.float64,
    )
    assert all(q[i, t] > 0 for i, t in enumerate(tokens.tolist())), "a token its q rules out"
    return (q.double() - expected).abs().max().item()


def model_gaps(draft: torch.nn.Module, sampling: Sampling, rows: bool) -> float:
    """ModelDrafter: q against the draft's own logits for each drafted prefix, from a forward
    without the cache (nothing the drafter computed is reused). One row, or two."""
    drafter, count = ModelDrafter(draft), 2 if rows else 1
    drafter.start(count, 32)
    drafter.keep_rows([], count)
    gens = [torch.Generator().manual_seed(b) for b in range(count)]
    drafts = drafter.propose(
        PROMPTS[:count], [3] * count, [sampling] * count, gens, torch.device("cpu")
    )
    worst = 0.0
    for ids, tokens, q in ((PROMPTS[b], drafts.tokens[b], drafts.q[b]) for b in range(count)):
        logits = torch.stack(
            [draft(torch.tensor([ids + tokens[:i].tolist()]))[0, -1] for i in range(len(tokens))]
        )
        worst = max(worst, gap(q, logits, tokens, sampling))
    return worst


def feature_gaps(target: torch.nn.Module, sampling: Sampling, rows: bool) -> float:
    """FeatureDrafter: q against the logits the head's predicted features gave (recorded where
    the drafter computes them), after the target has read the prompts. One row, or two."""
    drafter, seen = FeatureDrafter(random_head(target), target), []
    real = drafter._logits
    drafter._logits = lambda feature: seen.append(real(feature)) or seen[-1]
    count = 2 if rows else 1
    target.setup_cache(count, 32)
    _, hidden = target(
        torch.tensor(PROMPTS[:count]), chain(0, 4, "cpu", rows=count), return_hidden=True
    )
    gens = [torch.Generator().manual_seed(b) for b in range(count)]
    drafter.start(count, 32, target)
    drafter.keep_rows([], count)
    drafter.commit([4] * count, hidden, [0] * count)
    drafts = drafter.propose(
        PROMPTS[:count], [3] * count, [sampling] * count, gens, torch.device("cpu")
    )
    return max(
        gap(drafts.q[b], torch.stack([s[b] for s in seen]), drafts.tokens[b], sampling)
        for b in range(count)
    )


@proof(
    "each drafter hands the verifier the warped q its token was drawn from (temperature, top-k, top-p)",
    "exact, to 1e-9, against the reference warp of the logits",
)
@pytest.mark.parametrize("rows", [False, True], ids=["one-row", "two-rows"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_each_drafter_hands_over_the_q_it_drew_from(
    pair: tuple, sampling: Sampling, rows: bool
) -> None:
    target, draft = pair
    assert model_gaps(draft, sampling, rows) < 1e-9
    assert feature_gaps(target, sampling, rows) < 1e-9


@proof("a deterministic drafter reports q = None (one-hot on its tokens)", "exact")
def test_prompt_lookup_hands_over_no_q() -> None:
    """A deterministic drafter reports q = None: the loop takes it as one-hot on its tokens."""
    lookup = PromptLookupDrafter()
    lookup.start()
    lookup.keep_rows([], 1)
    ids = [1, 2, 3, 1, 2]
    got = lookup.propose(
        [ids], [2], [Sampling(temperature=0.7)], [torch.Generator()], torch.device("cpu")
    )
    assert got.q is None and got.tokens.tolist() == [[3, 1]]


@proof(
    "the drafter-q check can fail",
    "exact",
    rejects=("raw softmax handed over (transformers #47932 / vLLM #10198)",),
)
@pytest.mark.parametrize("rows", [False, True], ids=["one-row", "two-rows"])
def test_the_check_catches_a_raw_softmax_handed_over(
    pair: tuple, rows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers #47932 written into the drafters' sampling step: the token still drawn
    from the warped q, the verifier handed softmax(logits)."""
    broken = mutated(
        drafter_module,
        (
            "    probs.append(q)\n    return sample_rows(",
            "    probs.append(torch.softmax(logits, -1))\n    return sample_rows(",
        ),
    )
    for module in (drafter_module, model_module, eagle_module):
        monkeypatch.setattr(module, "draw_rows", broken.draw_rows)
    target, draft = pair
    sampling = Sampling(temperature=0.6, top_k=4)
    assert model_gaps(draft, sampling, rows) > 1e-3
    assert feature_gaps(target, sampling, rows) > 1e-3
