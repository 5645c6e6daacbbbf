"""The distillation objectives (speculative/draft/distill.py) against independent formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speculative.draft.distill import divergence
from speculative.verify.token import expected_acceptance


def logits(seed: int, shape: tuple[int, ...] = (3, 5, 11)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


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
