"""Speculative decoding (Leviathan, Kalman & Matias 2023, Algorithm 1), one concept per module.

* :mod:`speculative.sampling`: logits -> probabilities (temperature, top-k, top-p), sampling.
* :mod:`speculative.verify`: the acceptance test, the residual distribution, one verification step.
* :mod:`speculative.drafter`: what proposes tokens (:class:`Drafter`), and a small model as one (:class:`ModelDrafter`).
* :mod:`speculative.lookup`: prompt lookup (:class:`PromptLookupDrafter`); :mod:`speculative.eagle`: a head
  that drafts from the target's features (:class:`FeatureDrafter`).
* :mod:`speculative.calls`: how the loops place tokens in a model's KV cache: a chain, ragged rows, a tree.
* :mod:`speculative.speculative`: the loop (:func:`speculative_generate`).
* :mod:`speculative.reference`: Algorithm 1 alone, for reading (:func:`speculative_decode`).
* :mod:`speculative.autoregressive`: the baseline (:func:`autoregressive_generate`).
* :mod:`speculative.batch`: many prompts at once, each row accepting its own count
  (:func:`speculative_generate_batch`, :func:`autoregressive_generate_batch`).
* :mod:`speculative.stats`: what a call measured; :mod:`speculative.gamma`: the cost model and gamma="auto".
* :mod:`speculative.pair`: can two models speculate together (:func:`check_pair`).
* :mod:`speculative.distill`: divergences for distilling a draft toward its target.
"""

from speculative.autoregressive import autoregressive_generate
from speculative.batch import BatchResult, BatchStats, autoregressive_generate_batch, speculative_generate_batch
from speculative.drafter import Draft, Drafter, ModelDrafter, RowDrafter, as_drafter, draft_tokens
from speculative.eagle import FeatureDrafter
from speculative.gamma import AutoGamma, best_gamma, expected_speedup, expected_tokens_per_iteration
from speculative.inputs import NonFiniteLogitsError
from speculative.lookup import PromptLookupDrafter
from speculative.pair import PairMismatchError, check_pair
from speculative.reference import speculative_decode
from speculative.sampling import Sampling, sample, warp
from speculative.speculative import speculative_generate
from speculative.stats import AutoregressiveStats, GenerationResult, SpeculativeStats
from speculative.verify import (
    Verification,
    acceptance_probability,
    expected_acceptance,
    residual_distribution,
    verify_step,
)

__all__ = [
    "AutoGamma", "AutoregressiveStats", "BatchResult", "BatchStats", "Draft", "Drafter", "FeatureDrafter",
    "GenerationResult", "ModelDrafter",
    "NonFiniteLogitsError", "PairMismatchError", "PromptLookupDrafter", "Sampling", "SpeculativeStats",
    "RowDrafter", "Verification", "acceptance_probability", "as_drafter", "autoregressive_generate",
    "autoregressive_generate_batch", "best_gamma", "check_pair",
    "draft_tokens", "expected_acceptance", "expected_speedup", "expected_tokens_per_iteration", "speculative_decode",
    "residual_distribution", "sample", "speculative_generate", "speculative_generate_batch", "verify_step", "warp",
]
