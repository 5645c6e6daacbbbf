"""Adapting a draft model to parallel drafting (PARD, An et al. 2025): ``train.py parallel``
runs it (docs/drafters.md).

A parallel draft (speculative.draft.parallel) reads the sequence x_0..x_t and then masks at
positions t+1..t+k-1; mask d's output must predict x_{t+d+1}. Training shows it every anchor
t and depth d at once, in one forward over a longer sequence: the real tokens x_0..x_{n-1}
(depth 0, causal as usual), then for each depth d = 1..K-1 one mask node (t, d) per anchor t,
rotated as position t + d, which sees the real tokens up to t and the masks (t, 1..d) of its
own anchor: exactly what the cached drafter's call holds when it drafts after x_t.

Every anchor at every depth would make the forward K times longer. PARD's conditional drop
keeps a shrinking share of the anchors at each depth (``keep``^d, at least ``min_keep``), and
an anchor kept at depth d is kept at every depth before it, so that the masks a node attends
to exist (the "conditional" part). Its loss is the soft cross-entropy against the target's own
distribution of the token it predicts (every node weighs the same).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from model import Llama, ModelConfig
from model.eagle3_head import Eagle3Head, PEagleHead
from model.model import rope_cos_sin, rope_inverse_frequencies


@torch.no_grad()
def with_mask_token(draft: Llama) -> Llama:
    """A copy of ``draft`` whose vocabulary gains one id, the mask (``pard_token``), embedded as
    the mean of the others: the model a parallel adaptation starts from. Its output row for
    the mask is never used (the drafter drops it)."""
    vocab = draft.config.vocab_size
    config = ModelConfig(
        **{**vars(draft.config), "vocab_size": vocab + 1, "extra": {"pard_token": vocab}}
    )
    model = Llama(config).to(draft.dtype)
    own = draft.state_dict()
    for name, param in model.state_dict().items():
        source = own[name]
        if param.shape[0] == vocab + 1 and source.shape[0] == vocab:
            source = torch.cat([source, source.mean(0, keepdim=True)])
        param.copy_(source)
    return model


@torch.no_grad()
def with_mask_feature(head: Eagle3Head, mask_id: int, mask_embedding: torch.Tensor) -> PEagleHead:
    """A P-EAGLE head (model.eagle3_head.PEagleHead) with the weights of the EAGLE-3 head ``head``,
    a mask feature of zeros and ``mask_embedding`` (the mean of the target's embeddings, say) as
    the embedding of ``mask_id``: the head a P-EAGLE adaptation starts from. ValueError when the
    weights do not carry over one for one (every weight of ``head``, and only the mask's new)."""
    peagle = PEagleHead(
        head.config,
        head.target_layers,
        head.draft_vocab,
        head.layers[0].norm_before_residual,
        mask_id,
    )
    keys = peagle.load_state_dict(head.state_dict(), strict=False)
    lacking = sorted(set(keys.missing_keys) - {"mask_embedding", "mask_hidden"})
    if lacking or keys.unexpected_keys:
        raise ValueError(
            f"the head's weights do not fit a P-EAGLE head: it lacks {lacking or 'nothing'} and has "
            f"{sorted(keys.unexpected_keys) or 'nothing'} besides"
        )
    peagle.mask_embedding.copy_(mask_embedding)
    return peagle


def cod_layout(
    length: int, depths: int, keep: float, min_keep: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchors and depths of the mask nodes for sequences of ``length`` tokens and draft
    positions 1..``depths`` (the masks are depths 2..depths): anchor t at depth d predicts
    x_{t+d+1}, so t <= length - 2 - d; depth d keeps a random max(keep^d, min_keep) share of
    the anchors, chosen among those kept at depth d - 1. Returns (anchors [M], depth [M]),
    depth by depth."""
    anchors = []  # per depth, the anchors kept
    depth = []  # per depth, that depth once per anchor
    alive = torch.arange(length - 1)
    total = len(alive)
    for d in range(1, depths):
        alive = alive[alive <= length - 2 - d]
        count = min(len(alive), max(1, math.ceil(max(keep**d, min_keep) * total)))
        if count == 0:
            break
        alive = alive[torch.randperm(len(alive), generator=gen)[:count]].sort().values
        anchors.append(alive)
        depth.append(torch.full_like(alive, d))
    if not anchors:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    return torch.cat(anchors), torch.cat(depth)


def layout_mask(
    length: int, anchors: torch.Tensor, depth: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions [N] and visibility [N, N] (query, key) of the real tokens followed by the
    mask nodes (see the module docstring)."""
    m = len(anchors)
    n = length + m
    positions = torch.cat([torch.arange(length), anchors + depth])
    key_pos = torch.arange(length)
    visible = torch.zeros(n, n, dtype=torch.bool)
    visible[:length, :length] = key_pos[None, :] <= key_pos[:, None]
    visible[length:, :length] = key_pos[None, :] <= anchors[:, None]
    visible[length:, length:] = (anchors[:, None] == anchors[None, :]) & (
        depth[None, :] <= depth[:, None]
    )
    return positions, visible


def masked_forward(
    model: Llama, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Logits [B, N, V] of the draft over ``tokens`` [B, N] placed at ``positions`` and seeing
    ``visible``: the model's own modules, with an attention mask instead of its causal or cached
    call (a training forward with gradients; no cache)."""
    inv_freq = rope_inverse_frequencies(model.config).to(model.device)
    cos, sin = (t.to(model.dtype) for t in rope_cos_sin(inv_freq, positions.to(model.device)))
    mask = visible.to(model.device)
    x = model.embed_tokens(tokens)
    for layer in model.layers:
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
        )
        x = x + attn.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = model.lm_head(model.norm(x))
    return logits if logits.dtype == torch.float64 else logits.float()


def parallel_losses(
    draft: Llama,
    target: Any,
    tokens: torch.Tensor,
    depths: int,
    *,
    keep: float = 0.8,
    min_keep: float = 0.2,
    gen: torch.Generator | None = None,
    bf16: bool = False,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The soft cross-entropy of every node of a conditional-drop layout on sequences [B, T]
    against the target's distribution of the token it predicts, and per draft position
    1..depths its loss and alpha (sum_x min(p, q), averaged: the acceptance of that position
    reading true tokens). The mask id is the draft's ``pard_token``; the draft's logits are
    taken over the target's ids only, as the drafter takes them."""
    batch, length = tokens.shape
    vocab = target.config.vocab_size
    mask_id = draft.config.extra["pard_token"]
    anchors, depth = cod_layout(
        length, depths, keep, min_keep, gen or torch.Generator().manual_seed(0)
    )
    positions, visible = layout_mask(length, anchors, depth)
    masks = torch.full((batch, len(anchors)), mask_id, dtype=tokens.dtype, device=tokens.device)
    inputs = torch.cat([tokens, masks], dim=1)
    with torch.no_grad(), torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        p = F.softmax(target(tokens).float(), dim=-1)  # p[t]: the target's law of x_{t+1}
    logits = masked_forward(draft, inputs, positions, visible)[..., :vocab]
    if mask_id < vocab:
        logits = logits.masked_fill(
            torch.arange(vocab, device=logits.device) == mask_id, float("-inf")
        )
    log_q = F.log_softmax(logits, dim=-1)
    # node -> the position whose target law it learns: real t -> t (t <= T-2), mask (t, d) -> t + d
    wanted = torch.cat([torch.arange(length - 1), anchors + depth])
    nodes = torch.cat([torch.arange(length - 1), length + torch.arange(len(anchors))])
    node_depth = torch.cat([torch.zeros(length - 1, dtype=torch.long), depth])
    p_nodes = p[:, wanted]
    log_q_nodes = log_q[:, nodes]
    # [B, nodes]; clamp: 0 * -inf where p has no mass
    ce = -(p_nodes * log_q_nodes.clamp_min(-1e4)).sum(-1)
    return ce.mean(), by_position(ce, p_nodes, log_q_nodes, node_depth, depths)


def by_position(
    ce: torch.Tensor, p: torch.Tensor, log_q: torch.Tensor, node_depth: torch.Tensor, depths: int
) -> dict[str, list[float]]:
    """The loss and alpha (sum_x min(p, q), averaged) of the nodes at each draft position."""
    per_step: dict[str, list[float]] = {"loss": [], "alpha": []}
    with torch.no_grad():
        overlap = torch.minimum(p, log_q.exp()).sum(-1)
        for d in range(depths):
            at = node_depth == d
            if at.any():
                per_step["loss"].append(ce[:, at].mean().item())
                per_step["alpha"].append(overlap[:, at].mean().item())
    return per_step


def peagle_losses(
    head: Any,
    target: Any,
    tokens: torch.Tensor,
    depths: int,
    *,
    keep: float = 0.8,
    min_keep: float = 0.2,
    gen: torch.Generator | None = None,
    bf16: bool = False,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """P-EAGLE's (model.eagle3_head.PEagleHead) loss in the same layout. Real node t reads the
    target's fused feature f_t and e(x_{t+1}) at position t and predicts x_{t+2}; mask node
    (t, d) reads the mask feature and embedding at position t + d, sees the real nodes up to t
    and its anchor's masks up to d, and predicts x_{t+d+2}. The soft cross-entropy is against
    the target's law of that token restricted to the draft vocabulary (as speculative.draft.ttt's)."""
    batch, length = tokens.shape
    with torch.no_grad(), torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits, fused = target(tokens, return_hidden=head.target_layers)
    with torch.no_grad():
        p_draft = F.softmax(logits.float(), dim=-1)[..., head.target_ids()]
        p_kept = p_draft / p_draft.sum(-1, keepdim=True).clamp_min(1e-12)
    embeddings = head.embed(tokens, target.embed_tokens)
    anchors, depth = cod_layout(
        length, depths, keep, min_keep, gen or torch.Generator().manual_seed(0)
    )
    real = length - 1  # nodes 0..T-2: (f_t, e(x_{t+1}))
    positions, visible = layout_mask(real, anchors, depth)
    mask_feature, mask_embedding = head.mask_inputs()
    m = len(anchors)
    feats = torch.cat(
        [head.project(fused[:, :-1].to(head.dtype)), mask_feature.expand(batch, m, -1)], dim=1
    )
    embs = torch.cat([embeddings[:, 1:].to(head.dtype), mask_embedding.expand(batch, m, -1)], dim=1)
    layer = head.layers[0]
    attn = layer.self_attn
    inv_freq = rope_inverse_frequencies(head.config).to(head.device)
    cos, sin = (t.to(head.dtype) for t in rope_cos_sin(inv_freq, positions.to(head.device)))
    both, residual = layer.inputs(embs, feats)
    q, k, v = attn.project(both, cos, sin)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=visible.to(head.device), enable_gqa=q.shape[1] != k.shape[1]
    )
    hidden = layer.finish(residual, attn.o_proj(out.transpose(1, 2).reshape(batch, real + m, -1)))
    log_q = F.log_softmax(head.draft_logits(hidden).float(), dim=-1)
    # node -> the target position whose law it learns
    wanted = torch.cat([torch.arange(1, length), anchors + depth + 1])
    node_depth = torch.cat([torch.zeros(real, dtype=torch.long), depth])
    ce = -(p_kept[:, wanted] * log_q).sum(-1)
    return ce.mean(), by_position(ce, p_draft[:, wanted], log_q, node_depth, depths)
