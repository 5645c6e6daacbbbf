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
  L' - 2 are on the accepted path; they are stored, and the next proposal re-reads
  positions L-1..L'-2 with true features (EAGLE recomputes accepted positions the same way).

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

from speculative import calls
from speculative.drafter import Draft, RowDrafts, drafted_rows, draw, draw_rows, pad_rows
from speculative.sampling import Sampling
from speculative.tree import TokenTree
from speculative.tree_drafting import grow_tree


class FeatureDrafter:
    """An EAGLE-1 style drafter: ``head`` is a model.feature_head.FeatureHead trained for ``target``."""

    reads_features = True

    def __init__(self, head: Any, target: Any) -> None:
        self.head, self.target = head, target
        self.vocab_size = target.config.vocab_size
        self.max_seq_len = head.config.max_seq_len
        self.features: torch.Tensor | None = None  # [cache_len, dim] the target's features by position
        self.known = 0  # positions 0..known-1 of `features` hold the target's own
        self.next = 0  # the head's first cache slot not holding a true input

    def start(self, cache_len: int, target: Any = None) -> None:
        if target is not None and target is not self.target:
            raise ValueError("this feature drafter was built for another target object")
        self.head.setup_cache(1, cache_len)
        self.features = torch.empty(cache_len, self.head.config.dim, dtype=self.head.dtype, device=self.head.device)
        self.known = self.next = 0

    def _logits(self, feature: torch.Tensor) -> torch.Tensor:
        logits = self.target.lm_head(feature)
        return logits if logits.dtype == torch.float64 else logits.float()

    def propose(self, seq: torch.Tensor, ids: list[int], gamma: int, sampling: Sampling,
                generator: torch.Generator) -> Draft:
        length = len(ids)
        if self.known < length - 1 or self.known == 0:  # nothing read by the target yet: a plain step
            return Draft(seq.new_empty(0), None, calls=0)
        start = self.next
        feats = self.features[start:length - 1].unsqueeze(0)  # true inputs f_start..f_{L-2}
        nxt = seq[:, start + 1:length]  # and the tokens after them
        tokens, probs = [], []
        for _ in range(gamma):
            call = calls.chain(start, feats.shape[1], feats.device)
            predicted = self.head(feats, self.target.embed_tokens(nxt), call)[:, -1:]
            start += feats.shape[1]
            x_i = draw(self._logits(predicted)[0, -1], sampling, generator, probs)
            tokens.append(x_i)
            feats, nxt = predicted, x_i.view(1, 1)
        self.next = length - 1
        return Draft(torch.stack(tokens), None if sampling.greedy else torch.stack(probs), calls=gamma)

    def propose_tree(self, seq: torch.Tensor, ids: list[int], branching: Sequence[int], mode: str,
                     sampling: Sampling, generator: torch.Generator) -> tuple[TokenTree, int] | None:
        """A tree of the static shape ``branching``: the first call catches up with the true
        features and predicts the root's feature f^_{L-1}; each further call feeds every node
        drafted so far, each with the predicted feature of its parent (the root's for depth
        1) and its own token's embedding, at head position L - 2 + depth, seeing its
        ancestors (tree attention); its output is the node's own predicted feature, whose
        logits give its children. None before the target has read anything."""
        length = len(ids)
        if self.known < length - 1 or self.known == 0:
            return None
        start = self.next
        feats = self.features[start:length - 1].unsqueeze(0)
        call = calls.chain(start, feats.shape[1], feats.device)
        root = self.head(feats, self.target.embed_tokens(seq[:, start + 1:length]), call)[0, -1:]
        self.next = length - 1
        node_features = [root[:0]]  # predicted features of the nodes fed in the last call

        def expand(tokens: torch.Tensor, parents: list[int], depths: list[int], rows: list[int]) -> torch.Tensor:
            known = torch.cat([root, node_features[0]])  # row 0: the root; row j + 1: node j
            parent_features = known[torch.tensor(parents, device=tokens.device) + 1]
            call = calls.tree(length - 1, 0, TokenTree(tokens, parents, mode="deterministic"), tokens.device)
            out = self.head(parent_features.unsqueeze(0), self.target.embed_tokens(tokens.view(1, -1)), call)[0]
            node_features[0] = out
            return self._logits(out[torch.tensor(rows, device=out.device)])

        tree = grow_tree(self._logits(root[0]), expand, branching, mode, sampling, generator)
        return tree, len(branching)

    def commit(self, length: int, hidden: torch.Tensor | None = None, hidden_start: int = 0) -> None:
        if hidden is None:
            raise ValueError("FeatureDrafter.commit needs the target's hidden states")
        keep = length - 1 - hidden_start  # features on the accepted path: positions < length - 1
        self.features[hidden_start:hidden_start + keep] = hidden[:keep]
        self.known = length - 1
        self.next = min(self.next, length - 1)

    # ------------------------------------------------------------------------- rows (a batch)
    def start_rows(self, max_rows: int, cache_len: int, target: Any = None) -> None:
        """As start(), for a batch: one features table, one head cache row and one known/next
        pair per row."""
        if target is not None and target is not self.target:
            raise ValueError("this feature drafter was built for another target object")
        self.head.setup_cache(max_rows, cache_len)
        # zeros, not empty: a placeholder row reads it, and NaN in a masked cache slot would still
        # poison attention (0 * NaN)
        self.row_features = torch.zeros(max_rows, cache_len, self.head.config.dim, dtype=self.head.dtype,
                                        device=self.head.device)
        self.row_known: list[int] = []
        self.row_next: list[int] = []

    def propose_rows(self, ids: list[list[int]], gammas: list[int], sampling: Sampling,
                     generators: list[torch.Generator], device: torch.device) -> RowDrafts:
        """propose() for every row, one head call per step: the first catches each row up on
        its true features (its own number of positions, padded), later ones feed each row's
        predicted feature and x_i. A row the target has not read yet drafts nothing, and a
        row that has drafted its gamma feeds a placeholder at its first unused slot."""
        gammas = [g if known >= len(row) - 1 and known > 0 else 0
                  for g, known, row in zip(gammas, self.row_known, ids)]
        steps = max(gammas, default=0)
        if steps == 0:
            return drafted_rows([], [], gammas, 0, device)
        starts = list(self.row_next)
        spans = [(nxt, len(row) - 1) if g else (nxt, nxt + 1) for nxt, row, g in zip(starts, ids, gammas)]
        widths = [hi - lo if g else 0 for (lo, hi), g in zip(spans, gammas)]
        width = max(widths)
        # true features f_lo..f_{hi-1} and the tokens after them, each row padded (with copies of its
        # last feature: any finite value will do) to the widest row, gathered in one operator
        cols = torch.tensor([[min(lo + j, hi - 1) for j in range(width)] for lo, hi in spans], device=device)
        rows = torch.arange(len(ids), device=device)
        feats = self.row_features[rows[:, None], cols]
        nxt = pad_rows([row[lo + 1:hi + 1] for row, (lo, hi) in zip(ids, spans)], device, width)
        last = torch.tensor([max(w - 1, 0) for w in widths], device=device)
        tokens, probs = [], []
        for i in range(steps):
            call = calls.ragged(starts, feats.shape[1], self.head.cache_len, device)
            predicted = self.head(feats, self.target.embed_tokens(nxt), call)[rows, last]  # [B, dim]
            live = [gen if g > i else None for gen, g in zip(generators, gammas)]
            tokens.append(draw_rows(self._logits(predicted), sampling, live, probs))
            starts = [s + w if g > i else s for s, w, g in zip(starts, widths, gammas)]
            feats, nxt = predicted.unsqueeze(1), tokens[-1].view(-1, 1)
            widths, last = [1] * len(ids), torch.zeros_like(last)
        self.row_next = [len(row) - 1 if g else n for row, g, n in zip(ids, gammas, self.row_next)]
        return drafted_rows(tokens, probs, gammas, steps, device)

    def commit_rows(self, lengths: list[int], hidden: torch.Tensor | None = None,
                    hidden_starts: list[int] | None = None) -> None:
        """Store every row's target features of its accepted path (positions < its new
        length - 1), in one indexed copy."""
        if hidden is None or hidden_starts is None:
            raise ValueError("FeatureDrafter.commit_rows needs the target's hidden states")
        where = [(b, start + j, j) for b, (length, start) in enumerate(zip(lengths, hidden_starts))
                 for j in range(length - 1 - start)]
        if where:
            rows, slots, cols = torch.tensor(where, device=hidden.device).T
            self.row_features[rows, slots] = hidden[rows, cols]
        self.row_known = [length - 1 for length in lengths]
        self.row_next = [min(n, length - 1) for n, length in zip(self.row_next, lengths)]

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        if rows != list(range(len(rows))):
            self.head.move_cache(rows)
            index = torch.tensor(rows, dtype=torch.long, device=self.row_features.device)
            self.row_features[:len(rows)] = self.row_features.index_select(0, index)
        self.row_known = [self.row_known[r] for r in rows] + [0] * new
        self.row_next = [self.row_next[r] for r in rows] + [0] * new
