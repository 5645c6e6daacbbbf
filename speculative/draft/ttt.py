"""Training an EAGLE-3 head (model.eagle3_head.Eagle3Head) with training-time test (Li et al.
2025, section 3): ``train.py eagle3`` runs it (docs/drafters.md).

While drafting, the head reads the target's features only at the positions the target has
verified; from its second token on it reads its own previous output instead. Trained on the
target's features alone (EAGLE-1), it never sees its own errors and acceptance falls with
each position drafted ahead. Training-time test unrolls the drafting: step 0 reads the
target's features at every position of a sequence at once; step k reads, at column t, the
head's own output of step k-1 at column t, rotated as position t + k, and attends to the
true inputs up to t and to its own chain at column t (steps 1..k), which is exactly what
the cached drafter's call sees at draft position k + 1. Step k's loss is weighted 0.8^k.

The loss is the soft cross-entropy of the head's draft-vocabulary distribution against the
target's own next-token distribution, restricted to the draft vocabulary and renormalised
(mass outside it cannot be drafted; the q that maximises sum_x min(p, q) on the draft
vocabulary is p renormalised there, which is also this loss's minimum). The regression loss
of EAGLE-1 (the head's normalised output against the target's final feature) is kept as an
option for the ablation.

The soft cross-entropy reaches acceptance only through its minimum: a head that cannot reach
it spends its capacity on matching the target's tail, which a drafted token's acceptance
sum_x min(p, q) = 1 - TV(p, q) does not reward. The LK losses (Samarin et al. 2026, arXiv
2602.23881; vLLM's speculators package) train on that acceptance itself (:data:`LOSSES`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from model.model import apply_rope, rope_tables


def draft_vocabulary(
    tokens: torch.Tensor, vocab_size: int, size: int
) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent ids of ``tokens`` (ties: the lower id), ascending, and the
    share of ``tokens`` they cover. EAGLE-3 keeps the tokens the target writes most often."""
    counts = torch.bincount(tokens.flatten(), minlength=vocab_size).double()
    counts += torch.linspace(1e-6, 0, vocab_size, dtype=torch.float64)  # ties: the lower id first
    kept = counts.topk(size).indices.sort().values
    return kept, float(counts[kept].sum() / counts.sum())


@torch.no_grad()
def start_vocabulary(head: Any, target: Any, tokens: torch.Tensor) -> float:
    """Give a new head its draft vocabulary, the ``head.draft_vocab`` ids most frequent in
    ``tokens`` (:func:`draft_vocabulary`), their output rows and the final norm taken from the
    target's; returns the share of ``tokens`` they cover."""
    kept, coverage = draft_vocabulary(tokens, target.config.vocab_size, head.draft_vocab)
    head.set_vocabulary(kept)
    head.lm_head.weight.copy_(target.lm_head.weight[kept])
    head.norm.weight.copy_(target.norm.weight)
    return coverage


# The LK losses' blend temperature: lambda = exp(-eta * alpha) leans on the KL while the draft
# overlaps little with the target and on the acceptance once it overlaps much (the paper's best
# hybrid setting, speculators' default).
LK_ETA = 3.0

# Below it -log(alpha) is capped: a position the head misses entirely would otherwise give an
# unbounded loss and gradient (speculators' floor).
LK_FLOOR = 1e-5


def acceptance(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) per position [...]: the chance that a token drafted from q is
    accepted by a target whose law is p (p may hold less than 1 on the draft vocabulary: the
    target's mass outside it is never drafted, hence never accepted)."""
    return torch.minimum(p, log_q.exp()).sum(-1)


def soft_cross_entropy(p_kept: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """-sum_x p(x) log q(x) per position, p renormalised on the draft vocabulary."""
    return -(p_kept * log_q).sum(-1)


def total_variation(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """1 - alpha per position: the share of drafted tokens rejected (its gradient is the
    acceptance's, and vanishes where q misses p's mode entirely)."""
    return 1 - acceptance(p, log_q)


def lk_alpha(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """LK^alpha, -log(alpha) per position: TV's gradient scaled by 1 / alpha, so that the
    positions the head drafts worst pull hardest (for a one-hot p it is the cross-entropy)."""
    return -acceptance(p, log_q).clamp_min(LK_FLOOR).log()


def lk_lambda(p: torch.Tensor, p_kept: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """LK^lambda per position: lambda KL(p_kept || q) + (1 - lambda) TV(p, q), lambda =
    exp(-LK_ETA alpha) with alpha held constant (it chooses the blend, it is not trained)."""
    alpha = acceptance(p, log_q)
    weight = torch.exp(-LK_ETA * alpha.detach())
    kl = (torch.xlogy(p_kept, p_kept) - p_kept * log_q).sum(-1)
    return weight * kl + (1 - weight) * (1 - alpha)


# --loss: the per-position loss of a head's log q [..., V'] against the target's p on the draft
# vocabulary (p_draft: its own probabilities there; p_kept: renormalised there). The acceptance
# losses take p_draft, whose overlap with q is what verification accepts; the divergences take
# p_kept, a distribution. "regression" is soft-ce beside EAGLE-1's regression (ttt_losses).
LOSSES: dict[str, Any] = {
    "soft-ce": lambda p_draft, p_kept, log_q: soft_cross_entropy(p_kept, log_q),
    "regression": lambda p_draft, p_kept, log_q: soft_cross_entropy(p_kept, log_q),
    "tv": lambda p_draft, p_kept, log_q: total_variation(p_draft, log_q),
    "lk-alpha": lambda p_draft, p_kept, log_q: lk_alpha(p_draft, log_q),
    "lk-lambda": lk_lambda,
}


def _attend_chain(
    q: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]], groups: int
) -> torch.Tensor:
    """Attention of step k's queries q [B, H, n, D] over the true inputs (past[0], causal: column
    t sees columns <= t) and the chain at its own column (past[1..k]: one key per step)."""
    k0, v0 = (x.repeat_interleave(groups, dim=1) for x in past[0])
    n = q.shape[2]
    scale = 1 / math.sqrt(q.shape[-1])
    scores = (q @ k0.transpose(-1, -2)) * scale  # [B, H, n, n0]
    causal = torch.ones(n, k0.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    chain = [tuple(x.repeat_interleave(groups, dim=1)[:, :, :n] for x in kv) for kv in past[1:]]
    diagonal = [((q * k).sum(-1) * scale).unsqueeze(-1) for k, _ in chain]  # [B, H, n, 1] each
    weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1), dim=-1)
    out = weights[..., : k0.shape[2]] @ v0
    for j, (_, v) in enumerate(chain):
        out = out + weights[..., k0.shape[2] + j : k0.shape[2] + j + 1] * v
    return out


def ttt_losses(
    head: Any,
    target: Any,
    tokens: torch.Tensor,
    steps: int,
    *,
    decay: float = 0.8,
    loss: str = "soft-ce",
    bf16: bool = False,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The weighted loss of ``steps`` unrolled drafting steps on sequences [B, T], and per step
    (depth 1..steps): its loss and the alpha of its distribution against the target's,
    sum_x min(p, q) averaged over positions (the acceptance it would get at that depth
    reading true tokens). ``loss`` names the loss of each step (:data:`LOSSES`); "regression"
    adds EAGLE-1's smooth-L1 of norm(output) on the target's next final feature, and weighs the
    cross-entropy 0.5 (its two losses)."""
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    regression = loss == "regression"
    per_position = LOSSES[loss]
    batch, length = tokens.shape
    with torch.no_grad(), torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits, fused = target(tokens, return_hidden=head.target_layers)
        final = target(tokens, return_hidden=True)[1].to(head.dtype) if regression else None
    with torch.no_grad():
        ids = head.target_ids()
        # p at position t: the target's law of token t + 1
        p_full = F.softmax(logits.float(), dim=-1)
        p_draft = p_full[..., ids]
        p_kept = p_draft / p_draft.sum(-1, keepdim=True).clamp_min(1e-12)
        embeddings = target.embed_tokens(tokens).to(head.dtype)
    layer = head.layers[0]
    attn = layer.self_attn
    groups = attn.q_proj.out_features // attn.k_proj.out_features  # query heads per KV head
    cos_all, sin_all = rope_tables(head.config, length + steps, head.device, head.dtype)
    # bf16: the head computes in bfloat16 too (its weights and gradients stay float32)
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        # column t: the target's f_t, t = 0..T-2
        hidden = head.project(fused[:, :-1].to(head.dtype))
        past: list[tuple[torch.Tensor, torch.Tensor]] = []
        total = hidden.new_zeros(())
        per_step = {"loss": [], "alpha": []}
        for k in range(min(steps, length - 1)):
            n = length - 1 - k  # columns t whose target t + k + 1 exists
            both, residual = layer.inputs(embeddings[:, k + 1 : k + 1 + n], hidden[:, :n])
            cos, sin = cos_all[k : k + n], sin_all[k : k + n]  # column t is position t + k
            q = attn.q_proj(both).view(batch, n, -1, attn.head_dim).transpose(1, 2)
            key = attn.k_proj(both).view(batch, n, -1, attn.head_dim).transpose(1, 2)
            value = attn.v_proj(both).view(batch, n, -1, attn.head_dim).transpose(1, 2)
            q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
            past.append((key, value))
            attended = _attend_chain(q, past, groups).transpose(1, 2).reshape(batch, n, -1)
            out = layer.finish(residual, attn.o_proj(attended))
            log_q = F.log_softmax(head.draft_logits(out).float(), dim=-1)
            seen = p_draft[:, k + 1 : k + 1 + n]  # [B, n, V']
            wanted = p_kept[:, k + 1 : k + 1 + n]
            step_loss = per_position(seen, wanted, log_q).mean()
            if regression:  # EAGLE-1's two losses: half the cross-entropy, and the regression
                step_loss = 0.5 * step_loss + F.smooth_l1_loss(
                    head.norm(out), final[:, k + 1 : k + 1 + n]
                )
            total = total + decay**k * step_loss
            with torch.no_grad():
                per_step["loss"].append(step_loss.item())
                per_step["alpha"].append(acceptance(seen, log_q).mean().item())
            hidden = out
    return total, per_step
