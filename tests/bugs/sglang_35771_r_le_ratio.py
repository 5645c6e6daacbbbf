"""SGLang #35771: a drafted token is kept when r <= p(x)/q(x) instead of r < p(x)/q(x).

torch.rand draws r from [0, 1), and r = 0 does happen (about once in 2^24 float32 draws). With
``<=`` a draft token that the target rules out (p(x) = 0, so the ratio is 0) is then kept, and the
output holds a token of target probability 0. Everywhere else the two comparisons agree, so the
law of the output is exact up to a set of probability 0: no exact enumeration and no chi-square
test can see it, only a draw of exactly 0 can.

    python -m speculative.prove tests/bugs/sglang_35771_r_le_ratio.py:verify    # fails: zero draw
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
    accepted = r <= ratio  # the bug: must be r < ratio
    fallback = torch.cat([residual_distribution(p[:gamma], q), p[gamma:]])
    return Verdict(
        [accepted, drafted, sample(fallback, generator), expected_acceptance(p[:gamma], q)],
        leading_passes,
    )
