"""A token tree in the engine (one row): the request checked, the tree fit to the room the row has
left, after verification the accepted path moved into consecutive cache slots, and tree="auto"'s
choice of the shape by measurement (:class:`AutoTree`).

Trees are drafted for one row at a time: a batched tree would need every row's tree mask and path
move in one call, and with one row they already beat a chain only where the target's call is
cheap next to the draft's (docs/trees_and_blocks.md). An engine with a tree holds one row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from speculative.draft.protocol import grows_trees
from speculative.draft.trees import TREE_MODES, check_tree
from speculative.verify.tree import branching_parents


def keep_path(
    target: Any, path: list[int], length: int, target_next: int, hidden: torch.Tensor | None
) -> torch.Tensor | None:
    """After a tree's verification, move the accepted path's keys and values from the nodes'
    slots (L + node) to consecutive slots L.. of the target's cache, and return the target's
    features in sequence order (the call's chain part, then the path) for the drafter."""
    if path and path != list(range(len(path))):
        target.move_cache(
            [0], [[length + node for node in path]], [list(range(length, length + len(path)))]
        )
    if hidden is None:
        return None
    prefix = length - target_next
    order = list(range(prefix)) + [prefix + node for node in path]
    return hidden[:, torch.tensor(order, device=hidden.device)]


def fit_tree(tree: tuple[int, ...], depth: int, room: int) -> tuple[int, ...]:
    """The first levels of ``tree``: at most ``depth`` of them, with fewer nodes than the
    ``room`` cache slots left (the nodes sit in slots L..L+N-1)."""
    levels = tree[:depth]
    while levels and len(branching_parents(levels)) >= room:
        levels = levels[:-1]
    return levels


# tree="auto"'s candidates: chains of 2 to 4 tokens (a tree of one child per depth), the trees that widen
# the first levels, and no drafting at all (a plain target step).
AUTO_SHAPES = ((1, 1), (1, 1, 1), (1, 1, 1, 1), (2, 1, 1), (3, 1, 1), (2, 2, 1), (3, 2, 1, 1), ())


@dataclass
class AutoTree:
    """tree="auto": the shape of each iteration's draft, chosen by what this run measures.

    A tree accepts more tokens per target call than its chain, but drafting it costs a drafter
    call per depth over more nodes and the target's call reads them all; which wins depends on the
    drafter, the target and the sampling (docs/trees_and_blocks.md), so no model of them is trusted
    here: each candidate shape (``AUTO_SHAPES``; () is a plain target step) is timed as whole
    iterations, start to start, as the tokens its last ``window`` clean iterations emitted over
    their seconds (a ratio of sums: one iteration's tokens vary from 1 to the depth + 1, most of
    all when sampling, and one unlucky iteration must not outweigh a plain step's steady one).
    Every shape is tried first, until it has a clean iteration (not the prompt's, not one right
    after a plain step, where a drafter catches up, not one cut to nothing by the row's limits;
    an iteration is timed when the next one starts, and a shape waiting for its time counts as
    tried); then the fastest is used, and one iteration in ``probe_every`` goes to the shape
    measured longest ago, so that every figure keeps being renewed (after a plain step a shape is
    drafted twice running, the first catching up, so that a plain step that leads does not keep
    the others from ever being measured). The shape decides only how
    many tokens are drafted and how: every iteration is exact, whatever led to its shape."""

    shapes: tuple[tuple[int, ...], ...] = AUTO_SHAPES
    window: int = 6  # clean iterations per shape in its figure
    probe_every: int = 8
    # shape -> (seconds, tokens)
    rates: dict[tuple[int, ...], list[tuple[float, int]]] = field(default_factory=dict)
    # shape -> iteration last measured
    seen: dict[tuple[int, ...], int] = field(default_factory=dict)
    last: tuple[int, tuple[int, ...] | None] = (-1, None)  # (iteration, shape) chosen
    pending: tuple | None = (
        None  # (iteration, shape, tokens, start mark, clean): timed when the next starts
    )
    previous_depth: int = 0

    def covering(self) -> tuple[int, ...]:
        """The branching per depth that holds every candidate (the cache slots a row keeps free)."""
        depth = max(len(s) for s in self.shapes)
        return tuple(
            max((s[d] for s in self.shapes if d < len(s)), default=1) for d in range(depth)
        )

    def choose(self, iteration: int, counts: dict | None = None) -> tuple[int, ...]:
        """The shape of engine iteration ``iteration``, counted once in ``counts`` (a row's
        stats.tree_shapes)."""
        if self.last[0] != iteration:
            # timed when this one starts
            timing = self.pending[1] if self.pending and self.pending[4] else None
            untried = [s for s in self.shapes if s not in self.rates and s != timing]
            again = (
                self.pending
                and self.pending[0] == iteration - 1
                and self.pending[1]
                and not self.pending[4]
            )
            # a draft just after a plain step caught up: its time is next
            if again and self.pending[0] > 0:
                self.last = (iteration, self.pending[1])
            elif untried or not self.rates:  # (no rates: one shape only, waiting for its time)
                self.last = (iteration, untried[0] if untried else timing)
            elif iteration % self.probe_every == 0:  # the shape measured longest ago
                self.last = (iteration, min(self.rates, key=self.seen.__getitem__))
            else:  # the most tokens per second
                self.last = (iteration, max(self.rates, key=self.rate))
            if counts is not None:
                counts[self.last[1]] = counts.get(self.last[1], 0) + 1
        return self.last[1]

    def observe(self, iteration: int, depth: int, tokens: int, start: Any, clock: Any) -> None:
        """Engine iteration ``iteration`` (the depth it drafted, the tokens it emitted, its
        ``clock`` mark at its ``start``); the one before it, now timed, is counted if it was clean."""
        shape = self.last[1] if self.last[0] == iteration else None
        clean = (
            iteration > 0
            and shape is not None
            and (depth > 0) == bool(shape)
            and not (depth and not self.previous_depth)
        )
        pending, self.pending, self.previous_depth = (
            self.pending,
            (iteration, shape, tokens, start, clean),
            depth,
        )
        if pending is None or pending[0] != iteration - 1 or not pending[4]:
            return
        i, shape, tokens, begun, _ = pending
        if (seconds := clock.seconds(begun, start)) > 0:
            self.rates[shape] = [*self.rates.get(shape, []), (seconds, tokens)][-self.window :]
            self.seen[shape] = i

    def rate(self, shape: tuple[int, ...]) -> float:
        """Tokens per second of ``shape``'s last clean iterations."""
        return sum(n for _, n in self.rates[shape]) / sum(t for t, _ in self.rates[shape])


def check_tree_request(
    tree: Sequence[int] | str, tree_mode: str, drafter: Any, gamma: Any, verify: str, max_rows: int
) -> tuple[tuple[int, ...], int]:
    """The tree as a tuple (for "auto", the shape that covers every candidate), and its depth in
    gamma's place; ValueError for what cannot combine."""
    if isinstance(tree, str) and tree != "auto":
        raise ValueError(
            f'tree must be the branching per depth, e.g. (3, 2, 1, 1), or "auto"; got {tree!r}'
        )
    shape = AutoTree().covering() if tree == "auto" else check_tree(tree)
    if tree_mode not in TREE_MODES:
        raise ValueError(
            f"tree_mode must be one of {', '.join(map(repr, TREE_MODES))}, got {tree_mode!r}"
        )
    if drafter is None or not grows_trees(drafter):
        raise ValueError(
            f"{type(drafter).__name__} cannot build token trees (a draft model or a feature head can)"
        )
    if gamma is not None and gamma != len(shape):
        raise ValueError("gamma and tree both set: a tree's depth is its gamma; leave gamma alone")
    if callable(verify):
        raise ValueError(
            "a verifier of your own judges a chain; a tree is verified by its own walk "
            "(speculative.verify.tree)"
        )
    if verify != "token":
        raise ValueError(f"--verify {verify} judges a chain; a tree is verified by its own walk")
    if max_rows != 1:
        raise ValueError(
            "token trees are drafted for one row at a time (speculative.engine): use max_rows=1"
        )
    return shape, len(shape)
