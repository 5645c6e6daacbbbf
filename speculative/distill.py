"""Token-level divergences between the target's and the draft's next-token distributions,
the objectives of DistillSpec (Zhou et al. 2023).

All take logits [..., vocab] of the target (p, no gradient) and the draft (q) and return
the mean over positions. Total variation is the one that speculative sampling cares
about directly: a draft token is accepted with probability sum_x min(p, q) = 1 - TV(p, q).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def forward_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q): mass-covering; the usual distillation loss."""
    log_p, log_q = F.log_softmax(p_logits.float(), -1), F.log_softmax(q_logits.float(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def reverse_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(q || p): mode-seeking."""
    log_p, log_q = F.log_softmax(p_logits.float(), -1), F.log_softmax(q_logits.float(), -1)
    return (log_q.exp() * (log_q - log_p)).sum(-1).mean()


def jsd(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence: the mean KL of p and q to their midpoint m = (p + q) / 2."""
    p, q = F.softmax(p_logits.float(), -1), F.softmax(q_logits.float(), -1)
    log_m = torch.log((p + q) / 2 + 1e-30)
    kl_pm = (p * (torch.log(p + 1e-30) - log_m)).sum(-1)
    kl_qm = (q * (torch.log(q + 1e-30) - log_m)).sum(-1)
    return (0.5 * (kl_pm + kl_qm)).mean()


def total_variation(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = 1/2 sum |p - q| = 1 - (expected acceptance of a draft token)."""
    p, q = F.softmax(p_logits.float(), -1), F.softmax(q_logits.float(), -1)
    return (0.5 * (p - q).abs().sum(-1)).mean()


DIVERGENCES = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tv": total_variation}


def divergence(name: str, p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; choose one of {', '.join(DIVERGENCES)}")
    return DIVERGENCES[name](p_logits, q_logits)
