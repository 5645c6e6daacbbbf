"""Parallel drafting (PARD, An et al. 2025): gamma tokens from ONE call of a draft model
taught to read mask tokens.

Token-by-token drafting calls the draft model gamma times per iteration; on a CPU each call
costs mostly its fixed overhead, so a long draft costs gamma of them. A parallel draft reads
the sequence followed by gamma - 1 copies of a mask token and returns gamma distributions in
one call: the last real position's output is q_1, as for any draft model, and mask j's
output is q_{j+1}, the model's guess at the token j + 1 places further on without knowing
the tokens drafted before it.

Why Algorithm 1 stays exact: line 3 only needs x_i to be drawn from a q_i that the drafter
reports. Here q_i is the warped distribution at position i of the one call, and x_i is drawn
from exactly that; that q_i did not see x_1..x_{i-1} lowers acceptance, never correctness.

The mask is an id of the draft model's own vocabulary (``mask_id``, a checkpoint's
``pard_token``), typically one row the adaptation added after the target's ids: it is never
drafted (its logit is dropped before warping) and the target never sees it.

The same idea on the target's features is P-EAGLE (:class:`ParallelFeatureDrafter`, around a
model.eagle3_head.PEagleHead): the EAGLE-3 head's call reads the true features it has not
read yet and then gamma - 1 mask positions (a learned feature and a mask embedding).

Bookkeeping of the draft model, with L tokens in the sequence: ``next`` is the draft's first cache slot not
holding a token of the sequence. A proposal feeds ids[next:] and the masks, so afterwards
slots 0..L-1 hold the sequence and L.. hold masks: next = L. Verification appends at least
one token, so next stays L and the next call re-reads the accepted tokens over the masks
(rolling back is writing at an earlier slot, model/model.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from model import call as calls
from speculative.draft.eagle import FeatureDrafter
from speculative.draft.model import ModelDrafter
from speculative.draft.protocol import Draft, head_trait
from speculative.draft.registry import DrafterKind, register_drafter
from speculative.draft.trees import grow_tree
from speculative.sampling import Sampling, sample_rows, warp_rows
from speculative.verify.token_tree import TokenTree


class ParallelDrafter(ModelDrafter):
    """A draft model that reads ``mask_id`` placeholders and drafts a whole chain per call.

    ``vocab_size``: the target's vocabulary (the draft's logits beyond it, and the mask's,
    are dropped). Its cache, rollback and rows are ModelDrafter's (``next``, as above)."""

    parallel = True  # one call per iteration, whatever gamma (the cost model's c, speculative.engine.gamma)

    def __init__(self, model: Any, mask_id: int, vocab_size: int | None = None) -> None:
        super().__init__(model)
        own = model.config.vocab_size
        self.vocab_size = vocab_size or (own - 1 if mask_id == own - 1 else own)
        if not 0 <= mask_id < own:
            raise ValueError(
                f"the mask id {mask_id} is not an id of the draft's {own}-token vocabulary"
            )
        if self.vocab_size > own:
            raise ValueError(
                f"the draft's vocabulary ({own} ids) is smaller than the target's ({self.vocab_size})"
            )
        self.mask_id = mask_id

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's ids, the mask never among them."""
        logits = logits[..., : self.vocab_size]
        if self.mask_id < self.vocab_size:
            logits = logits.clone()
            logits[..., self.mask_id] = float("-inf")
        return logits

    def _call(self, ids: list[list[int]], gammas: list[int], device: torch.device) -> torch.Tensor:
        """The one call: row b feeds ids[b][next:] then gammas[b] - 1 masks, at its own slots.
        Returns logits [B, max(gammas), V], row b's first gammas[b] positions being q_1.. of it."""
        feeds = [
            row[nxt:] + [self.mask_id] * max(g - 1, 0)
            for row, nxt, g in zip(ids, self.next, gammas)
        ]
        width = max(map(len, feeds))
        batch = torch.tensor(
            [f + [0] * (width - len(f)) for f in feeds], dtype=torch.long, device=device
        )
        call = calls.ragged(list(self.next), width, self.model.cache_len, device)
        logits = self.model(batch, call)  # [B, width, V']
        steps = max(max(gammas), 1)
        if len(ids) == 1 or len({len(row) - nxt for row, nxt in zip(ids, self.next)}) == 1:
            # the last real token's column, the same in every row
            first = len(ids[0]) - self.next[0] - 1
            out = logits[:, first : first + steps]
        else:  # each row's last real token and the masks after it
            cols = torch.tensor(
                [
                    [min(len(row) - nxt - 1 + j, width - 1) for j in range(steps)]
                    for row, nxt in zip(ids, self.next)
                ],
                device=device,
            )
            out = logits[torch.arange(len(ids), device=device)[:, None], cols]
        self.next = [len(row) for row in ids]
        return self._logits(out)

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: list[Sampling],
        generators: list[torch.Generator],
        device: torch.device,
    ) -> Draft:
        """Lines 1-3 for every row in one draft call: q_1..q_{gamma_b} at once, then x_i ~ q_i,
        row b's draws in position order from its own stream."""
        steps = max(gammas, default=0)
        if steps == 0:
            return Draft(torch.empty(len(ids), 0, dtype=torch.long, device=device), list(gammas))
        return draw_positions(self._call(ids, gammas, device), samplings, generators, gammas)

    def propose_tree(
        self,
        ids: list[int],
        branching: Sequence[int],
        mode: str,
        sampling: Sampling,
        generator: torch.Generator,
        device: torch.device,
    ) -> tuple[TokenTree, int]:
        """Row 0's tree from the same one call: every node at depth d has its children drawn from
        q_{d+1}, which does not depend on the path above it (a valid, if weaker, conditional:
        the tree verifiers need only that a node's children were drawn from the q they are
        given)."""
        logits = self._call([ids], [len(branching)], device)[0]  # [depth, V]
        return tree_by_depth(logits, branching, mode, sampling, generator), 1


def tree_by_depth(
    logits: torch.Tensor,
    branching: Sequence[int],
    mode: str,
    sampling: Sampling,
    generator: torch.Generator,
) -> TokenTree:
    """A tree grown from one parallel call's logits [depth, V]: the root's children from q_1, every
    node at depth d's children from q_{d+1}, whatever its path."""

    def expand(
        tokens: torch.Tensor, parents: list[int], depths: list[int], rows: list[int]
    ) -> torch.Tensor:
        return logits[torch.tensor([depths[r] for r in rows], device=logits.device)]

    return grow_tree(logits[0], expand, branching, mode, sampling, generator)


def draw_positions(
    logits: torch.Tensor,
    samplings: list[Sampling],
    generators: list[torch.Generator],
    gammas: list[int],
) -> Draft:
    """Line 3 for every position of one parallel call: logits [B, steps, V] -> x_i ~ q_i, row b's
    draws in position order from its own stream; q None when every row is greedy."""
    rows, steps = logits.shape[:2]
    if all(s.greedy for s in samplings):
        return Draft(logits.argmax(-1), list(gammas), None, 1)
    q = warp_rows(
        logits.reshape(-1, logits.shape[-1]), [s for s in samplings for _ in range(steps)]
    )
    gens = [gen if i < g else None for gen, g in zip(generators, gammas) for i in range(steps)]
    return Draft(sample_rows(q, gens).view(rows, steps), list(gammas), q.view(rows, steps, -1), 1)


class ParallelFeatureDrafter(FeatureDrafter):
    """P-EAGLE: the EAGLE-3 drafter (speculative.draft.eagle, whose bookkeeping it keeps) with one
    head call per iteration. Row b's call reads its true inputs not read yet, (f_j, e(x_{j+1}))
    for j = next..L-2, then gamma_b - 1 mask positions; the last true position's output gives
    q_1 and mask d's gives q_{d+1}. Afterwards the head's slots from L - 1 on hold masks:
    next = L - 1, as after a token-by-token proposal."""

    parallel = True

    def _call(self, ids: list[list[int]], gammas: list[int], device: torch.device) -> torch.Tensor:
        """The one head call; the predicted features [B, max(gammas), dim] of each row's q_1.."""
        steps = max(gammas)
        mask_feature, mask_embedding = self.head.mask_inputs()
        feats, embs, outs = [], [], []
        for b, (row, g) in enumerate(zip(ids, gammas)):
            lo = self.next[b]
            # a row that drafts nothing feeds a placeholder at its next slot
            hi = len(row) - 1 if g else lo + 1
            tokens = torch.tensor(row[lo + 1 : hi + 1] or [0], dtype=torch.long, device=device)
            masks = max(g - 1, 0)
            feats.append(torch.cat([self.features[b, lo:hi], mask_feature.expand(masks, -1)]))
            embs.append(torch.cat([self.embed(tokens), mask_embedding.expand(masks, -1)]))
            outs.append([min(hi - lo - 1 + j, hi - lo - 1 + masks) for j in range(steps)])
        width = max(len(f) for f in feats)
        # padded: any finite
        feat = torch.stack([torch.cat([f, f[-1:].expand(width - len(f), -1)]) for f in feats])
        emb = torch.stack([torch.cat([e, e[-1:].expand(width - len(e), -1)]) for e in embs])
        out = self.head(
            feat, emb, calls.ragged(list(self.next), width, self.head.cache_len, device)
        )
        index = torch.tensor(outs, device=device)
        self.next = [len(row) - 1 if g else nxt for row, g, nxt in zip(ids, gammas, self.next)]
        return out[torch.arange(len(ids), device=device)[:, None], index]

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: list[Sampling],
        generators: list[torch.Generator],
        device: torch.device,
    ) -> Draft:
        """Lines 1-3 for every row in one head call (nothing before the target has read a row)."""
        gammas = [
            g if known >= len(row) - 1 and known > 0 else 0
            for g, known, row in zip(gammas, self.known, ids)
        ]
        if max(gammas, default=0) == 0:
            return Draft(torch.empty(len(ids), 0, dtype=torch.long, device=device), list(gammas))
        predicted = self._call(ids, gammas, device)
        # the head's own argmax, mapped
        if self.ids is not None and all(s.greedy for s in samplings):
            return Draft(
                self.ids[head_trait(self.head, "draft_logits")(predicted).argmax(-1)],
                list(gammas),
                None,
                1,
            )
        return draw_positions(self._logits(predicted), samplings, generators, gammas)

    def propose_tree(
        self,
        ids: list[int],
        branching: Sequence[int],
        mode: str,
        sampling: Sampling,
        generator: torch.Generator,
        device: torch.device,
    ) -> tuple[TokenTree, int] | None:
        """Row 0's tree from the one call, depth d's nodes drawn from q_{d+1} (as ParallelDrafter's)."""
        if self.known[0] < len(ids) - 1 or self.known[0] == 0:
            return None
        logits = self._logits(self._call([ids], [len(branching)], device)[0])
        return tree_by_depth(logits, branching, mode, sampling, generator), 1


register_drafter(
    DrafterKind(
        "parallel",
        "a parallel draft model (PARD): gamma tokens from one call, mask tokens after the sequence",
        build=lambda network, target: ParallelDrafter(
            network, network.config.extra["pard_token"], target.config.vocab_size
        ),
        toy="speculative.proofs.cases:parallel_drafter",
        loader="weights.drafters:read_draft_model",
        recognizes=lambda config: "pard_token" in config,
        network="checkpoint",
        memory="own",
        extra_ids=1,  # its mask id, after the target's vocabulary
    )
)
register_drafter(
    DrafterKind(
        "peagle",
        "a P-EAGLE head: an EAGLE-3 head that drafts the whole chain in one call, from its folder",
        build=lambda head, target: ParallelFeatureDrafter(head, target),
        toy="speculative.proofs.cases:peagle_drafter",
        loader="weights.drafters:read_eagle3_head",
        recognizes="weights.eagle3:is_peagle_head",
        network="head",
        memory="target-block",
    )
)
