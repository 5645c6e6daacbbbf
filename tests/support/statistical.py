"""The chi-square harness of the end-to-end proofs, and the broken variants of token-wise
verification that they must reject.

* :func:`window_distribution`: the exact joint law of output tokens skip .. skip+length-1 of
  plain sampling; :func:`sample_counts`: the counts of the same window over seeded runs;
  ``P_VALUE``, the threshold every chi-square proof uses.
* ``BUGS`` (must be rejected) and ``NOT_BUGS`` (look-alikes that must pass): variants injected
  by monkeypatching what the engine calls in speculative.verify.token (the acceptance
  probability, the residual, verify_step). Each takes the monkeypatch and a :class:`Setting`.

Used by tests/speculative/engine/test_generation_statistical.py (where the variants were first
written), the drafters' and the token trees' chi-square proofs.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import pytest
import torch

from speculative.sampling import Sampling
from speculative.verify import RULES
from tests.support.toy_models import sequence_distribution

verify = importlib.import_module("speculative.verify.token")

P_VALUE = 1e-3
real_acceptance = verify.acceptance_probability
real_residual = verify.residual_distribution
real_verify_step = verify.verify_step


# ----------------------------------------------------------------------------- variants
@dataclass
class Setting:
    """What a variant may need to know: the sampling settings and the draft's next-token
    distribution after a drafted block (for bonus-from-draft)."""

    sampling: Sampling
    draft_after: Callable[[torch.Tensor], torch.Tensor]


def set_verify_step(mp: pytest.MonkeyPatch, step: Callable) -> None:
    """verify_step replaced where the engine finds it, the rules' registry (speculative.verify.RULES),
    and in its module, for whatever calls it by name."""
    mp.setattr(verify, "verify_step", step)
    mp.setitem(RULES, "token", replace(RULES["token"], verify=step))


def inverted_ratio(mp: pytest.MonkeyPatch, setting: Setting) -> None:
    mp.setattr(verify, "acceptance_probability", lambda p, q, token: real_acceptance(q, p, token))


def residual_from_p(mp: pytest.MonkeyPatch, setting: Setting) -> None:
    mp.setattr(verify, "residual_distribution", lambda p, q: p)


def bonus_from_draft(mp: pytest.MonkeyPatch, setting: Setting) -> None:
    def step(p, q, drafted, generator):
        if len(drafted):
            p = p.clone()
            p[-1] = setting.draft_after(drafted)
        return real_verify_step(p, q, drafted, generator)

    set_verify_step(mp, step)


def temperature_on_p_only(mp: pytest.MonkeyPatch, setting: Setting) -> None:
    t = setting.sampling.temperature
    assert t not in (0, 1) and setting.sampling.top_k is None and setting.sampling.top_p is None

    def step(p, q, drafted, generator):
        raw = q**t  # softmax(l / t) ** t is proportional to softmax(l): the untempered q
        return real_verify_step(p, raw / raw.sum(-1, keepdim=True), drafted, generator)

    set_verify_step(mp, step)


def q_of_next_position(mp: pytest.MonkeyPatch, setting: Setting) -> None:
    set_verify_step(
        mp,
        lambda p, q, drafted, generator: real_verify_step(
            p, torch.cat([q[1:], q[-1:]]), drafted, generator
        ),
    )


def ratio_without_min(mp: pytest.MonkeyPatch, setting: Setting) -> None:
    def raw_ratio(p, q, token):
        token = torch.as_tensor(token).unsqueeze(-1)
        return p.gather(-1, token).squeeze(-1) / q.gather(-1, token).squeeze(-1)

    mp.setattr(verify, "acceptance_probability", raw_ratio)


def no_bonus_token(mp: pytest.MonkeyPatch, setting: Setting) -> None:
    def step(p, q, drafted, generator):
        verdict = real_verify_step(p, q, drafted, generator)

        def finish(*host):
            result = verdict.finish(*host)
            if len(drafted) and result.accepted == len(drafted):
                result.tokens = result.tokens[:-1]
            return result

        return verify.Verdict(verdict.parts, finish)

    set_verify_step(mp, step)


BUGS = {
    "inverted-ratio": inverted_ratio,
    "residual-from-p": residual_from_p,
    "bonus-from-draft": bonus_from_draft,
    "temperature-on-p-only": temperature_on_p_only,
    "q-of-next-position": q_of_next_position,
}
NOT_BUGS = {
    "correct": None,
    "ratio-without-min": ratio_without_min,
    "no-bonus-token": no_bonus_token,
    "gamma-auto": None,
    "guard-recorded": None,
}


# ----------------------------------------------------------------------------- harness
def window_distribution(
    next_probs: Callable[[tuple[int, ...]], Sequence[float]],
    prompt: Sequence[int],
    skip: int,
    length: int,
) -> dict[tuple[int, ...], float]:
    """Exact joint distribution of output tokens skip .. skip+length-1 of plain sampling."""
    out: dict[tuple[int, ...], float] = {}
    for seq, prob in sequence_distribution(next_probs, prompt, skip + length).items():
        out[seq[skip:]] = out.get(seq[skip:], 0.0) + prob
    return out


def sample_counts(
    generate: Callable[[int], list[int]], runs: int, skip: int, length: int
) -> Counter:
    return Counter(tuple(generate(seed)[skip : skip + length]) for seed in range(runs))
