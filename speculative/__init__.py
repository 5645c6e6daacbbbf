"""Speculative decoding (Leviathan, Kalman & Matias 2023, Algorithm 1), one concept per module.

* :mod:`speculative.sampling`: logits -> probabilities (temperature, top-k, top-p), sampling.
* :mod:`speculative.verify`: the acceptance test, the residual distribution, one verification step.
* :mod:`speculative.speculative`: the loop (:func:`speculative_generate`).
* :mod:`speculative.autoregressive`: the baseline (:func:`autoregressive_generate`).
* :mod:`speculative.stats`: what a call measured; :mod:`speculative.gamma`: the cost model and gamma="auto".
* :mod:`speculative.pair`: can two models speculate together (:func:`check_pair`).
* :mod:`speculative.distill`: divergences for distilling a draft toward its target.
"""

from speculative.autoregressive import autoregressive_generate
from speculative.gamma import AutoGamma, best_gamma, expected_speedup, expected_tokens_per_iteration
from speculative.pair import PairMismatchError, check_pair
from speculative.sampling import Sampling, sample, warp
from speculative.speculative import draft_tokens, speculative_generate
from speculative.stats import AutoregressiveStats, GenerationResult, SpeculativeStats
from speculative.verify import (
    Verification,
    acceptance_probability,
    expected_acceptance,
    residual_distribution,
    verify_step,
)

__all__ = [
    "AutoGamma", "AutoregressiveStats", "GenerationResult", "PairMismatchError", "Sampling", "SpeculativeStats",
    "Verification", "acceptance_probability", "autoregressive_generate", "best_gamma", "check_pair", "draft_tokens",
    "expected_acceptance", "expected_speedup", "expected_tokens_per_iteration", "residual_distribution", "sample",
    "speculative_generate", "verify_step", "warp",
]
