"""What a generation call measured, and the result object both generators return.

Two acceptance numbers are reported, on purpose:

* ``acceptance_rate`` is the paper's alpha (section 3.1): the expected acceptance
  E[min(1, p(x)/q(x))], x ~ q, which equals E[sum_x min(p(x), q(x))] = 1 - E[TV(p, q)].
  It is estimated without sampling noise from the exact acceptance probability
  sum_x min(p_i(x), q_i(x)) of every verified draft position, averaged. This is the alpha
  of the cost model.
* ``empirical_acceptance`` is accepted_draft_tokens / drafted_tokens: what happened in
  this run. It is lower than alpha because positions after a rejection are drafted but
  never verified (and it is noisy).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

import torch

from speculative.gamma import expected_speedup, expected_tokens_per_iteration


def clock(device: torch.device) -> float:
    """perf_counter after waiting for the device, so that GPU work is timed, not queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class SpeculativeStats:
    """Counters and timings of one speculative_generate call (see the module docstring)."""

    gamma_setting: int | str  # what was asked for: an int, or "auto"
    target_calls: int = 0  # target forwards = iterations (the prompt rides along with the first)
    draft_calls: int = 0  # draft forwards, one per drafted token
    new_tokens: int = 0
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0  # as verified: accepted tokens cut off after an EOS still count
    # [i]: how often draft position i+1 was accepted / was verified (all earlier ones accepted)
    accepted_per_position: list[int] = field(default_factory=list)
    tried_per_position: list[int] = field(default_factory=list)
    gamma_history: list[int] = field(default_factory=list)  # drafted tokens per iteration
    overlap_sum: float = 0.0  # sum over verified positions of sum_x min(p, q)
    draft_time_s: float = 0.0  # wall time drafting (draft forwards, warping, sampling)
    target_time_s: float = 0.0  # wall time in target forwards (verification is loop work)
    decode_time_s: float = 0.0  # wall time of the generation loop
    # The first iteration also reads the prompt; decode speed leaves it out.
    first_iteration_s: float = 0.0
    first_iteration_tokens: int = 0
    wall_time_s: float = 0.0  # the whole call, cache allocation included

    def record(self, gamma: int, accepted: int, overlaps: list[float]) -> None:
        """Count one iteration that drafted `gamma` tokens and accepted `accepted` of them."""
        self.target_calls += 1
        self.draft_calls += gamma
        self.drafted_tokens += gamma
        self.accepted_draft_tokens += accepted
        self.gamma_history.append(gamma)
        verified = min(accepted + 1, gamma)
        for i in range(verified):
            self.tried_per_position[i] += 1
            self.overlap_sum += overlaps[i]
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def verified_positions(self) -> int:
        return sum(self.tried_per_position)

    @property
    def acceptance_rate(self) -> float | None:
        """alpha of the paper: mean of sum_x min(p_i, q_i) over verified positions."""
        n = self.verified_positions
        return self.overlap_sum / n if n else None

    @property
    def empirical_acceptance(self) -> float | None:
        """accepted_draft_tokens / drafted_tokens."""
        return self.accepted_draft_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def gamma(self) -> float | int | None:
        """The fixed gamma, or under "auto" the mean gamma of the iterations that drafted."""
        if self.gamma_setting != "auto":
            return self.gamma_setting
        used = [g for g in self.gamma_history if g]
        return sum(used) / len(used) if used else None

    @property
    def gamma_histogram(self) -> dict[int, int]:
        histogram: dict[int, int] = {}
        for g in self.gamma_history:
            histogram[g] = histogram.get(g, 0) + 1
        return dict(sorted(histogram.items()))

    @property
    def tokens_per_target_call(self) -> float | None:
        return self.new_tokens / self.target_calls if self.target_calls else None

    @property
    def cost_ratio(self) -> float | None:
        """c: mean time of one draft step / mean time of one target call."""
        if not self.draft_calls or not self.target_calls or not self.target_time_s:
            return None
        return (self.draft_time_s / self.draft_calls) / (self.target_time_s / self.target_calls)

    @property
    def predicted_tokens_per_target_call(self) -> float | None:
        """(1 - alpha^(gamma+1)) / (1 - alpha) with this run's alpha and gamma."""
        alpha, gamma = self.acceptance_rate, self.gamma
        return None if alpha is None or gamma is None else expected_tokens_per_iteration(alpha, gamma)

    @property
    def predicted_speedup(self) -> float | None:
        """(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) with this run's alpha, gamma and c."""
        alpha, gamma, c = self.acceptance_rate, self.gamma, self.cost_ratio
        return None if alpha is None or gamma is None or c is None else expected_speedup(alpha, gamma, c)

    @property
    def tokens_per_second(self) -> float | None:
        """Decode speed, prompt excluded: the tokens and time after the first iteration (which
        also processes the prompt); the whole loop when there was only one iteration."""
        tokens = self.new_tokens - self.first_iteration_tokens
        seconds = self.decode_time_s - self.first_iteration_s
        if self.target_calls > 1 and tokens > 0 and seconds > 0:
            return tokens / seconds
        return self.new_tokens / self.decode_time_s if self.decode_time_s else None

    def to_dict(self) -> dict[str, Any]:
        """Every field and derived number, JSON-friendly (undefined numbers are None)."""
        out = asdict(self)
        for name in ("verified_positions", "acceptance_rate", "empirical_acceptance", "gamma",
                     "tokens_per_target_call", "cost_ratio", "predicted_tokens_per_target_call",
                     "predicted_speedup", "tokens_per_second"):
            out[name] = getattr(self, name)
        out["gamma_histogram"] = {str(g): n for g, n in self.gamma_histogram.items()}
        return out


@dataclass
class AutoregressiveStats:
    """Counters and timings of one autoregressive_generate call (the baseline)."""

    target_calls: int = 0
    new_tokens: int = 0
    target_time_s: float = 0.0  # wall time of the generation loop: forwards, warping, sampling
    wall_time_s: float = 0.0  # the whole call, cache allocation included
    first_call_s: float = 0.0  # the first forward, which reads the prompt and gives token 1

    @property
    def tokens_per_second(self) -> float | None:
        """Decode speed, prompt excluded: tokens 2.. over the time after the first forward."""
        seconds = self.target_time_s - self.first_call_s
        if self.new_tokens > 1 and seconds > 0:
            return (self.new_tokens - 1) / seconds
        return self.new_tokens / self.target_time_s if self.target_time_s else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


S = TypeVar("S", SpeculativeStats, AutoregressiveStats)


@dataclass
class GenerationResult(Generic[S]):
    """``tokens``: the new token ids only (not the prompt); ``stats``: what was measured."""

    tokens: list[int]
    stats: S
