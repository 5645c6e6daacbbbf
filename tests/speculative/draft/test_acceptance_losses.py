"""The losses that train an EAGLE-3 head on its acceptance (speculative/draft/ttt.py, ``train.py
eagle3 --loss``): their values on small laws worked by hand, the direction of their gradient
(a step down each raises sum_x min(p, q)), and training-time test's use of them.
"""

from __future__ import annotations

import math

import pytest
import torch

from speculative.draft.ttt import (
    LOSSES,
    acceptance,
    lk_alpha,
    lk_lambda,
    total_variation,
    ttt_losses,
)
from tests.support.toy_models import random_eagle3_head, random_llama

ACCEPTANCE_LOSSES = ("tv", "lk-alpha", "lk-lambda")


def laws(p: list[float], q: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p on the draft vocabulary (its mass there may be below 1), p renormalised, log q."""
    p_draft = torch.tensor(p, dtype=torch.float64)
    return p_draft, p_draft / p_draft.sum(), torch.tensor(q, dtype=torch.float64).log()


def test_the_acceptance_losses_on_laws_worked_by_hand() -> None:
    # p = (0.5, 0.3, 0.2), q = (0.2, 0.3, 0.5): alpha = 0.2 + 0.3 + 0.2 = 0.7
    p, p_kept, log_q = laws([0.5, 0.3, 0.2], [0.2, 0.3, 0.5])
    assert acceptance(p, log_q).item() == pytest.approx(0.7, abs=1e-12)
    assert total_variation(p, log_q).item() == pytest.approx(0.3, abs=1e-12)
    assert lk_alpha(p, log_q).item() == pytest.approx(-math.log(0.7), abs=1e-12)
    # KL(p || q) = 0.5 ln(0.5 / 0.2) + 0.3 ln 1 + 0.2 ln(0.2 / 0.5) = 0.3 ln 2.5; lambda = e^-2.1
    weight = math.exp(-2.1)
    blend = weight * 0.3 * math.log(2.5) + (1 - weight) * 0.3
    assert lk_lambda(p, p_kept, log_q).item() == pytest.approx(blend, abs=1e-12)
    # A fifth of p lies outside the draft vocabulary: it is never drafted, so never accepted.
    # p = (0.4, 0.3, 0.1), q = (0.5, 0.25, 0.25): alpha = 0.4 + 0.25 + 0.1 = 0.75
    p, p_kept, log_q = laws([0.4, 0.3, 0.1], [0.5, 0.25, 0.25])
    assert acceptance(p, log_q).item() == pytest.approx(0.75, abs=1e-12)
    for name, wanted in [("tv", 0.25), ("lk-alpha", -math.log(0.75))]:
        assert LOSSES[name](p, p_kept, log_q).item() == pytest.approx(wanted, abs=1e-12), name
    # q = p renormalised: everything the target may write here is drafted at least as often
    p, p_kept, log_q = laws([0.4, 0.3, 0.1], [0.5, 0.375, 0.125])
    assert acceptance(p, log_q).item() == pytest.approx(0.8, abs=1e-12)
    # KL(p_kept || q) = 0, lambda = e^-2.4: what is left is the rejected fifth, (1 - lambda) 0.2
    wanted = (1 - math.exp(-2.4)) * 0.2
    assert lk_lambda(p, p_kept, log_q).item() == pytest.approx(wanted, abs=1e-12)


@pytest.mark.parametrize("name", ACCEPTANCE_LOSSES)
def test_a_step_down_each_acceptance_loss_raises_the_acceptance(name: str) -> None:
    """On random laws over 12 ids (some mass off the draft vocabulary), one small gradient step
    on the draft's logits raises sum_x min(p, q) at every position."""
    gen = torch.Generator().manual_seed(7)
    full = torch.softmax(3 * torch.randn(64, 14, generator=gen, dtype=torch.float64), -1)
    p = full[:, :12]  # [64, 12]: ids 12 and 13 are off the draft vocabulary
    p_kept = p / p.sum(-1, keepdim=True)
    logits = (2 * torch.randn(64, 12, generator=gen, dtype=torch.float64)).requires_grad_(True)
    before = acceptance(p, torch.log_softmax(logits, -1)).detach()
    LOSSES[name](p, p_kept, torch.log_softmax(logits, -1)).sum().backward()
    with torch.no_grad():
        after = acceptance(p, torch.log_softmax(logits - 1e-3 * logits.grad, -1))
    assert (before < 0.99).all() and (after > before).all(), (after - before).min()


def test_training_time_test_trains_the_loss_it_is_asked_for() -> None:
    """With --loss tv each step's logged loss is one minus its logged alpha; -log(alpha) of the
    alpha of every position is at least -log of their mean (Jensen); an unknown loss is refused."""
    target = random_llama(
        vocab=16,
        dim=32,
        n_layers=5,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        max_seq_len=64,
        seed=3,
        dtype=torch.float64,
    )
    head = random_eagle3_head(target, std=0.2, drop=(3, 9, 15))
    tokens = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(1))
    total, per_step = ttt_losses(head, target, tokens, 3, decay=0.5, loss="tv")
    assert len(per_step["loss"]) == 3
    for loss, alpha in zip(per_step["loss"], per_step["alpha"], strict=True):
        assert loss == pytest.approx(1 - alpha, abs=1e-6)  # float32 laws
    weighted = sum(0.5**k * (1 - a) for k, a in enumerate(per_step["alpha"]))
    assert total.item() == pytest.approx(weighted, abs=1e-6)
    _, per_step = ttt_losses(head, target, tokens, 3, loss="lk-alpha")
    for loss, alpha in zip(per_step["loss"], per_step["alpha"], strict=True):
        assert loss >= -math.log(alpha) - 1e-6
    with pytest.raises(ValueError, match="unknown loss 'kl'"):
        ttt_losses(head, target, tokens, 3, loss="kl")
