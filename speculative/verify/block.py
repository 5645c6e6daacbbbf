"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro & Suresh, "Block Verification
Accelerates Speculative Decoding", ICLR 2025, Algorithm 2): the drafted block is judged as a whole.

It replaces lines 5-9 of Algorithm 1 (docs/algorithm.md) and nothing else: the draft still proposes
x_1..x_gamma with x_i ~ q_i, the target still scores them in one call, and the result is still the
accepted drafts x_1..x_tau followed by one token of the target's own. The rule, numbered as in
docs/trees_and_blocks.md (the docstrings below cite these numbers):

    B1  w_0 = 1;  w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i))            for i = 1..gamma
    B2  rho_i(x) = max(0, w_i p_{i+1}(x) - q_{i+1}(x)),  m_i = sum_x rho_i(x)   for i = 0..gamma-1
    B3  h_i = m_i / (m_i + 1 - w_i)  for 1 <= i < gamma,   h_gamma = w_gamma
    B4  eta_1..eta_gamma ~ U[0, 1)
    B5  tau = max({i : eta_i < h_i} U {0})        scan i = gamma, gamma-1, .., 1; keep x_1..x_i at the first pass
    B6  t ~ p_{gamma+1} if tau = gamma, else t ~ rho_tau / m_tau
    B7  return x_1..x_tau, t

Notation: p_i and q_i are this repository's (the target's and the draft's next-token distributions
after the prefix and x_1..x_{i-1}; the paper's M_b(. | c, X^{i-1}) and M_s(. | c, X^{i-1})). The
paper calls the weights w_i "p_i"; they are renamed here so as not to collide with p_i. h_i is the
paper's h_i^block and rho_tau / m_tau its p_res^block.

Why the output is exactly the target's, and why it never accepts fewer tokens in expectation
than token-wise verification (w_i >= prod_{j<=i} min(1, p_j(x_j)/q_j(x_j)), so the block survives
past every prefix at least as often): docs/trees_and_blocks.md, "Block verification".

At temperature 0 (one-hot p and q) w_i is 1 while x_i is the target's argmax and 0 from the first
mismatch on, m_i is 1 exactly when x_{i+1} is the first mismatch, so h_i is 1 there and 0 elsewhere:
tau is the number of leading matches whatever the eta_i are, and t is the target's argmax. That is
greedy token-wise verification (tests/speculative/verify/test_block.py checks it against verify_greedy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculative.sampling import sample
from speculative.verify.token import expected_acceptance
from speculative.verify.verdict import Verdict, Verification


def block_weights(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """w_0..w_gamma of line B1 (the paper's p_i): [gamma + 1], w_0 = 1.

    p: [gamma+1 (or gamma), V]; q: [gamma, V]; drafted: [gamma].

    The recursion w_i = min(1, w_{i-1} r_i) with r_i = p_i(x_i)/q_i(x_i) unrolls to
    w_i = min_{j <= i} r_{j+1} ... r_i, i.e. log w_i = S_i - max_{j <= i} S_j with S_i the running
    sum of log r. That is a cumsum and a cummax instead of a loop of gamma dependent steps, and
    sums of logs cannot underflow the way a running product of small ratios can in float32.
    A ratio of 0 (the target never emits x_i) makes log r = -inf, and w stays 0 from there on, as
    the recursion says. q_i(x_i) = 0 cannot happen for a token drawn from q_i; should a caller
    pass one, r is taken as the largest finite value (0 if p_i(x_i) = 0 too), the rule's limit.
    """
    gamma = drafted.shape[0]
    index = drafted.view(gamma, 1)
    p_x = p[:gamma].gather(-1, index).squeeze(-1)
    q_x = q.gather(-1, index).squeeze(-1)
    big = torch.finfo(p.dtype).max
    ratio = (p_x / q_x).nan_to_num(nan=0.0, posinf=big)
    # the running sum starts at S_0 = 0, so the running max is >= 0 and S - max is never inf - inf;
    # S - max <= 0 exactly, so every weight is <= 1 in floating point too
    running = F.pad(ratio.log(), (1, 0)).cumsum(0)
    return (running - running.cummax(0).values).exp()


def block_residuals(
    p: torch.Tensor, q: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Line B2 and the distributions of line B6: (m [gamma], fallback [gamma+1, V]).

    m_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)) for i = 0..gamma-1; fallback[i] is the
    distribution t is drawn from when tau = i: rho_i / m_i for i < gamma (the paper's
    p_res^block: p scaled by the weight of the accepted prefix before q is subtracted; with
    w_0 = 1 the first row is Algorithm 1's residual), and p_{gamma+1} for i = gamma (the bonus).
    Where m_i = 0, tau = i has probability 0 (P(tau = i, x^i) = q(x^i) m_i, and h_i = 0 below);
    p itself is returned there so that a floating-point accident still samples a valid token.
    """
    gamma = q.shape[0]
    excess = (weights[:gamma, None] * p[:gamma] - q).clamp(min=0)
    mass = excess.sum(-1)
    # the 0/0 where the mass is 0 is never selected
    residual = torch.where(mass[:, None] > 0, excess / mass[:, None], p[:gamma])
    return mass, torch.cat([residual, p[gamma : gamma + 1]])


def stop_probabilities(weights: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """h_1..h_gamma of line B3: [gamma].

    h_i = m_i / (m_i + 1 - w_i) is chosen so that P(tau = i | X^i, the scan reached i) makes
    P(tau = i, X^i = x^i) = q(x^i) m_i: the scan reaches i with probability 1 - (w_i - m_i). The
    denominator is 0 only when w_i = 1 and m_i = 0 (p_{i+1} = q_{i+1} after a fully accepted
    prefix); the scan then reaches i with probability 0 and h_i = 0 keeps it from stopping where
    the residual is empty. h_gamma = w_gamma: the whole block is kept with probability w_gamma.
    """
    gamma = mass.shape[0]
    if gamma == 0:  # nothing was drafted: there is no position to keep
        return mass
    # h_1..h_{gamma-1}; h_gamma is w_gamma
    inner_mass = mass[1:]
    inner_weight = weights[1:gamma]
    denominator = inner_mass + (1 - inner_weight)
    # m / (m + 1 - w) with w <= 1 rounds to at most 1; the 0/0 where both vanish is never selected
    inner = torch.where(denominator > 0, inner_mass / denominator, 0.0)
    return torch.cat([inner, weights[gamma:]])


@dataclass
class BlockOutcomes:
    """The exact law of one block verification, given the drafted block (for tests and analysis)."""

    stop: torch.Tensor  # [gamma]: h_1..h_gamma (line B3)
    accepted: torch.Tensor  # [gamma + 1]: P(tau = n | x_1..x_gamma) for n = 0..gamma
    fallback: torch.Tensor  # [gamma + 1, V]: t's distribution when tau = n (line B6)


def block_outcomes(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor) -> BlockOutcomes:
    """P(tau = n) and the distribution of t for each n, for a given drafted block (lines B1-B6).

    The backward scan of line B5 stops at n when every later position fails and position n passes:
    P(tau = n) = h_n prod_{j > n} (1 - h_j), with h_0 = 1 (tau = 0 when nothing passes). So the
    output is x_1..x_n, t with probability accepted[n] * fallback[n, t]; enumerating the drafted
    blocks with weight q(x^gamma) gives the exact distribution of an iteration. Pure: no sampling.
    """
    weights = block_weights(p, q, drafted)
    mass, fallback = block_residuals(p, q, weights)
    stop = stop_probabilities(weights, mass)
    one = torch.ones(1, dtype=p.dtype, device=p.device)
    # survive[n] = prod_{j > n} (1 - h_j): a cumulative product taken from the end of the block
    survive = torch.cat([(1 - stop).flip(0).cumprod(0).flip(0), one])
    return BlockOutcomes(stop=stop, accepted=torch.cat([one, stop]) * survive, fallback=fallback)


def verify_block(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator: torch.Generator
) -> Verdict:
    """Block verification of one iteration (lines B1-B7), a drop-in for speculative.verify.verify_step.

    p: [gamma+1, V] target distributions p_1..p_{gamma+1} (one target call);
    q: [gamma, V] draft distributions q_1..q_gamma; drafted: [gamma] tokens x_i ~ q_i.
    Its outcome: the accepted x_1..x_tau and t, tau, and the overlaps sum_x min(p_i, q_i) of
    every drafted position (the statistics' alpha, the same numbers as verify_step reports).

    Line B4 draws eta in [0, 1) and line B5 keeps position i iff eta_i < h_i: P(eta < h) = h, and
    where h_i = 0 (e.g. p_i(x_i) = 0 makes w_i = 0 and every h_j, j >= i, 0) nothing is kept even
    when eta_i is exactly 0. As in verify_step, t is drawn for every place it could be needed
    (the gamma+1 rows of fallback), independently of the eta_i, and the one at tau is kept, so
    the result is a Verdict: device tensors the loop reads in its one copy. gamma = 0 draws t from p_1.
    """
    gamma = drafted.shape[0]
    weights = block_weights(p, q, drafted)
    mass, fallback = block_residuals(p, q, weights)
    stop = stop_probabilities(weights, mass)
    eta = torch.rand(gamma, generator=generator, dtype=stop.dtype, device=stop.device)
    own = sample(fallback, generator)
    return Verdict([eta < stop, drafted, own, expected_acceptance(p[:gamma], q)], last_pass)


def last_pass(flags: list[int], xs: list[int], ys: list[int], overlap: list[float]) -> Verification:
    """Line B5 on the host: tau = the last position that passes (1-based: flags[i - 1] is
    position i; 0 when none does); emit x_1..x_tau and the candidate at tau."""
    tau = max((i for i in range(1, len(flags) + 1) if flags[i - 1]), default=0)
    return Verification(tokens=xs[:tau] + [ys[tau]], accepted=tau, overlap=overlap)
