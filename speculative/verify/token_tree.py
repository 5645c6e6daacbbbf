"""A drafted token tree: the data type every tree drafter builds and the tree walk verifies.

A tree drafts several candidates per position where a chain drafts one. :class:`TokenTree`
holds the drafted nodes, the parent of each, how each node's children were drawn (``mode``)
and the draft distributions they were drawn from (``q``); its methods answer the questions
about the tree's shape that drafting, the target's tree attention and verification ask
(depths, children, a node's path, the ancestor mask). :func:`branching_parents` gives the
parents of a static tree, a fixed number of children per depth.

The rule that verifies a tree, multi-draft rejection sampling, is speculative/verify/tree.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

# How a node's children were drawn from its q (TokenTree.mode; the rule for each: tree.py).
MODES = ("iid", "without_replacement", "deterministic")


def branching_parents(branching: Sequence[int]) -> list[int]:
    """Parents of the nodes of a static tree, breadth-first: branching[d] children for every
    node at depth d (the root's depth is 0). (3, 2, 1, 1) gives 3 + 6 + 6 + 6 = 21 nodes."""
    if isinstance(branching, (str, bytes)) or not isinstance(branching, Sequence):
        raise ValueError(f"branching must be a sequence of integers >= 1, got {branching!r}")
    for b in branching:
        if isinstance(b, bool) or not isinstance(b, Integral) or b < 1:
            raise ValueError(
                f"branching must be a sequence of integers >= 1, got {tuple(branching)!r}"
            )
    parents: list[int] = []
    level = [-1]  # the nodes of the current depth; -1 is the root
    for b in branching:
        nxt = []
        for parent in level:
            for _ in range(b):
                nxt.append(len(parents))
                parents.append(parent)
        level = nxt
    return parents


@dataclass
class TokenTree:
    """A drafted token tree, ready for verification.

    tokens: [N] LongTensor, the drafted nodes. The root is the sequence's last committed
        token and is not a node.
    parents: the parent node of each node, -1 for the root's children. A parent always comes
        before its children (breadth-first order by depth is one such order).
    mode: how every node's children were drawn from that node's q: "iid" (independently),
        "without_replacement", or "deterministic" (chosen, e.g. the top-k of q).
    q: [N+1, V] draft distributions: row 0 the one the root's children were drawn from, row
        j+1 the one node j's children were drawn from. Rows of leaves are never read (they
        may be zeros). Ignored, and may be None, for "deterministic".

    Row r of p and q belongs to "node r-1", row 0 to the root: the same convention as
    verify_step's p_1 .. p_{gamma+1}.
    """

    tokens: torch.Tensor
    parents: list[int]
    mode: str = "iid"
    q: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (
            not isinstance(self.tokens, torch.Tensor)
            or self.tokens.dim() != 1
            or self.tokens.dtype != torch.long
        ):
            raise ValueError("tokens must be a 1-D LongTensor [N]")
        if isinstance(self.parents, torch.Tensor) or not isinstance(self.parents, Sequence):
            raise ValueError(
                f"parents must be a list of integers, got {type(self.parents).__name__}"
            )
        self.parents = list(self.parents)
        n = len(self.parents)
        if self.tokens.shape[0] != n:
            raise ValueError(f"{self.tokens.shape[0]} tokens but {n} parents")
        for j, parent in enumerate(self.parents):
            if isinstance(parent, bool) or not isinstance(parent, Integral):
                raise ValueError(f"parents[{j}] = {parent!r} is not an integer")
            if not -1 <= parent < j:
                raise ValueError(
                    f"parents[{j}] = {parent}: a node's parent must be -1 (the root) or an earlier "
                    f"node (0..{j - 1})"
                )
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode != "deterministic":
            if not isinstance(self.q, torch.Tensor):
                raise ValueError(
                    f"mode {self.mode!r} needs q, the [N+1, V] distributions the children were drawn from"
                )
            if self.q.dim() != 2 or self.q.shape[0] != n + 1 or not self.q.is_floating_point():
                raise ValueError(
                    f"q must be a floating [N+1, V] = [{n + 1}, V] tensor, got {tuple(self.q.shape)} "
                    f"{self.q.dtype}"
                )

    @classmethod
    def from_branching(
        cls,
        tokens: torch.Tensor,
        branching: Sequence[int],
        mode: str = "iid",
        q: torch.Tensor | None = None,
    ) -> TokenTree:
        """The static tree of :func:`branching_parents` with the given child tokens (breadth-first)."""
        parents = branching_parents(branching)
        if (
            isinstance(tokens, torch.Tensor)
            and tokens.dim() == 1
            and tokens.shape[0] != len(parents)
        ):
            raise ValueError(
                f"branching {tuple(branching)} has {len(parents)} nodes, got {tokens.shape[0]} tokens"
            )
        return cls(tokens=tokens, parents=parents, mode=mode, q=q)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def depths(self) -> list[int]:
        """Depth of every node: 1 for the root's children. Node j sits at sequence position
        (position of the root) + depths()[j]."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def children(self, node: int = -1) -> list[int]:
        """The children of a node (-1: the root), in the order verification tries them."""
        return [j for j, parent in enumerate(self.parents) if parent == node]

    def children_by_row(self) -> list[list[int]]:
        """children_by_row()[r]: the children of row r (row 0 the root, row j+1 node j)."""
        rows: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for j, parent in enumerate(self.parents):
            rows[parent + 1].append(j)
        return rows

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`, both included."""
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} is not in a tree of {self.num_nodes} nodes")
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: [i, j] is True when node j is node i or one of its ancestors, i.e.
        which drafted nodes node i may attend to in the target's tree attention (on top of
        the committed sequence, which every node sees)."""
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool)
        for j, parent in enumerate(self.parents):
            if parent >= 0:
                mask[j] |= mask[parent]  # parents come first, so the parent's row is complete
        return mask
