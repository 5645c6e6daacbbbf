"""Speculative decoding (Leviathan, Kalman & Matias 2023, Algorithm 1) and its exact refinements.

Read first: :mod:`speculative.reference` (Algorithm 1 alone, :func:`speculative_decode`) and
:mod:`speculative.sampling` (logits -> probabilities, sampling). Then one subpackage per role:

* :mod:`speculative.verify`: the verification rules (token, block, tree) and what a rule returns;
* :mod:`speculative.draft`: the drafter protocol and each drafter (a draft model, prompt lookup,
  a feature head), registered by name;
* :mod:`speculative.engine`: the production engine over rows (:class:`Engine`: propose, score,
  verify, commit), its statistics, every gamma policy and the four generation functions;
* :mod:`speculative.serving`: the engine behind an HTTP API (the loop, and the app);
* :mod:`speculative.proofs`: ``python -m speculative.prove``, the checker of a rule or drafter;
* :mod:`speculative.cli`: what generate.py and serve.py share of the command line.

:mod:`speculative.inputs` checks arguments before any model runs. This module exports the
public API and nothing else.
"""

from speculative.draft import (
    Draft,
    Drafter,
    FeatureDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    as_drafter,
)
from speculative.engine import (
    AutoGamma,
    AutoregressiveStats,
    BatchResult,
    BatchStats,
    Engine,
    GenerationResult,
    SpeculativeStats,
    autoregressive_generate,
    autoregressive_generate_batch,
    best_gamma,
    expected_speedup,
    expected_tokens_per_iteration,
    speculative_generate,
    speculative_generate_batch,
)
from speculative.inputs import NonFiniteLogitsError, PairMismatchError, check_pair
from speculative.reference import speculative_decode
from speculative.sampling import Sampling, sample, warp
from speculative.verify import (
    Verification,
    acceptance_probability,
    expected_acceptance,
    residual_distribution,
    verify_step,
)

__all__ = [
    "AutoGamma",
    "AutoregressiveStats",
    "BatchResult",
    "BatchStats",
    "Draft",
    "Drafter",
    "Engine",
    "FeatureDrafter",
    "GenerationResult",
    "ModelDrafter",
    "NonFiniteLogitsError",
    "PairMismatchError",
    "PromptLookupDrafter",
    "Sampling",
    "SpeculativeStats",
    "Verification",
    "acceptance_probability",
    "as_drafter",
    "autoregressive_generate",
    "autoregressive_generate_batch",
    "best_gamma",
    "check_pair",
    "expected_acceptance",
    "expected_speedup",
    "expected_tokens_per_iteration",
    "residual_distribution",
    "sample",
    "speculative_decode",
    "speculative_generate",
    "speculative_generate_batch",
    "verify_step",
    "warp",
]
