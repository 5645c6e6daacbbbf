"""Verification: the heart of Algorithm 1 (lines 5-9 in docs/algorithm.md), as small pure functions.

Notation of the paper: p_i is the target's next-token distribution after the prefix and
the first i-1 drafted tokens, q_i the draft's, and x_i ~ q_i the i-th drafted token.

* :func:`acceptance_probability` -- lines 5-6: x_i is kept when r_i <= p_i(x_i) / q_i(x_i),
  which happens with probability min(1, p_i(x_i) / q_i(x_i)).
* :func:`residual_distribution` -- line 8: at the first rejection the target's own token is
  drawn from norm(max(0, p_i - q_i)).
* :func:`expected_acceptance` -- the paper's beta: sum_x min(p_i(x), q_i(x)), the probability
  that position i is accepted before x_i is drawn (section 3.1). Its mean is alpha.
* :func:`verify_step` -- lines 5-9 over the gamma drafted tokens of one iteration, including
  the bonus token from p_{gamma+1} when all of them are accepted (line 7).

Why this gives exactly p (docs/algorithm.md has the full proof): a token x is emitted at
position i either because it was drafted and kept, probability q(x) min(1, p(x)/q(x)) =
min(p(x), q(x)), or because a rejection happened, probability 1 - sum_y min(p(y), q(y)),
and then the residual picked it, probability (p(x) - min(p(x), q(x))) / (1 - sum_y min(p(y), q(y))).
The two add up to p(x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculative.sampling import sample


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, token: torch.Tensor | int) -> torch.Tensor:
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


@dataclass
class Verification:
    """The outcome of verifying one iteration's drafted tokens."""

    tokens: list[int]  # emitted: the accepted drafted tokens, then one token of the target's own
    accepted: int  # how many drafted tokens were accepted, 0..gamma
    overlap: list[float]  # expected_acceptance(p_i, q_i) for every drafted position i


def verify_step(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator: torch.Generator) -> Verification:
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
    kept: the same distribution, and the decisions and tokens reach the host in one copy (the
    per-position overlaps, for the statistics, in a second) instead of one sync per position.
    """
    gamma = drafted.shape[0]
    ratio = acceptance_probability(p[:gamma], q, drafted)
    r = torch.rand(gamma, generator=generator, dtype=ratio.dtype, device=ratio.device)
    accepted = r < ratio
    fallback = torch.cat([residual_distribution(p[:gamma], q), p[gamma:]])  # [gamma+1, V]
    own = sample(fallback, generator)
    host = torch.cat([accepted.long(), drafted, own]).tolist()
    flags, xs, ys = host[:gamma], host[gamma:2 * gamma], host[2 * gamma:]
    n = flags.index(0) if 0 in flags else gamma
    overlap = expected_acceptance(p[:gamma], q).tolist()
    return Verification(tokens=xs[:n] + [ys[n]], accepted=n, overlap=overlap)
