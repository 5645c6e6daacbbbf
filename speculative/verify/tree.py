"""Verification of a drafted token tree: multi-draft rejection sampling, as small pure functions.

A chain drafts one token per position; a tree drafts several candidates per position. The
target scores every node of the tree in one call (tree attention, each node at its depth),
and verification walks the tree from the root, keeping at most one child per node:

* :class:`TokenTree` (speculative/verify/token_tree.py) -- the drafted nodes, their parents,
  how each node's children were drawn (``mode``) and the draft distributions they were drawn
  from (``q``).
* :func:`child_distribution`, :func:`child_acceptance`, :func:`reject_child`, :func:`passes`
  -- the rule for one child: the law it was drawn from, its acceptance probability, what a
  rejection leaves for the next sibling, the comparison with the uniform draw.
* :func:`node_rules` -- that rule run over all children of M nodes at once: each child's
  acceptance probability given that its earlier siblings were rejected, and the
  distribution of the target's own token when all of them were rejected. The exact
  enumeration tests call this same function, and inject their mutants into the ones above.
* :func:`tree_rules` -- :func:`node_rules` for every node of a tree, rows placed.
* :func:`verify_tree` -- the walk with random draws; :func:`verify_tree_greedy` -- temperature 0.

The walk. At the current node (the root first), with residual target distribution p_cur =
p[row] and draft distribution q_cur = q[row], try the children c_1, c_2, .. in order:

    c_k is accepted with probability min(1, p_cur(c_k) / q_k(c_k))   (r < ratio, r ~ U[0, 1))
    on acceptance: move to c_k, restart with p_cur = p[c_k's row], q_cur = q[c_k's row]
    on rejection:  p_cur <- norm(max(0, p_cur - q_k))                (SpecInfer)
                   q_cur <- q_k without c_k, renormalised            (without replacement only)

where q_k, the law c_k was drawn from, is q_cur for "iid" and "without_replacement" children
and the one-hot e_{c_k} for "deterministic" ones (top-k, say). If every child is rejected,
the target's own token is drawn from the final p_cur; at an accepted leaf (no children) it
is drawn from p[leaf's row], the bonus token. A leaf is simply a node whose zero children
were all rejected, so both cases are "draw from p_cur when the children run out".

Why this emits exactly p, for every mode and any tree shape fixed before the children are
drawn: docs/trees_and_blocks.md ("Why the output is exactly the target's"), by induction on
the children left at a node. The one fact each mode needs: given the earlier siblings and
their rejections, the next child is distributed as the q_k the rule uses -- q[row] for
"iid", q with the earlier children removed and renormalised for "without_replacement"
(Jeon et al. 2024), the one-hot e_{c_k} for "deterministic". A bad tree costs acceptance,
never exactness.

Float corner cases, none of which can happen in exact arithmetic: a residual with no mass
(p_cur == q_k) falls back to p_cur (speculative.verify.residual_distribution); a child that
its own q gives probability 0 (a drafter that broke its contract) gets acceptance 0, so
that a token of target probability 0 is never emitted; "without_replacement" siblings that
exhaust q leave q_cur all zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculative.sampling import sample
from speculative.verify.token import residual_distribution
from speculative.verify.token_tree import TokenTree

# re-exported: the engine, the command line and the benchmarks import it from here
from speculative.verify.token_tree import branching_parents as branching_parents
from speculative.verify.verdict import Verdict, Verification


# ----------------------------------------------------------------------------- the rule at one node
def passes(r: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """The acceptance test: r < ratio for r ~ U[0, 1). torch.rand can return exactly 0, and
    the comparison is strict so that P(pass) = ratio for ratio in [0, 1] and a child of
    acceptance 0 (target probability 0) is never taken, even when r = 0."""
    return r < ratio


def child_acceptance(
    p_cur: torch.Tensor, q_child: torch.Tensor, token: torch.Tensor
) -> torch.Tensor:
    """min(1, p_cur(x) / q_child(x)) for the child token x, where q_child is the law x was
    drawn from. p_cur, q_child: [..., V]; token: LongTensor [...].

    q_child(x) = 0 cannot happen for a child really drawn from q_child; 0 is returned there
    (not verify.acceptance_probability's 1, which is harmless in a chain where q(x) = 0
    tokens are never drafted): a drafter that breaks the contract must not make the walk
    accept a token that the target gives probability 0."""
    index = token.unsqueeze(-1)
    p_x = p_cur.gather(-1, index).squeeze(-1)
    q_x = q_child.gather(-1, index).squeeze(-1)
    return torch.where(q_x > 0, p_x / q_x, torch.zeros_like(p_x)).clamp(max=1.0)


def child_distribution(q_cur: torch.Tensor, token: torch.Tensor, mode: str) -> torch.Tensor:
    """The law the child `token` was drawn from: q_cur for random children, the one-hot on
    the child itself for deterministic ones (a fixed choice is a draw from a point mass)."""
    if mode == "deterministic":
        return F.one_hot(token, q_cur.shape[-1]).to(q_cur.dtype)
    return q_cur


def reject_child(
    p_cur: torch.Tensor, q_child: torch.Tensor, token: torch.Tensor, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """After the child `token` ~ q_child was rejected: (the residual target, the law of the next sibling).

    The residual is norm(max(0, p_cur - q_child)) in every mode (SpecInfer): it is the law of
    the token given this rejection. The next sibling is another draw from q_child for "iid";
    for "without_replacement" it is a draw from q_child without `token`, renormalised
    (recursive rejection sampling); for "deterministic" the next child's own one-hot is used
    and the value returned here is not read."""
    p_next = residual_distribution(p_cur, q_child)
    if mode != "without_replacement":
        return p_next, q_child
    removed = q_child.scatter(-1, token.unsqueeze(-1), 0.0)
    mass = removed.sum(-1, keepdim=True)
    return p_next, torch.where(mass > 0, removed / mass, removed)


@dataclass
class NodeRules:
    """What the rule decides at M nodes, before any random draw."""

    # [M, K] acceptance probability of child k given children 0..k-1 were rejected; 0 past a width
    ratios: torch.Tensor
    # [M, V] law of the target's token when every child was rejected (p itself at a leaf)
    fallback: torch.Tensor
    # [M] sum_x min(p(x), q_1(x)) with q_1 the first child's law; 0 at a leaf
    overlap: torch.Tensor


def node_rules(
    p: torch.Tensor,
    q: torch.Tensor | None,
    children: torch.Tensor,
    widths: Sequence[int],
    mode: str,
) -> NodeRules:
    """Run the sibling rule over the children of M nodes at once.

    p: [M, V] the target after each node's path; q: [M, V] the draft distribution the node's
    children were drawn from (None for "deterministic"); children: [M, K] child tokens in the
    order they are tried; widths: how many children each node has, non-increasing (sort the
    nodes so), so that the nodes with a k-th child are the first ones and rank k works on a
    prefix of rows: no masking, no work on padding (entries past a width are never read).

    Nothing here is random: the ratio of child k only depends on the tokens of children
    0..k-1 (the residual does not depend on the random outcomes, only on which children were
    rejected, and child k is only tried when all of those were). So every decision of the
    walk can be computed up front, with one uniform per node, and the host only needs the
    pass/fail bits (:func:`verify_tree`). p and q are not modified.
    """
    m = p.shape[0]
    widths = list(widths)
    if (
        len(widths) != m
        or any(a < b for a, b in zip(widths, widths[1:]))
        or (widths and widths[-1] < 0)
    ):
        raise ValueError(
            f"widths must give the number of children of each of the {m} rows, non-increasing; "
            f"got {widths}"
        )
    k_max = widths[0] if widths else 0
    if children.shape[0] != m or children.shape[1] < k_max:
        raise ValueError(
            f"children must be [M, K] = [{m}, >= {k_max}], got {tuple(children.shape)}"
        )
    p_cur = p.clone()
    q_cur = None if q is None or mode == "deterministic" else q.clone()
    # deterministic children only need the shape and dtype of a q
    placeholder = torch.zeros_like(p[:1])
    ratios = p.new_zeros(m, k_max)
    overlap = p.new_zeros(m)
    for k in range(k_max):
        live = sum(1 for w in widths if w > k)  # the rows that have a k-th child: a prefix
        token = children[:live, k]
        p_k = p_cur[:live]
        q_k = q_cur[:live] if q_cur is not None else placeholder.expand(live, -1)
        q_child = child_distribution(q_k, token, mode)
        if k == 0:
            overlap[:live] = torch.minimum(p_k, q_child).sum(-1)
        ratios[:live, k] = child_acceptance(p_k, q_child, token)
        p_next, q_next = reject_child(p_k, q_child, token, mode)
        p_cur[:live] = p_next
        if q_cur is not None and q_next is not q_k:  # "iid" hands q on unchanged: nothing to copy
            q_cur[:live] = q_next
    return NodeRules(ratios=ratios, fallback=p_cur, overlap=overlap)


# ----------------------------------------------------------------------------- the whole tree
@dataclass
class TreeRules:
    """:func:`node_rules` for every row of a tree."""

    ratios: torch.Tensor  # [N] acceptance probability of node j when it is tried
    stop: torch.Tensor  # [N+1, V] law of the target's token when the walk stops at row r
    overlap: torch.Tensor  # [N+1] NodeRules.overlap per row, 0 at leaves
    # [N+1] probability that some child of row r is accepted, 0 at leaves
    node_acceptance: torch.Tensor


def check_rows(p: torch.Tensor, tree: TokenTree) -> None:
    if p.dim() != 2 or p.shape[0] != tree.num_nodes + 1:
        raise ValueError(f"p must be [N+1, V] = [{tree.num_nodes + 1}, V], got {tuple(p.shape)}")
    if tree.mode != "deterministic" and tree.q.shape[1] != p.shape[1]:
        raise ValueError(f"p has {p.shape[1]} tokens per row but q has {tree.q.shape[1]}")


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """A LongTensor of host-side indices on `device`. torch.tensor(values, device=cuda) is a
    blocking copy, which waits for everything queued (the target's forward) before the rule
    is even launched; from pinned memory the copy is queued like any other operation (the
    caching host allocator keeps the pinned buffer alive until the copy is done)."""
    index = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def tree_rules(p: torch.Tensor, tree: TokenTree) -> TreeRules:
    """All rows of the tree go through one batched :func:`node_rules`: the rows with children,
    widest first. A leaf keeps stop = p[row] (the bonus)."""
    check_rows(p, tree)
    n = tree.num_nodes
    by_row = tree.children_by_row()
    # the rows with children, widest first; sorted is stable, so ties stay in row order
    rows = sorted((r for r in range(n + 1) if by_row[r]), key=lambda r: -len(by_row[r]))
    ratios = p.new_zeros(n)
    overlap = p.new_zeros(n + 1)
    node_acceptance = p.new_zeros(n + 1)
    if not rows:
        return TreeRules(ratios=ratios, stop=p, overlap=overlap, node_acceptance=node_acceptance)
    widths = [len(by_row[r]) for r in rows]
    k_max = widths[0]
    padded = [by_row[r] + [0] * (k_max - len(by_row[r])) for r in rows]  # padding is never read
    slot = [0] * n  # node j's place in the flattened [M, K] results
    for m, r in enumerate(rows):
        for k, j in enumerate(by_row[r]):
            slot[j] = m * k_max + k
    # index_select rather than advanced indexing: the same values, a fraction of the fixed cost on a CPU
    device = p.device
    row_index = device_index(rows, device)
    flat_children = device_index([j for kids in padded for j in kids], device)
    children = tree.tokens.to(device).index_select(0, flat_children).view(len(rows), k_max)
    q = None
    if tree.mode != "deterministic":
        q = tree.q.to(device=device, dtype=p.dtype).index_select(0, row_index)
    rules = node_rules(p.index_select(0, row_index), q, children, widths, tree.mode)
    ratios = rules.ratios.reshape(-1).index_select(0, device_index(slot, device))
    stop = p.index_copy(0, row_index, rules.fallback)
    overlap = overlap.index_copy(0, row_index, rules.overlap)
    node_acceptance = node_acceptance.index_copy(0, row_index, 1 - (1 - rules.ratios).prod(-1))
    return TreeRules(ratios=ratios, stop=stop, overlap=overlap, node_acceptance=node_acceptance)


@dataclass
class TreeVerification(Verification):
    """The outcome of verifying one drafted tree.

    tokens: the accepted path's tokens, then one token of the target's own.
    accepted: the length of the accepted path (= len(path)).
    overlap: one entry per visited node that has children (the root first, then each
        accepted node down the path), sum_x min(p_row(x), q_1(x)) where q_1 is the law of
        that node's FIRST child (q_row itself for random children, the one-hot on the child
        for deterministic ones, where it is p_row(first child)). For a chain this is
        verify_step's overlap at the verified positions, the alpha of the statistics; its
        length is accepted + 1, or accepted when the walk ends at an accepted leaf.
    path: the accepted nodes, root's child first: their keys and values are the ones to keep
        in consecutive cache slots.
    node_acceptance: at the same visited nodes, the probability, given the drafted
        children, that one of them is accepted: 1 - prod_k (1 - ratio_k). The tree's own
        per-depth acceptance, larger than overlap when there are several children.
    """

    path: list[int]
    node_acceptance: list[float]


def verify_tree(
    p: torch.Tensor,
    tree: TokenTree,
    generator: torch.Generator,
    uniforms: torch.Tensor | None = None,
) -> Verdict:
    """Verify a drafted tree: walk from the root with multi-draft rejection sampling
    (module docstring), emitting the accepted path and one target token.

    p: [N+1, V] the target's distributions from one call: row 0 after the root, row j+1
    after node j's path (warped like the draft's, by speculative.sampling.warp).
    uniforms: r for every node, [N] in [0, 1); drawn from `generator` when None (tests pass
    zeros to see the strict comparison).

    Pure, like every verifier: every decision is known before any draw (:func:`node_rules`),
    so, as in verify_step, one uniform per node (each node is tried at most once) and one
    candidate target token per row (from stop[row]) are drawn up front, independently, and
    the Verdict's parts are the pass bits, candidates, node tokens and statistics: the loop
    copies them in its one read, and the walk (:func:`walk`) is a few list lookups on the
    host. The candidates not on the walk's stopping row are simply not used, which does not
    change the law of the one that is.
    """
    check_rows(p, tree)
    n = tree.num_nodes
    rules = tree_rules(p, tree)
    if uniforms is None:
        uniforms = torch.rand(n, generator=generator, dtype=p.dtype, device=p.device)
    elif uniforms.shape != (n,):
        raise ValueError(f"uniforms must be [N] = [{n}], got {tuple(uniforms.shape)}")
    accepted = passes(uniforms.to(p.device), rules.ratios)
    own = sample(rules.stop, generator)  # [N+1]
    parts = [accepted, own, tree.tokens.to(p.device), rules.overlap, rules.node_acceptance]
    return Verdict(parts, lambda *host: walk(tree, *host))


def walk(
    tree: TokenTree,
    flags: list[int],
    candidates: list[int],
    node_tokens: list[int],
    overlaps: list[float],
    acceptances: list[float],
) -> TreeVerification:
    """verify_tree on the host: from the root, follow the first child that passes; where none
    does (or at a leaf), emit that row's candidate."""
    by_row = tree.children_by_row()
    if tree.mode == "without_replacement":
        for kids in by_row:
            if len({node_tokens[c] for c in kids}) < len(kids):
                raise ValueError("a without_replacement tree has two siblings with the same token")
    row = 0  # the current node's row: 0 is the root
    path: list[int] = []
    overlap: list[float] = []
    node_acceptance: list[float] = []
    while by_row[row]:
        overlap.append(overlaps[row])
        node_acceptance.append(acceptances[row])
        chosen = next((c for c in by_row[row] if flags[c]), None)  # the first child that passes
        if chosen is None:
            break
        path.append(chosen)
        row = chosen + 1
    tokens = [node_tokens[c] for c in path] + [candidates[row]]
    return TreeVerification(
        tokens=tokens,
        accepted=len(path),
        overlap=overlap,
        path=path,
        node_acceptance=node_acceptance,
    )


def verify_tree_greedy(target_choice: torch.Tensor, tree: TokenTree) -> Verdict:
    """:func:`verify_tree` at temperature 0, where every p row is one-hot on the target's
    argmax, without building the distributions.

    target_choice: [N+1] the argmax of each row of p. With a one-hot p_cur a child is
    accepted iff it is the target's choice (ratio p_cur(x)/q(x) is then 1 for a child drawn
    from q, or p_cur(x) = 1 for a deterministic child, and 0 otherwise), and the residual
    after a wrong child is the same one-hot, so: follow the first child equal to the
    target's choice; where none is, emit the choice (at a leaf it is the bonus token).
    overlap is 1.0 where the first child is the choice, node_acceptance where any child is:
    verify_tree's values on one-hot p and q.
    """
    n = tree.num_nodes
    if target_choice.shape != (n + 1,):
        raise ValueError(
            f"target_choice must be [N+1] = [{n + 1}], got {tuple(target_choice.shape)}"
        )
    return Verdict(
        [tree.tokens.to(target_choice.device), target_choice],
        lambda *host: greedy_walk(tree, *host),
    )


def greedy_walk(tree: TokenTree, node_tokens: list[int], choice: list[int]) -> TreeVerification:
    """verify_tree_greedy on the host."""
    by_row = tree.children_by_row()
    row = 0  # the current node's row: 0 is the root
    path: list[int] = []
    overlap: list[float] = []
    node_acceptance: list[float] = []
    while by_row[row]:
        kids = by_row[row]
        overlap.append(float(node_tokens[kids[0]] == choice[row]))
        chosen = next((c for c in kids if node_tokens[c] == choice[row]), None)
        node_acceptance.append(float(chosen is not None))
        if chosen is None:
            break
        path.append(chosen)
        row = chosen + 1
    tokens = [node_tokens[c] for c in path] + [choice[row]]
    return TreeVerification(
        tokens=tokens,
        accepted=len(path),
        overlap=overlap,
        path=path,
        node_acceptance=node_acceptance,
    )
