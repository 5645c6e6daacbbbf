"""Speculative decoding (Leviathan, Kalman & Matias 2023, Algorithm 1), one concept per module.

* :mod:`speculative.reference`: Algorithm 1 alone, for reading (:func:`speculative_decode`).
* :mod:`speculative.engine`: the production engine over rows (:class:`Engine`), with its seams
  propose, score, verify and commit; :mod:`speculative.generation`: the four functions over it
  (:func:`speculative_generate`, :func:`autoregressive_generate` and their ``_batch`` forms).
* :mod:`speculative.sampling`: logits -> probabilities (temperature, top-k, top-p), sampling.
* :mod:`speculative.verify`: the acceptance test, the residual distribution, one verification step;
  :mod:`speculative.block`: block verification; :mod:`speculative.tree`: token-tree verification.
* :mod:`speculative.drafter`: what proposes tokens (:class:`Drafter`), and a small model as one (:class:`ModelDrafter`).
* :mod:`speculative.lookup`: prompt lookup (:class:`PromptLookupDrafter`); :mod:`speculative.eagle`: a head
  that drafts from the target's features (:class:`FeatureDrafter`); :mod:`speculative.tree_drafting`: growing trees.
* :mod:`speculative.calls`: how the engine places tokens in a model's KV cache: a chain, ragged rows, a tree.
* :mod:`speculative.stats`: what a call measured; :mod:`speculative.gamma`: the cost model and gamma="auto".
* :mod:`speculative.pair`: can two models speculate together (:func:`check_pair`).
* :mod:`speculative.report`: the summaries and the JSON form of results (generate.py's output).
* :mod:`speculative.distill`: distilling a draft toward its target (DistillSpec's divergences, on-policy
  sequences) and EAGLE's losses.
* :mod:`speculative.prove`: ``python -m speculative.prove MODULE:OBJECT``, is a verifier or drafter exact
  (:func:`speculative.prove.check`); :mod:`speculative.exact`: exact laws, the code run once per branch of
  its randomness; :mod:`speculative.toys`: the toy models and independent references of the proofs.
"""

from speculative.drafter import Draft, Drafter, ModelDrafter, as_drafter
from speculative.eagle import FeatureDrafter
from speculative.engine import Engine
from speculative.gamma import AutoGamma, best_gamma, expected_speedup, expected_tokens_per_iteration
from speculative.generation import (
    autoregressive_generate,
    autoregressive_generate_batch,
    speculative_generate,
    speculative_generate_batch,
)
from speculative.inputs import NonFiniteLogitsError
from speculative.lookup import PromptLookupDrafter
from speculative.pair import PairMismatchError, check_pair
from speculative.reference import speculative_decode
from speculative.sampling import Sampling, sample, warp
from speculative.stats import AutoregressiveStats, BatchResult, BatchStats, GenerationResult, SpeculativeStats
from speculative.verify import (
    Verification,
    acceptance_probability,
    expected_acceptance,
    residual_distribution,
    verify_step,
)

__all__ = [
    "AutoGamma", "AutoregressiveStats", "BatchResult", "BatchStats", "Draft", "Drafter", "Engine", "FeatureDrafter",
    "GenerationResult", "ModelDrafter", "NonFiniteLogitsError", "PairMismatchError", "PromptLookupDrafter",
    "Sampling", "SpeculativeStats", "Verification", "acceptance_probability", "as_drafter", "autoregressive_generate",
    "autoregressive_generate_batch", "best_gamma", "check_pair", "expected_acceptance", "expected_speedup",
    "expected_tokens_per_iteration", "residual_distribution", "sample", "speculative_decode", "speculative_generate",
    "speculative_generate_batch", "verify_step", "warp",
]
