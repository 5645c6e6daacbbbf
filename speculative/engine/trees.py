"""A token tree in the engine (one row): the request checked, the tree fit to the room the row has
left, and after verification the accepted path moved into consecutive cache slots.

Trees are drafted for one row at a time: a batched tree would need every row's tree mask and path
move in one call, and with one row they already beat a chain only where the target's call is
cheap next to the draft's (docs/trees_and_blocks.md). An engine with a tree holds one row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from speculative.draft.protocol import grows_trees
from speculative.draft.trees import TREE_MODES, check_tree
from speculative.verify.tree import branching_parents


def keep_path(target: Any, path: list[int], length: int, target_next: int,
              hidden: torch.Tensor | None) -> torch.Tensor | None:
    """After a tree's verification, move the accepted path's keys and values from the nodes'
    slots (L + node) to consecutive slots L.. of the target's cache, and return the target's
    features in sequence order (the call's chain part, then the path) for the drafter."""
    if path and path != list(range(len(path))):
        target.move_cache([0], [[length + node for node in path]], [list(range(length, length + len(path)))])
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


def check_tree_request(tree: Sequence[int], tree_mode: str, drafter: Any, gamma: Any, verify: str,
                       max_rows: int) -> tuple[tuple[int, ...], int]:
    """The tree as a tuple, and its depth in gamma's place; ValueError for what cannot combine."""
    shape = check_tree(tree)
    if tree_mode not in TREE_MODES:
        raise ValueError(f"tree_mode must be one of {', '.join(map(repr, TREE_MODES))}, got {tree_mode!r}")
    if drafter is None or not grows_trees(drafter):
        raise ValueError(f"{type(drafter).__name__} cannot build token trees (a draft model or a feature head can)")
    if gamma is not None and gamma != len(shape):
        raise ValueError("gamma and tree both set: a tree's depth is its gamma; leave gamma alone")
    if callable(verify):
        raise ValueError("a verifier of your own judges a chain; a tree is verified by its own walk "
                         "(speculative.verify.tree)")
    if verify != "token":
        raise ValueError(f"--verify {verify} judges a chain; a tree is verified by its own walk")
    if max_rows != 1:
        raise ValueError("token trees are drafted for one row at a time (speculative.engine): use max_rows=1")
    return shape, len(shape)
