"""The drafter objectives (speculative/draft/distill.py) against independent formulas: the
divergences, the sequences a target samples, the distillation loss over the generated positions,
the feature head's losses; and measure_acceptance (speculative/engine/generation.py), which
train.py reports, on a draft equal to its target."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from speculative.draft.distill import distill_loss, divergence, eagle_losses, sample_sequences
from speculative.engine.generation import measure_acceptance
from speculative.verify.token import expected_acceptance
from tests.support.toy_models import random_head, random_llama, reference_greedy


def logits(seed: int, shape: tuple[int, ...] = (3, 5, 11)) -> torch.Tensor:
    return (
        torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    )


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tv"])
def test_divergences_vanish_only_when_the_distributions_agree(name: str) -> None:
    p, q = logits(0), logits(1)
    assert divergence(name, p, p).item() == pytest.approx(0.0, abs=1e-6)
    assert divergence(name, p, q).item() > 1e-3


def test_total_variation_is_one_minus_the_acceptance_probability() -> None:
    p, q = logits(2), logits(3)
    accept = expected_acceptance(F.softmax(p, -1), F.softmax(q, -1)).mean()
    assert divergence("tv", p, q).item() == pytest.approx(1 - accept.item(), abs=1e-6)


def test_forward_and_reverse_kl_against_torch() -> None:
    p, q = logits(4), logits(5)
    log_p, log_q = F.log_softmax(p, -1), F.log_softmax(q, -1)
    fkl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).mean()
    rkl = F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1).mean()
    assert divergence("fkl", p, q).item() == pytest.approx(fkl.item(), rel=1e-5)
    assert divergence("rkl", p, q).item() == pytest.approx(rkl.item(), rel=1e-5)


def test_unknown_divergence() -> None:
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence("hellinger", logits(0), logits(1))


# ----------------------------------------------------------------------------- speculative/draft/distill.py
def test_sampled_sequences_greedy_are_the_model_s_own_greedy_output() -> None:
    model = random_llama(vocab=16, dim=32, max_seq_len=64, dtype=torch.float64)
    prompts = [[1, 2, 3], [4, 5, 6]]
    out = sample_sequences(model, prompts, 8, torch.Generator(), greedy=True)
    assert out.shape == (2, 11) and out[:, :3].tolist() == prompts
    for row, prompt in zip(out.tolist(), prompts):
        assert row[3:] == reference_greedy(model, prompt, 8)
    again = sample_sequences(model, prompts, 8, torch.Generator().manual_seed(3))
    assert torch.equal(again, sample_sequences(model, prompts, 8, torch.Generator().manual_seed(3)))


def test_the_distillation_loss_is_the_divergence_over_the_generated_positions() -> None:
    target = random_llama(vocab=16, dim=32, max_seq_len=64, seed=1, dtype=torch.float64)
    draft = random_llama(vocab=16, dim=32, max_seq_len=64, seed=2, dtype=torch.float64).train()
    seqs = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(0))
    loss = distill_loss("tv", target, draft, seqs, prompt_tokens=4)
    p = F.softmax(target(seqs)[:, 3:-1], -1)
    q = F.softmax(draft(seqs)[:, 3:-1], -1)
    # positions 4..9 predicted
    assert loss.item() == pytest.approx((0.5 * (p - q).abs().sum(-1)).mean().item())
    loss.backward()
    assert all(param.grad is None for param in target.parameters())
    assert any(
        param.grad is not None and param.grad.abs().sum() > 0 for param in draft.parameters()
    )
    assert distill_loss("tv", target, target, seqs, 4).item() == pytest.approx(0.0, abs=1e-12)


def test_eagle_losses_train_the_head_only() -> None:
    target = random_llama(vocab=16, dim=32, max_seq_len=64, n_heads=4, n_kv_heads=2).requires_grad_(
        False
    )
    head = random_head(target).train()
    tokens = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(0))
    regression, classification = eagle_losses(head, target, tokens, 0.0, torch.Generator())
    with torch.no_grad():  # by hand: the head reads f_j and e(x_{j+1}) and predicts f_{j+1}
        _, feats = target(tokens, return_hidden=True)
        predicted = head(feats[:, :-1], target.embed_tokens(tokens[:, 1:]))
        wanted = F.softmax(target.lm_head(feats[:, 1:]), -1)
        log_q = F.log_softmax(target.lm_head(predicted), -1)
    assert regression.item() == pytest.approx(
        F.smooth_l1_loss(predicted, feats[:, 1:]).item(), rel=1e-5
    )
    assert classification.item() == pytest.approx(-(wanted * log_q).sum(-1).mean().item(), rel=1e-5)
    (regression + classification).backward()
    assert all(p.grad is not None for p in head.parameters()) and all(
        p.grad is None for p in target.parameters()
    )
    noisy = eagle_losses(head, target, tokens, 0.5, torch.Generator().manual_seed(1))[0]
    assert noisy.item() != regression.item()


def test_a_draft_equal_to_its_target_is_always_accepted() -> None:
    target = random_llama(vocab=16, dim=32, max_seq_len=64, dtype=torch.float64)
    # the same weights, another cache
    twin = random_llama(vocab=16, dim=32, max_seq_len=64, dtype=torch.float64)
    got = measure_acceptance(target, twin, [[1, 2, 3], [4, 5]], new_tokens=10, gamma=3, seed=0)
    assert set(got) == {
        f"{k}_{t}" for k in ("alpha", "acceptance", "tau") for t in ("greedy", "t1")
    }
    for name in ("greedy", "t1"):
        assert got[f"alpha_{name}"] == pytest.approx(1.0) and got[
            f"acceptance_{name}"
        ] == pytest.approx(1.0)
        assert got[f"tau_{name}"] > 3  # gamma + 1 per call, less where the output ends
    json.dumps(got)
