"""Growing a token tree of a static shape (SpecInfer, Medusa, EAGLE): the drafting half of
tree speculation; speculative.verify.tree verifies what is grown here.

A shape is the branching per depth, e.g. (3, 2, 1, 1): 3 candidates after the sequence,
2 after each of them, then one more after each: 3 + 6 + 6 + 6 = 21 nodes in breadth-first
order (speculative.verify.token_tree.branching_parents). A drafter grows it one depth per
call: the first call reads what the drafter has not seen of the sequence and gives the root's
distribution; each later call scores every node drafted so far in one batch of tree
attention (each node at its depth, seeing its ancestors) and gives the distributions of
the newest depth's nodes. A depth-D tree costs D calls, like a chain of D tokens; the
nodes of the deepest level are never fed, like a chain's x_gamma.

How a node's children are drawn from its distribution (``TokenTree.mode``; the rule for
each, speculative.verify.tree):

* "deterministic": the k most likely tokens of the drafter's logits. The only mode at
  temperature 0, where verification follows the child equal to the target's argmax;
* "without_replacement": k distinct tokens drawn one after another from q, each time
  with the tokens already drawn removed and the rest renormalised (the default when
  sampling: no two siblings repeat a token, so no verification trial is wasted);
* "iid": k independent draws from q (SpecInfer's setting; siblings may repeat).

The law used for drawing is the warped q that verification is given: drafting from one
q and judging with another is the bug the mutants of tests/speculative/verify/test_tree.py show.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from speculative.sampling import Sampling, full_width, sample, warp
from speculative.verify.token_tree import TokenTree, branching_parents

TREE_MODES = ("without_replacement", "iid", "deterministic")

# expand(tokens [n], parents, depths, rows) -> logits [len(rows), V] of the nodes in `rows`,
# which are the newest depth's nodes, given every node drafted so far.
Expand = Callable[[torch.Tensor, list[int], list[int], list[int]], torch.Tensor]


def check_tree(branching: Sequence[int]) -> tuple[int, ...]:
    """The branching as a tuple of ints >= 1 (ValueError otherwise): at least one depth."""
    parents = branching_parents(branching)  # validates
    if not parents:
        raise ValueError("a tree needs at least one depth, e.g. (3, 2, 1, 1)")
    return tuple(int(b) for b in branching)


def draw_children(
    logits: torch.Tensor, k: int, mode: str, sampling: Sampling, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None, list[list[bool]] | None]:
    """k children for each of M nodes: tokens [M, k], the warped q [M, V] they were drawn from
    (None for "deterministic", whose children are chosen, not drawn), and for
    "without_replacement" which draws were possible at all ([M][k] on the host; None: all):
    a q with fewer than k tokens of positive probability runs out, and those children are
    dropped (a draw from nothing is no draw)."""
    if mode == "deterministic":
        if k > logits.shape[-1]:
            raise ValueError(f"{k} deterministic children but only {logits.shape[-1]} tokens")
        return logits.topk(k, dim=-1).indices, None, None
    q = warp(logits, sampling)
    if mode == "iid":
        return torch.stack([sample(q, generator) for _ in range(k)], dim=-1), q, None
    left = q.clone()  # q without the tokens drawn so far
    picks = []
    alive = []
    for _ in range(k):  # without replacement: draw, remove, renormalise
        mass = left.sum(-1, keepdim=True)
        alive.append(mass[:, 0] > 0)
        left = torch.where(mass > 0, left / mass, left)
        # a placeholder draw from q where nothing is left; alive drops it
        token = sample(torch.where(mass > 0, left, q), generator)
        picks.append(token)
        left.scatter_(-1, token[:, None], 0.0)
    return torch.stack(picks, dim=-1), q, torch.stack(alive, dim=-1).tolist()


def grow_tree(
    root_logits: torch.Tensor,
    expand: Expand,
    branching: Sequence[int],
    mode: str,
    sampling: Sampling,
    generator: torch.Generator,
) -> TokenTree:
    """Grow a static tree from the root's logits [V], calling ``expand`` once per depth below
    the first. Returns the TokenTree with q [N+1, V] (rows of leaves are zeros)."""
    if sampling.greedy:
        mode = "deterministic"
    tokens = torch.empty(0, dtype=torch.long, device=root_logits.device)
    parents: list[int] = []
    depths: list[int] = []
    q_rows: list[torch.Tensor] = []  # (row, q) pairs are placed at the end
    q_index: list[int] = []
    level = [-1]  # the nodes of the current depth; -1 is the root
    logits = root_logits.unsqueeze(0)  # [len(level), V] their logits
    for depth, k in enumerate(branching, start=1):
        if depth > 1:
            logits = expand(tokens, parents, depths, level)
        children, q, alive = draw_children(full_width(logits), k, mode, sampling, generator)
        if q is not None:
            q_rows.append(q)
            q_index.extend(node + 1 for node in level)
        first = len(parents)  # this depth's first node
        kept = []  # which of the k children of each node were drawn, flattened
        for i, node in enumerate(level):
            for j in range(k):
                if alive is None or alive[i][j]:
                    parents.append(node)
                    depths.append(depth)
                    kept.append(i * k + j)
        if len(kept) < children.numel():
            children = children.reshape(-1)[
                torch.tensor(kept, dtype=torch.long, device=children.device)
            ]
        tokens = torch.cat([tokens, children.reshape(-1)])
        level = list(range(first, len(parents)))
    q_all = None
    if q_rows:
        stacked = torch.cat(q_rows)
        q_all = stacked.new_zeros(len(parents) + 1, stacked.shape[-1])
        q_all[torch.tensor(q_index, device=stacked.device)] = stacked
    return TokenTree(tokens=tokens, parents=parents, mode=mode, q=q_all)
