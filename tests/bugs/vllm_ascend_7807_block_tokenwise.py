"""vllm-ascend #7807: "block verification" that is token-wise verification -- NOT an exactness bug.

The block verifier (Sun et al. 2025, speculative.verify.block) keeps a drafted block with weights
w_i = min(1, w_{i-1} p_i(x_i)/q_i(x_i)), which never accept fewer tokens in expectation than
Algorithm 1's token-by-token test. vllm-ascend's "block verification" applied the token-wise
acceptance test and residual instead. That is Algorithm 1 itself: exact, only slower than what was
asked for. The checker proves exactness, so this rule PASSES it; the loss shows only in the
expected number of accepted tokens (tests/speculative/verify/test_block.py measures it).

    python -m speculative.prove tests/bugs/vllm_ascend_7807_block_tokenwise.py:verify    # passes
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
    """Called where verify_block would be: the token-wise rule, position by position."""
    gamma = drafted.shape[0]
    ratio = acceptance_probability(p[:gamma], q, drafted)
    eta = torch.rand(gamma, generator=generator, dtype=ratio.dtype, device=ratio.device)
    # w_i would be min(1, w_{i-1} * ratio_i); the token-wise test keeps each on its own
    kept = eta < ratio
    fallback = torch.cat([residual_distribution(p[:gamma], q), p[gamma:]])
    return Verdict(
        [kept, drafted, sample(fallback, generator), expected_acceptance(p[:gamma], q)],
        leading_passes,
    )
