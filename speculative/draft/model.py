"""The paper's drafter: a smaller model of the target's family (:class:`ModelDrafter`), and
:func:`as_drafter`, which wraps a plain model in one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from model import call as calls
from speculative.draft.protocol import (
    Draft,
    Drafter,
    drafted,
    draw_rows,
    is_drafter,
    is_model,
    left_behind,
    newest,
    pad_rows,
)
from speculative.draft.registry import DrafterKind, register_drafter
from speculative.draft.trees import grow_tree
from speculative.sampling import Sampling
from speculative.verify.token_tree import TokenTree


class ModelDrafter:
    """The paper's M_q: a smaller model of the target's family, with its own KV cache.

    For each row it remembers only ``next``, its first cache slot not holding a token of the
    row's sequence: next = L + gamma - 1 after proposing, min(next, L' - 1) after verification
    (docs/kv_cache.md, "The two models' bookkeeping", says why that is the whole rollback).
    A row that goes on from the one that left its slot (the ``resumed`` hook) keeps the slots that
    hold the tokens the two share: next = min(that row's next, the shared tokens).

    The model is used only through its cached call ``model(tokens, call)``, ``setup_cache``,
    ``move_cache`` and ``config.vocab_size`` / ``config.max_seq_len``.
    """

    reads_features = False

    def __init__(self, model: Any) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = model.config.max_seq_len
        self.next: list[int] = []
        self.left: dict[int, int] = {}  # a free slot -> the next of the row that left it

    def start(self, max_rows: int, cache_len: int, target: Any = None) -> None:
        self.model.setup_cache(max_rows, cache_len)
        self.next = []
        self.left = {}

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: list[Sampling],
        generators: list[torch.Generator],
        device: torch.device,
    ) -> Draft:
        """Lines 1-3 for every row, one draft call per step for all rows: for i = 1..gamma,
        q_i = M_q(prefix + x_1..x_{i-1}) and x_i ~ q_i. The first call catches each row up
        (its own number of tokens, padded), later ones feed each row's x_i. A row that has
        drafted its gamma (fewer, near its limits) feeds a placeholder that it writes at its
        first unused slot, and draws nothing."""
        steps = max(gammas, default=0)
        if steps == 0:
            return drafted([], [], gammas, 0, device)
        starts = list(self.next)
        feeds = [row[nxt:] if g else row[:1] for row, nxt, g in zip(ids, starts, gammas)]
        widths = [len(f) if g else 0 for f, g in zip(feeds, gammas)]
        batch = pad_rows(feeds, device)
        tokens = []  # x_i of every row, [B] per step
        probs = []  # q_i of every row, [B, V] per step
        for i in range(steps):
            call = calls.ragged(starts, batch.shape[1], self.model.cache_len, device)
            logits = newest(self.model(batch, call), widths if i == 0 else [1])  # [B, V]
            live = [gen if g > i else None for gen, g in zip(generators, gammas)]
            tokens.append(draw_rows(logits, samplings, live, probs))
            starts = [s + w if g > i else s for s, w, g in zip(starts, widths, gammas)]
            # from the second call on, every row feeds its newest token
            batch = tokens[-1].view(-1, 1)
            widths = [1] * len(ids)
        self.next = [len(row) + g - 1 if g else nxt for row, g, nxt in zip(ids, gammas, self.next)]
        return drafted(tokens, probs, gammas, steps, device)

    def propose_tree(
        self,
        ids: list[int],
        branching: Sequence[int],
        mode: str,
        sampling: Sampling,
        generator: torch.Generator,
        device: torch.device,
    ) -> tuple[TokenTree, int]:
        """Row 0's tree of the static shape ``branching`` (speculative.draft.trees): one call
        that catches up to the sequence and gives the root's distribution, then one call per
        further depth over all nodes so far, placed after the sequence with tree attention
        (the nodes are re-fed each time: a call of a small draft costs its fixed overhead
        more than its rows). Its cache slots from L on then hold tree nodes: next = L."""
        length = len(ids)
        start = self.next[0]
        feed = torch.tensor([ids[start:]], dtype=torch.long, device=device)
        root = self.model(feed, calls.chain(start, length - start, device))[0, -1]
        self.next[0] = length

        def expand(
            tokens: torch.Tensor, parents: list[int], depths: list[int], rows: list[int]
        ) -> torch.Tensor:
            tree = TokenTree(tokens, parents, mode="deterministic")
            logits = self.model(tokens.view(1, -1), calls.tree(length, 0, tree, tokens.device))[0]
            return logits[torch.tensor(rows, device=logits.device)]

        return grow_tree(root, expand, branching, mode, sampling, generator), len(branching)

    def commit(
        self,
        lengths: list[int],
        hidden: torch.Tensor | None = None,
        hidden_starts: list[int] | None = None,
    ) -> None:
        self.next = [min(nxt, length - 1) for nxt, length in zip(self.next, lengths)]

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        self.left = left_behind(self.left, self.next, rows)
        if rows != list(range(len(rows))):
            # the slots holding true inputs (next), not the whole context
            self.model.move_cache(rows, upto=max(1, *(self.next[r] for r in rows)))
        self.next = [self.next[r] for r in rows] + [0] * new

    def resumed(self, rows: list[int], shared: list[int]) -> None:
        """New rows that go on from the row that left their slot (the protocol's hook): the slots
        holding tokens that the two rows share are kept, the rest read at the next proposal."""
        for b, count in zip(rows, shared):
            self.next[b] = min(self.left.pop(b, 0), count)


def as_drafter(draft: Any) -> Drafter:
    """A drafter as it is, or a plain model (anything with a ``config``) wrapped in ModelDrafter."""
    if is_drafter(draft):
        return draft
    if is_model(draft):
        return ModelDrafter(draft)
    raise TypeError(
        f"draft must be a model (with .config, callable as model(tokens, call)) or a drafter "
        f"(start/propose/commit/keep_rows, see speculative.draft), got {type(draft).__name__}"
    )


register_drafter(
    DrafterKind(
        "model",
        "a smaller model of the target's family (the paper's M_q), from a checkpoint",
        build=lambda network, target: ModelDrafter(network),
        toy="speculative.proofs.cases:model_drafter",
        loader="weights.drafters:read_draft_model",
        network="checkpoint",
        memory="own",
        bare=True,
    )
)
