"""xLLM #2175: at a rejection the residual subtracts q only at the drafted token,
norm(max(0, p - q(x) e_x)), instead of norm(max(0, p - q)).

Algorithm 1's residual must remove from p everything the draft could have proposed and had
accepted, min(p(y), q(y)) for every token y, not only for the token it happened to propose. With
q(x) e_x the tokens that were not drafted keep their full probability, and the output over-weights
them. (xLLM's tree sampler made the same slip between siblings; this is the chain form.)

    python -m speculative.prove tests/bugs/xllm_2175_residual_at_drafted_token.py:verify    # fails: exact law
"""

import torch
import torch.nn.functional as F

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
    # the bug: q(x) e_x, must be all of q
    at_token = q * F.one_hot(drafted, p.shape[-1]).to(q.dtype)
    fallback = torch.cat([residual_distribution(p[:gamma], at_token), p[gamma:]])
    return Verdict(
        [accepted, drafted, sample(fallback, generator), expected_acceptance(p[:gamma], q)],
        leading_passes,
    )
