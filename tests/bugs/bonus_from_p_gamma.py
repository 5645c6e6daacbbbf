"""The bonus token drawn from p_gamma instead of p_{gamma+1}: an off-by-one in the row of p used
when every drafted token was accepted.

p has gamma + 1 rows: p_i is the target's distribution after the prefix and x_1..x_{i-1}. When
x_1..x_gamma are all kept, the next token must come from p_{gamma+1} (line 7 of Algorithm 1),
the distribution after all of them; p_gamma is the distribution of the position x_gamma already
fills, so the bonus token repeats a position's law one place too late.

    python -m speculative.prove tests/bugs/bonus_from_p_gamma.py:verify    # fails: exact law, chi-square
"""

import torch

from speculative.sampling import sample
from speculative.verify.token import (
    acceptance_probability,
    expected_acceptance,
    leading_passes,
    residual_distribution,
)
from speculative.verify.verdict import Verdict


def verify(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator: torch.Generator
) -> Verdict:
    gamma = drafted.shape[0]
    ratio = acceptance_probability(p[:gamma], q, drafted)
    r = torch.rand(gamma, generator=generator, dtype=ratio.dtype, device=ratio.device)
    accepted = r < ratio
    bonus = p[
        max(gamma - 1, 0) : max(gamma - 1, 0) + 1
    ]  # the bug: must be p[gamma:], the row p_{gamma+1}
    fallback = torch.cat([residual_distribution(p[:gamma], q), bonus])
    return Verdict(
        [accepted, drafted, sample(fallback, generator), expected_acceptance(p[:gamma], q)],
        leading_passes,
    )
