"""The verify seam's pieces (lines 5-9 for every row of an iteration): each row judged by itself,
with its own p, q, sampling and random stream, by a pure verifier (token-wise, block, greedy or a
tree's walk: device tensors in, device tensors out), and the verdicts of all rows read together."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from speculative.draft.protocol import Draft
from speculative.inputs import usable_logits
from speculative.sampling import KeyedNoise, Sampling, sample_keyed, sample_rows, warp, warp_rows
from speculative.verify import tree as trees
from speculative.verify.registry import keyed
from speculative.verify.registry import rule as registered
from speculative.verify.token import verify_greedy
from speculative.verify.token_tree import TokenTree
from speculative.verify.verdict import Verdict, Verification, together


def judge_rows(
    logits: torch.Tensor,
    draft: Draft,
    samplings: list[Sampling],
    rule: str | Callable,
    generators: list[torch.Generator] | list[KeyedNoise],
    finite: torch.Tensor,
) -> Verdict:
    """Lines 5-9 for every row, each with its own p, q, sampling and generator; their verdicts are read
    together. ``logits``: every row's g_b + 1 rows, stacked; ``finite``: their finite_rows (a
    sampled row verifies usable logits until the read checks them). Where nothing was drafted
    t comes from p_1 alone, by the rule's noise keyed by position where it draws so (``generators``
    are then KeyedNoise); at temperature 0 the argmaxes of all rows and their drafts are the
    parts, whatever B is."""
    greedy = all(s.greedy for s in samplings)
    if draft.tree is None and not any(draft.lengths):
        if greedy:
            tokens = logits.argmax(-1)
        elif keyed(rule):  # [B]: row b's Gumbel-max token at its own next position
            probs = warp_rows(usable_logits(logits, finite), samplings)
            tokens = torch.cat([sample_keyed(row[None], g) for row, g in zip(probs, generators)])
        else:
            tokens = sample_rows(warp_rows(usable_logits(logits, finite), samplings), generators)
        return Verdict([tokens], lambda host: [Verification([t], 0, []) for t in host])
    if greedy and draft.tree is None and greedy_shortcut(rule):
        return verify_greedy(logits.argmax(-1), draft.tokens, draft.lengths)
    verdicts, ok = [], finite.split([g + 1 for g in draft.lengths])
    for b, (p, generator) in enumerate(
        zip(logits.split([g + 1 for g in draft.lengths]), generators)
    ):
        g = draft.lengths[b]
        q = None if draft.q is None else draft.q[b, :g]
        verdicts.append(
            judge(p, draft.tokens[b, :g], q, draft.tree, samplings[b], rule, generator, ok[b])
        )
    return together(verdicts)


def judge(
    logits: torch.Tensor,
    drafted: torch.Tensor,
    q: torch.Tensor | None,
    tree: TokenTree | None,
    sampling: Sampling,
    rule: str | Callable,
    generator: torch.Generator,
    finite: torch.Tensor | None = None,
) -> Verdict:
    """Lines 5-9 for one row by the verifier that fits its draft: a tree's walk, the comparison
    of argmaxes at temperature 0 (where the rule is registered so), or the chosen rule (a
    registered name, or a verifier of their signature, which also judges at temperature 0) on warped p and q. A
    deterministic drafter's q (None) is one-hot on its tokens. A sampled verification runs on
    usable_logits until the read checks ``finite``, so that no sampling kernel meets a NaN."""
    if finite is not None and not sampling.greedy:
        logits = usable_logits(logits, finite)
    if tree is not None:
        if sampling.greedy:
            return trees.verify_tree_greedy(logits.argmax(-1), tree)
        return trees.verify_tree(warp(logits, sampling), tree, generator)
    if sampling.greedy and greedy_shortcut(rule):  # one-hot p and q: the argmaxes compared
        return verify_greedy(logits.argmax(-1), drafted)
    p = warp(logits, sampling)  # g = 0: t from p_1 alone
    q = q if q is not None else F.one_hot(drafted, p.shape[-1]).to(p.dtype)
    verifier = rule if callable(rule) else registered(rule).verify
    return verifier(p, q, drafted, generator)


def greedy_shortcut(rule: str | Callable) -> bool:
    """Whether a rule is replaced by the comparison of argmaxes at temperature 0: as registered
    (speculative.verify.registry); a verifier passed as a function never is."""
    return not callable(rule) and registered(rule).greedy
