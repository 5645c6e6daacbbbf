"""The engine: speculative decoding of many rows at once, each joining and leaving on its own.

Its entry point is :class:`Engine` (engine.py), whose ``step`` names the seams: propose,
score, verify, commit. Beside it: the statistics of a run (stats.py), the cost model's
formulas (cost.py), the engine's gamma policies (gamma.py; a server's, by the load, is
speculative.serving.policy), and the four generation functions over the engine (generation.py).
"""

from speculative.engine.cost import best_gamma, expected_speedup, expected_tokens_per_iteration
from speculative.engine.engine import DEFAULT_GAMMA, Engine, Row
from speculative.engine.gamma import AutoGamma
from speculative.engine.generation import (
    autoregressive_generate,
    autoregressive_generate_batch,
    speculative_generate,
    speculative_generate_batch,
)
from speculative.engine.stats import (
    AutoregressiveStats,
    BatchResult,
    BatchStats,
    GenerationResult,
    SpeculativeStats,
)

__all__ = [
    "DEFAULT_GAMMA",
    "AutoGamma",
    "AutoregressiveStats",
    "BatchResult",
    "BatchStats",
    "Engine",
    "GenerationResult",
    "Row",
    "SpeculativeStats",
    "autoregressive_generate",
    "autoregressive_generate_batch",
    "best_gamma",
    "expected_speedup",
    "expected_tokens_per_iteration",
    "speculative_generate",
    "speculative_generate_batch",
]
