"""The residual taken against a one-hot q: at a rejection the target's token is drawn from
norm(max(0, p - e_x)) (e_x one-hot on the drafted token x) instead of norm(max(0, p - q)).

That is the residual of a deterministic drafter (prompt lookup, greedy drafting), wired into the
sampled path: it removes x and nothing else, so tokens where the draft already over-proposes keep
their full probability and come out too often. A wiring slip of the kind the mutation run of this
repository catalogues ("the residual against a one-hot q").

    python -m speculative.prove tests/bugs/residual_one_hot_q.py:verify    # fails: exact law, chi-square
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
    one_hot = F.one_hot(drafted, p.shape[-1]).to(p.dtype)
    # the bug: must be q
    fallback = torch.cat([residual_distribution(p[:gamma], one_hot), p[gamma:]])
    return Verdict(
        [accepted, drafted, sample(fallback, generator), expected_acceptance(p[:gamma], q)],
        leading_passes,
    )
