"""Drafting from the target's own features (EAGLE, Li et al. 2024): a drafter around
model.feature_head.FeatureHead.

Why it agrees with the target more often than a small model does: the target's feature
f_j (what its output head reads) already holds everything the target computed about the
sequence; a small draft model has to recompute a poorer version of it from the tokens.
The head only has to predict how f moves by one token, and the target's own output head
turns its prediction into a distribution (docs/drafters.md).

Bookkeeping, with L tokens in the sequence and the target's cache holding 0..L-2:

* the target's features f_0..f_{L-2} are known (every position the target has read); the
  head's input at position j is (f_j, e(x_{j+1})), so positions 0..L-2 have true inputs;
* propose: one head call over the true inputs it has not read yet (``next``..L-2) gives
  f^_{L-1} and so q_1 = warp(head(f^_{L-1})); then, feeding its own prediction back,
  (f^_{L-1}, e(x_1)) at position L-1 gives f^_L and q_2, and so on: gamma calls for gamma
  tokens, x_gamma never fed. Head cache slots from L-1 on now hold inputs built from
  predicted features, so ``next`` = L-1;
* commit: the target's call read positions hidden_start.. and its features up to the new
  L' - 2 are on the accepted path; they are kept, put in the table (projected, for EAGLE-3)
  when the head next reads it, and the next proposal re-reads positions L-1..L'-2 with true
  features (EAGLE recomputes accepted positions the same way).

All of this is per row (speculative.draft): one features table, one head cache row and one
known/next pair per row.

A row that goes on from the row that left its slot (the ``resumed`` hook, a conversation's next
turn) shares its first tokens with it, and the target reads it only from there on: the features
table keeps that row's features of the shared positions (the target read them all), and the head
its slots whose inputs lie in them, positions 0..shared-2 (position j reads x_{j+1}). As for a
new row, nothing is drafted before the target's first call for it.

On the first iteration no feature is known yet: the drafter proposes nothing, and the
loop's first target call (which reads the prompt) is a plain step.

The target is used through its call contract plus two of its modules: ``embed_tokens``
(ids -> embeddings) and ``lm_head`` (features -> logits), shared and not copied, and
``target(tokens, call, return_hidden=True)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from model import call as calls
from speculative.draft.protocol import (
    Draft,
    drafted,
    draw_rows,
    head_trait,
    left_behind,
    newest,
    pad_rows,
)
from speculative.draft.registry import DrafterKind, register_drafter
from speculative.draft.trees import grow_tree
from speculative.sampling import Sampling, full_width
from speculative.verify.token_tree import TokenTree


class FeatureDrafter:
    """A drafter around a feature head trained for ``target``: EAGLE-1's
    (model.feature_head.FeatureHead: the target's final features, the target's output head)
    or EAGLE-3's (model.eagle3_head.Eagle3Head: three layers' features fused, its own output
    layer over a reduced vocabulary). The bookkeeping above is the same for both; they differ
    in what the target returns (``reads_features``: True, or the layer ids), how a feature is
    stored (``head.project``) and where logits come from (:meth:`_logits`): what the head
    protocol declares (speculative.draft.protocol.Head)."""

    def __init__(self, head: Any, target: Any) -> None:
        self.head, self.target = head, target
        self.reads_features = head_trait(head, "reads_features")
        self.vocab_size = target.config.vocab_size
        # EAGLE-3: the target id of each draft id, None when the two vocabularies are one
        target_ids = head_trait(head, "target_ids")
        ids = target_ids() if head_trait(head, "draft_logits") is not None else None
        same = ids is not None and len(ids) == self.vocab_size and bool((ids.diff() == 1).all())
        self.ids = None if ids is None or same else ids
        self.max_seq_len = head.config.max_seq_len
        self.table: torch.Tensor | None = (
            None  # [rows, cache_len, dim] the target's features by position
        )
        # what commit received and has not projected yet: (the target's features, lengths, starts) per call
        self.unprojected: list[tuple[torch.Tensor, list[int], list[int]]] = []
        self.known: list[int] = []  # row b: positions 0..known[b]-1 hold the target's own features
        self.next: list[int] = []  # row b: the head's first cache slot not holding a true input
        self.left: dict[int, int] = {}  # a free slot -> the next of the row that left it

    def start(self, max_rows: int, cache_len: int, target: Any = None) -> None:
        if target is not None and target is not self.target:
            raise ValueError("this feature drafter was built for another target object")
        self.head.setup_cache(max_rows, cache_len)
        # zeros, not empty: a placeholder row reads it, and NaN in a masked cache slot would still
        # poison attention (0 * NaN)
        self.table = torch.zeros(
            max_rows,
            cache_len,
            self.head.config.dim,
            dtype=self.head.dtype,
            device=self.head.device,
        )
        self.known, self.next, self.unprojected = [], [], []
        self.left = {}

    @property
    def features(self) -> torch.Tensor:
        """The table of the head's input features by position, every committed call's projected."""
        if self.unprojected:
            # the table is the engine's (made in inference mode), whoever reads it
            with torch.inference_mode():
                self._project()
        return self.table

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: the target's, or as a head that has its own says (P-EAGLE's), in the
        head's dtype (a head may run in another than its target: weights.load.PairSpec.draft_dtype)."""
        own = head_trait(self.head, "embed")
        if own is not None:
            return own(ids, self.target.embed_tokens).to(self.head.dtype)
        return self.target.embed_tokens(ids).to(self.head.dtype)

    def _logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary for predicted features. A reduced draft
        vocabulary's logits are placed at their target ids and -inf elsewhere: every warp
        then gives those ids probability 0, so q is zero outside the draft vocabulary and the
        token drawn and its q are one distribution (the verifier needs nothing more)."""
        draft_logits = head_trait(self.head, "draft_logits")
        if draft_logits is None:
            logits = self.target.lm_head(feature.to(self.target.dtype))
        elif self.ids is None:
            logits = draft_logits(feature)
        else:
            small = draft_logits(feature)
            logits = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
            logits[..., self.ids] = small
        return full_width(logits)

    def _draw(
        self,
        predicted: torch.Tensor,
        samplings: list[Sampling],
        generators: list[torch.Generator | None],
        probs: list[torch.Tensor],
    ) -> torch.Tensor:
        """Line 3 for every row (protocol.draw_rows). With a reduced vocabulary the head's own
        logits are warped and drawn from, and only q is placed at the target ids: every warp
        (temperature, top-k, top-p) gives the ids outside it probability 0 anyway, and the map
        keeps the order of ids, so ties, top-p's order and the inverse-CDF draw (whose running
        sum only repeats itself over zeros) pick the same token as over the placed logits, without
        a softmax and a running sum over the whole vocabulary per drafted token."""
        if self.ids is None:
            return draw_rows(self._logits(predicted), samplings, generators, probs)
        small: list[torch.Tensor] = []
        tokens = self.ids[
            draw_rows(
                head_trait(self.head, "draft_logits")(predicted), samplings, generators, small
            )
        ]
        if small:
            q = small[0].new_zeros((*small[0].shape[:-1], self.vocab_size))
            q[..., self.ids] = small[0]
            probs.append(q)
        return tokens

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: list[Sampling],
        generators: list[torch.Generator],
        device: torch.device,
    ) -> Draft:
        """One head call per step for all rows: the first catches each row up on its true
        features (its own number of positions, padded), later ones feed each row's predicted
        feature and x_i. A row the target has not read yet drafts nothing (a plain step), and
        a row that has drafted its gamma feeds a placeholder at its first unused slot."""
        gammas = [
            g if known >= len(row) - 1 and known > 0 else 0
            for g, known, row in zip(gammas, self.known, ids)
        ]
        steps = max(gammas, default=0)
        if steps == 0:
            return drafted([], [], gammas, 0, device)
        starts = list(self.next)
        spans = [
            (nxt, len(row) - 1) if g else (nxt, nxt + 1) for nxt, row, g in zip(starts, ids, gammas)
        ]
        widths = [hi - lo if g else 0 for (lo, hi), g in zip(spans, gammas)]
        width = max(widths)
        # true features f_lo..f_{hi-1} and the tokens after them, each row padded (with copies of its
        # last feature: any finite value will do) to the widest row
        if len(ids) == 1:
            feats = self.features[:1, spans[0][0] : spans[0][1]]
        else:
            cols = torch.tensor(
                [[min(lo + j, hi - 1) for j in range(width)] for lo, hi in spans], device=device
            )
            feats = self.features[torch.arange(len(ids), device=device)[:, None], cols]
        nxt = pad_rows([row[lo + 1 : hi + 1] for row, (lo, hi) in zip(ids, spans)], device, width)
        tokens, probs = [], []
        for i in range(steps):
            call = calls.ragged(starts, feats.shape[1], self.head.cache_len, device)
            predicted = newest(self.head(feats, self.embed(nxt), call), widths if i == 0 else [1])
            live = [gen if g > i else None for gen, g in zip(generators, gammas)]
            tokens.append(self._draw(predicted, samplings, live, probs))
            starts = [s + w if g > i else s for s, w, g in zip(starts, widths, gammas)]
            feats, nxt, widths = predicted.unsqueeze(1), tokens[-1].view(-1, 1), [1] * len(ids)
        self.next = [len(row) - 1 if g else n for row, g, n in zip(ids, gammas, self.next)]
        return drafted(tokens, probs, gammas, steps, device)

    def propose_tree(
        self,
        ids: list[int],
        branching: Sequence[int],
        mode: str,
        sampling: Sampling,
        generator: torch.Generator,
        device: torch.device,
    ) -> tuple[TokenTree, int] | None:
        """Row 0's tree of the static shape ``branching``: the first call catches up with the
        true features and predicts the root's feature f^_{L-1}; each further call feeds every
        node drafted so far, each with the predicted feature of its parent (the root's for
        depth 1) and its own token's embedding, at head position L - 2 + depth, seeing its
        ancestors (tree attention); its output is the node's own predicted feature, whose
        logits give its children. None before the target has read anything."""
        length, known, start = len(ids), self.known[0], self.next[0]
        if known < length - 1 or known == 0:
            return None
        feats = self.features[:1, start : length - 1]
        after = torch.tensor([ids[start + 1 : length]], dtype=torch.long, device=device)
        root = self.head(feats, self.embed(after), calls.chain(start, feats.shape[1], device))[
            0, -1:
        ]
        self.next[0] = length - 1
        node_features = [root[:0]]  # predicted features of the nodes fed in the last call

        def expand(
            tokens: torch.Tensor, parents: list[int], depths: list[int], rows: list[int]
        ) -> torch.Tensor:
            known = torch.cat([root, node_features[0]])  # row 0: the root; row j + 1: node j
            parent_features = known[torch.tensor(parents, device=tokens.device) + 1]
            call = calls.tree(
                length - 1, 0, TokenTree(tokens, parents, mode="deterministic"), tokens.device
            )
            out = self.head(parent_features.unsqueeze(0), self.embed(tokens.view(1, -1)), call)[0]
            node_features[0] = out
            return self._logits(out[torch.tensor(rows, device=out.device)])

        return grow_tree(self._logits(root[0]), expand, branching, mode, sampling, generator), len(
            branching
        )

    def commit(
        self,
        lengths: list[int],
        hidden: torch.Tensor | None = None,
        hidden_starts: list[int] | None = None,
    ) -> None:
        """Keep every row's target features of its accepted path (positions < its new length - 1)
        for the table. They are projected (EAGLE-3's fc of the fused features) when the head next
        reads the table, all calls since in one product: while the engine takes plain steps (a
        drafter switched off) a one-row product per step is a visible share of a small compiled
        target's step (docs/algorithm.md, "Off where it loses"), for features that may never be read."""
        if hidden is None or hidden_starts is None:
            raise ValueError("FeatureDrafter.commit needs the target's hidden states")
        # a copy: the target may write its next call's output where this one's is
        self.unprojected.append(
            (hidden.to(self.head.dtype, copy=True), list(lengths), list(hidden_starts))
        )
        # bounded: long runs of plain steps hold a few hundred rows at most
        if len(self.unprojected) >= 256:
            self._project()
        self.known = [length - 1 for length in lengths]
        self.next = [min(n, length - 1) for n, length in zip(self.next, lengths)]

    def _project(self) -> None:
        """Project every kept call's features in one product and store each row's accepted path, one
        copy a call."""
        kept, self.unprojected = self.unprojected, []
        projected = self.head.project(torch.cat([hidden for hidden, _, _ in kept], dim=1))
        for part, (_, lengths, starts) in zip(
            projected.split([h.shape[1] for h, _, _ in kept], dim=1), kept
        ):
            if len(lengths) == 1:
                self.table[0, starts[0] : lengths[0] - 1] = part[0, : lengths[0] - 1 - starts[0]]
                continue
            where = [
                (b, start + j, j)
                for b, (length, start) in enumerate(zip(lengths, starts))
                for j in range(length - 1 - start)
            ]
            if where:
                rows, slots, cols = torch.tensor(where, device=part.device).T
                self.table[rows, slots] = part[rows, cols]

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        table = self.features  # projected now: the calls kept hold the old rows
        self.left = left_behind(self.left, self.next, rows)
        # only what the kept rows hold (next, known), not the whole context
        if rows != list(range(len(rows))):
            self.head.move_cache(rows, upto=max(1, *(self.next[r] for r in rows)))
            index = torch.tensor(rows, dtype=torch.long, device=table.device)
            known = max(self.known[r] for r in rows)
            table[: len(rows), :known] = table[:, :known].index_select(0, index)
        self.known = [self.known[r] for r in rows] + [0] * new
        self.next = [self.next[r] for r in rows] + [0] * new

    def resumed(self, rows: list[int], shared: list[int]) -> None:
        """New rows that go on from the row that left their slot (the protocol's hook): its features
        of the shared positions stay in the table (the target read them all, and reads the new row
        from ``shared`` on), and the head's slots whose inputs lie in them are kept. ``known`` stays 0:
        nothing is drafted before the target's first call for the row, as for a new row."""
        for b, count in zip(rows, shared):
            self.next[b] = max(0, min(self.left.pop(b, 0), count - 1))


HEAD_TYPE = "llama-feature-head"  # the model_type of an EAGLE-1 head's config.json (weights.drafters writes it)
register_drafter(
    DrafterKind(
        "head",
        "a feature head: drafts from the target's own features (EAGLE), from its folder",
        build=lambda head, target: FeatureDrafter(head, target),
        toy="speculative.proofs.cases:feature_drafter",
        loader="weights.drafters:read_feature_head",
        recognizes=lambda config: config.get("model_type") == HEAD_TYPE,
        network="head",
        memory="target-block",
    )
)
register_drafter(
    DrafterKind(
        "eagle3",
        "an EAGLE-3 head: fused features of three target layers, its own reduced vocabulary, from its folder",
        build=lambda head, target: FeatureDrafter(head, target),
        toy="speculative.proofs.cases:eagle3_drafter",
        loader="weights.drafters:read_eagle3_head",
        recognizes="weights.eagle3:is_eagle3_head",
        network="head",
        memory="target-block",
    )
)
