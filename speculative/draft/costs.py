"""What an iteration costs, as a drafter that chooses its own draft length reads it.

The paper's cost model (speculative.engine.cost) assumes that each drafted token is kept with
one probability alpha and that verifying gamma + 1 tokens costs one target step. A drafter whose
chain has a length of its own (suffix decoding, a hybrid) knows more and assumes less: each prefix
of its chain comes with its own expected number of kept tokens, and each verification width with
its seconds measured on the machine (:class:`IterationCosts`, measured by
speculative.cli.pricing), so it verifies the prefix with the most expected tokens per second
(:func:`best_prefix`). A leaf module: the drafters read it, and the engine never needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class IterationCosts:
    """What an iteration costs on this machine and set-up, in seconds, measured once
    (speculative.cli.costs.iteration_costs) for a drafter whose draft length varies from one
    iteration to the next and who can choose it by cost (the ``priced`` hook of
    speculative.draft.protocol):

    * ``verify_s[g]``: an iteration that verifies g drafted tokens proposed at no cost (a target
      call of g + 1 tokens and the rest of the loop); ``verify_s[0]`` is a plain step. A compiled
      target pads a call to its next compiled width, so this is a staircase, not a line;
    * ``model_s``: an iteration in which a hybrid's model drafter drafts its own length and the
      target verifies it (None where there is no model drafter).
    """

    verify_s: tuple[float, ...]
    model_s: float | None = None

    def __post_init__(self) -> None:
        if not self.verify_s or any(not s > 0 for s in self.verify_s):
            raise ValueError(f"verify_s must be positive seconds, got {self.verify_s!r}")
        if self.model_s is not None and not self.model_s > 0:
            raise ValueError(f"model_s must be positive seconds, got {self.model_s!r}")

    def verify(self, drafted: int) -> float:
        """Seconds of an iteration verifying ``drafted`` tokens; past the measured ones, the last
        measured iteration's per-token cost carries on in a line."""
        last = len(self.verify_s) - 1
        if drafted <= last:
            return self.verify_s[drafted]
        per_token = (self.verify_s[last] - self.verify_s[0]) / last if last else 0.0
        return self.verify_s[last] + per_token * (drafted - last)


def best_prefix(kept: Sequence[float], costs: IterationCosts) -> tuple[int, float]:
    """The prefix of a drafted chain worth verifying, and its expected tokens per second.
    ``kept[k-1]``: the expected number of the chain's first k tokens that are accepted; an
    iteration emits those and one token of the target's own. Of the lengths 0 (a plain step)
    to len(kept), the one with the most expected tokens per second of its iteration; the
    shorter on ties."""
    best, rate = 0, 1.0 / costs.verify(0)
    for k, expected in enumerate(kept, start=1):
        candidate = (1.0 + expected) / costs.verify(k)
        if candidate > rate * (1 + 1e-9):
            best, rate = k, candidate
    return best, rate
