"""Verification: the heart of Algorithm 1 (lines 5-9 in docs/algorithm.md), as small pure functions.

Notation of the paper: p_i is the target's next-token distribution after the prefix and
the first i-1 drafted tokens, q_i the draft's, and x_i ~ q_i the i-th drafted token.

* :func:`acceptance_probability` -- lines 5-6: x_i is kept when r_i < p_i(x_i) / q_i(x_i),
  which happens with probability min(1, p_i(x_i) / q_i(x_i)).
* :func:`residual_distribution` -- line 8: at the first rejection the target's own token is
  drawn from norm(max(0, p_i - q_i)).
* :func:`expected_acceptance` -- the paper's beta: sum_x min(p_i(x), q_i(x)), the probability
  that position i is accepted before x_i is drawn (section 3.1). Its mean is alpha.
* :func:`verify_step` -- lines 5-9 over the gamma drafted tokens of one iteration, including
  the bonus token from p_{gamma+1} when all of them are accepted (line 7). Like every
  verifier, it returns a :class:`Verdict`: device tensors, read by the loop in its one copy.
* :func:`verify_greedy` -- the same lines at temperature 0, where p and q are one-hot: what
  verify_step computes then, with a handful of operators instead of a few dozen.

Why this gives exactly p: docs/algorithm.md.
"""

from __future__ import annotations

import torch

from speculative.sampling import sample
from speculative.verify.verdict import Verdict, Verification


def acceptance_probability(
    p: torch.Tensor, q: torch.Tensor, token: torch.Tensor | int
) -> torch.Tensor:
    """min(1, p(x) / q(x)) for the drafted token x (Algorithm 1, lines 5-6).

    p, q: [..., V]; token: an int, or a LongTensor shaped like p without its last dim.
    Where q(x) = 0 the draft can never propose x; the value 1 is returned there so that
    q(x) * acceptance_probability(...) is 0 and not NaN.
    """
    token = torch.as_tensor(token, device=p.device).unsqueeze(-1)
    p_x = p.gather(-1, token).squeeze(-1)
    q_x = q.gather(-1, token).squeeze(-1)
    return torch.where(q_x > 0, p_x / q_x, torch.ones_like(p_x)).clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim (Algorithm 1, line 8).

    A rejection can only happen where p - q has positive mass. In floating point a
    rejection can still meet p == q (mass exactly 0); p itself is returned then.
    """
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass, p)


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) = 1 - TV(p, q): the probability that a token drawn from q is
    accepted (the paper's beta, whose expectation is alpha)."""
    return torch.minimum(p, q).sum(-1)


def verify_step(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator: torch.Generator
) -> Verdict:
    """Algorithm 1, lines 5-9, for one iteration.

    p: [gamma+1, V] target distributions p_1..p_{gamma+1} (one target call);
    q: [gamma, V] draft distributions q_1..q_gamma; drafted: [gamma] tokens x_i ~ q_i.

    Line 5: r_i ~ U[0, 1). Line 6: x_i passes iff r_i < p_i(x_i)/q_i(x_i), and n is the number
    of leading passes. torch.rand can return exactly 0, so the comparison is strict:
    P(r < a) = a for a in [0, 1], and a token with p_i(x_i) = 0 is never accepted (the
    paper's r ~ U(0, 1) with "reject if r > p/q" is the same thing).
    Lines 7-9: the target's own token t comes from norm(max(0, p_{n+1} - q_{n+1})) if n < gamma,
    or from p_{gamma+1} if all were accepted (the bonus token).

    Instead of first learning n and then sampling, the target's token is drawn for each of
    the gamma+1 places it could be needed, independently of the r_i, and the one at n is
    kept: the same distribution, and nothing needs the host until the loop reads the
    decisions, candidate tokens and per-position overlaps (for the statistics) in its one copy.
    """
    gamma = drafted.shape[0]
    ratio = acceptance_probability(p[:gamma], q, drafted)
    r = torch.rand(gamma, generator=generator, dtype=ratio.dtype, device=ratio.device)
    accepted = r < ratio
    fallback = torch.cat([residual_distribution(p[:gamma], q), p[gamma:]])  # [gamma+1, V]
    own = sample(fallback, generator)
    return Verdict([accepted, drafted, own, expected_acceptance(p[:gamma], q)], leading_passes)


def leading_passes(
    flags: list[int], xs: list[int], ys: list[int], overlap: list[float]
) -> Verification:
    """Line 6 on the host: n = the leading passes; emit x_1..x_n and the candidate at n."""
    n = flags.index(0) if 0 in flags else len(flags)
    return Verification(tokens=xs[:n] + [ys[n]], accepted=n, overlap=overlap)


def verify_greedy(
    target_choice: torch.Tensor, drafted: torch.Tensor, lengths: list[int] | None = None
) -> Verdict:
    """Algorithm 1, lines 5-9, at temperature 0: the result of :func:`verify_step` when every
    p_i and q_i is one-hot, without building them.

    target_choice: [gamma+1] the argmax of p_1..p_{gamma+1}; drafted: [gamma] x_1..x_gamma
    (the draft's argmaxes). With one-hot distributions p_i(x_i)/q_i(x_i) is 1 when x_i is the
    target's choice and 0 otherwise, so x_i is kept exactly when it equals it (lines 5-6,
    whatever r_i is); the residual norm(max(0, p_i - q_i)) at the first mismatch is one-hot
    on the target's choice (line 8), and so is the bonus p_{gamma+1} (line 7); the overlap
    sum_x min(p_i(x), q_i(x)) is 1 on a match and 0 otherwise. The greedy tests compare the
    loop's output with the target's own greedy decoding, and tests/speculative/verify/test_token.py compares
    this function with verify_step on one-hot inputs.

    Why a separate function: a verification of a small target is a few milliseconds, and
    verify_step's warping, ratios, residuals and sampling are some thirty operators whose
    fixed costs are pure overhead when the answer is a comparison
    (made on the host, after the copy).

    Many rows at once: ``drafted`` [B, width] holds row b's x_1..x_{g_b} first (g_b =
    lengths[b]) and ``target_choice`` every row's g_b + 1 argmaxes, stacked; the outcome is
    the list of the rows' Verifications, from one copy whatever B is.
    """
    if lengths is None:
        return Verdict([drafted.to(target_choice.device), target_choice], greedy_outcome)
    width = drafted.shape[1]

    def finish(xs: list[int], ys: list[int]) -> list[Verification]:
        out = []
        at = 0  # where row b's choices start in ys
        for b, g in enumerate(lengths):
            out.append(greedy_outcome(xs[b * width : b * width + g], ys[at : at + g + 1]))
            at += g + 1
        return out

    return Verdict([drafted.flatten().to(target_choice.device), target_choice], finish)


def greedy_outcome(xs: list[int], ys: list[int]) -> Verification:
    """verify_greedy on the host: drafted tokens xs [gamma] against the target's choices ys
    [gamma+1]; keep the matching prefix, then the target's choice at the first mismatch."""
    gamma = len(xs)
    matches = [x == y for x, y in zip(xs, ys)]
    n = matches.index(False) if False in matches else gamma
    return Verification(tokens=xs[:n] + [ys[n]], accepted=n, overlap=[float(m) for m in matches])
