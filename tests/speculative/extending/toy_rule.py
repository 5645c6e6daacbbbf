"""A verification rule of one's own, in one file with its one registration (docs/layout.md).

Token-wise verification written with a product: x_i passes iff r_i q_i(x_i) < p_i(x_i), which is
r_i < p_i(x_i) / q_i(x_i) for the q_i(x_i) > 0 of a drafted token. Registered with greedy=False, so
it also judges one-hot p and q at temperature 0. ``broken_rule`` is a variant that is not exact
(it lets every token through a little too often): the checker must reject it.
"""

from __future__ import annotations

import torch

from speculative.sampling import sample
from speculative.verify import (
    Verdict,
    Verification,
    expected_acceptance,
    register_rule,
    residual_distribution,
)


def product_rule(
    p: torch.Tensor,
    q: torch.Tensor,
    drafted: torch.Tensor,
    generator: torch.Generator,
    slack: float = 0.0,
) -> Verdict:
    gamma = drafted.shape[0]
    rows = torch.arange(gamma, device=p.device)
    p_x, q_x = p[rows, drafted], q[rows, drafted]
    r = torch.rand(gamma, generator=generator, dtype=p.dtype, device=p.device)
    passed = r * q_x < p_x + slack
    own = sample(torch.cat([residual_distribution(p[:gamma], q), p[gamma:]]), generator)

    def finish(
        flags: list[bool], xs: list[int], ys: list[int], overlap: list[float]
    ) -> Verification:
        n = flags.index(False) if False in flags else gamma
        return Verification(xs[:n] + [ys[n]], n, overlap)

    return Verdict([passed, drafted, own, expected_acceptance(p[:gamma], q)], finish)


def broken_rule(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator: torch.Generator
) -> Verdict:
    return product_rule(p, q, drafted, generator, slack=0.05)


register_rule(
    "product", product_rule, "token-wise, as r q(x) < p(x) (an example of a rule of one's own)"
)
