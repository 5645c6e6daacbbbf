"""Drafter-invariant verification (Daliri, Musco & Suresh, "Coupling without Communication and
Drafter-Invariant Speculative Decoding", arXiv 2408.07978): the target's token at every position
is its Gumbel-max sample, argmax_x (log p_i(x) + G(seed, position)(x)), with noise keyed by the
row's seed and the absolute position of the token in the sequence (speculative.sampling.KeyedNoise),
and a drafted token is kept exactly when it is that token.

It replaces lines 5-9 of Algorithm 1 (docs/algorithm.md):

    G1  y_i = argmax_x (log p_i(x) + G_{L+i-1}(x))         for i = 1..gamma+1, L the row's length
    G2  n = the leading i with x_i = y_i                    (the first mismatch stops the chain)
    G3  return x_1..x_n, y_{n+1}                            (y_{n+1} is the bonus when n = gamma)

Every emitted token is y at its position: x_i is emitted only when it equals y_i, and the token
after the accepted ones is y_{n+1} itself. So the output is the target's own Gumbel-max samples,
position after position, which the target alone computes from the same noise (the engine's plain
steps draw with the same KeyedNoise under this rule): for a seed, the same tokens whatever the
drafter, gamma or batch. Its law is the target's because each G_j is drawn afresh for its position
and a Gumbel-max sample of p has law p. Why, at length: docs/algorithm.md, "A seed that repeats
whatever the drafter".

A drafter that proposes without this noise (any drafter of this repository) has x_i accepted with
probability sum_x q_i(x) p_i(x); one that drafts argmax (log q_i + G) with the same noise would
meet y_i with probability at least (1 - TV) / (1 + TV) (the paper's bound). At temperature 0 p is
one-hot and y_i the argmax: the rule is registered with ``greedy=True``, the comparison of argmaxes.
"""

from __future__ import annotations

import torch

from speculative.sampling import KeyedNoise, sample_keyed
from speculative.verify.token import expected_acceptance
from speculative.verify.verdict import Verdict, Verification


def verify_invariant(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, noise: KeyedNoise | torch.Generator
) -> Verdict:
    """Lines G1-G3 for one iteration. p: [gamma+1, V] target distributions p_1..p_{gamma+1};
    q: [gamma, V] (used for the statistics' overlap only: the rule never reads q);
    drafted: [gamma] x_1..x_gamma; ``noise``: the row's KeyedNoise, whose ``start`` is the position
    of p_1's token (the engine passes it, see :attr:`keyed`), or a plain generator (the same law,
    not the invariance: python -m speculative.prove's four-argument call).

    y_1..y_{gamma+1} are all computed (one Gumbel-max over gamma+1 rows) and the host keeps the
    ones up to the first mismatch: the same tokens as computing them one by one, and the verdict is
    read in the loop's one copy. gamma = 0 emits y_1: the target alone's token."""
    gamma = drafted.shape[0]
    own = sample_keyed(p, noise)  # [gamma+1]: y_i, the target's own token at each position
    return Verdict([drafted, own, expected_acceptance(p[:gamma], q)], first_mismatch)


# The engine hands this rule a KeyedNoise in the generator's place, and samples the plain steps of its
# rows with the same noise (speculative.verify.registry.keyed).
verify_invariant.keyed = True


def first_mismatch(xs: list[int], ys: list[int], overlap: list[float]) -> Verification:
    """Line G2 on the host: keep x_i while it equals y_i, then emit y at the first mismatch (or
    the bonus y_{gamma+1}). ys is read only up to that place: the positions after it are never
    looked at, as they do not change the outcome."""
    n = 0
    while n < len(xs) and xs[n] == ys[n]:
        n += 1
    return Verification(tokens=list(xs[:n]) + [ys[n]], accepted=n, overlap=overlap)
