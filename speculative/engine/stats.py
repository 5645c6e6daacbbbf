"""What a generation call measured, per row and for a batch, and the result objects.

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

from speculative.engine.cost import expected_tokens_per_iteration


def stop_reason(new_tokens: list[int], stop_ids: frozenset[int], max_new_tokens: int) -> str:
    """Why a generation call stopped: it emitted an end-of-sequence id, it reached max_new_tokens,
    or else the sequence filled the context (max_seq_len)."""
    if new_tokens and new_tokens[-1] in stop_ids:
        return "eos"
    return "max_new_tokens" if len(new_tokens) >= max_new_tokens else "max_seq_len"


class Clock:
    """A loop's timings that never wait for the device.

    On a CPU a mark is perf_counter: the work is done when the call returns. On CUDA a mark is
    an event recorded on the stream, and a duration is read from two events once the device
    has passed both. The loop's one host read per iteration makes the device pass every mark
    made before it, so :meth:`seconds` of such marks reads two finished events and waits for
    nothing (AutoGamma's times). Durations that end later are queued by :meth:`add` and summed
    by :meth:`settle` after the loop, which waits once, for the last mark."""

    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"
        self.queued: list[tuple[Any, str, Any, Any]] = []

    def mark(self) -> Any:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """end - start in seconds; on CUDA both marks must be behind a host read already."""
        return start.elapsed_time(end) / 1000 if self.events else end - start

    def add(self, owner: Any, name: str, start: Any, end: Any) -> None:
        """owner.name += end - start: now on a CPU, at :meth:`settle` on CUDA."""
        if self.events:
            self.queued.append((owner, name, start, end))
        else:
            setattr(owner, name, getattr(owner, name) + end - start)

    def settle(self) -> None:
        if self.queued:
            torch.cuda.synchronize()  # once, after the loop
        for owner, name, start, end in self.queued:
            setattr(owner, name, getattr(owner, name) + self.seconds(start, end))
        self.queued.clear()


@dataclass
class SpeculativeStats:
    """Counters and timings of one speculative_generate call (see the module docstring)."""

    gamma_setting: int | str  # what was asked for: an int, or "auto"
    gamma_policy: str = (
        "fixed"  # how gamma was chosen (speculative.engine.gamma_policy: GammaPolicy.name)
    )
    target_calls: int = 0  # target forwards = iterations (the prompt rides along with the first)
    draft_calls: int = (
        0  # the drafter's forwards (one per drafted token for a model, 0 for a lookup)
    )
    new_tokens: int = 0
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0  # as verified: accepted tokens cut off after an EOS still count
    # [i]: how often draft position i+1 was accepted / was verified (all earlier ones accepted)
    accepted_per_position: list[int] = field(default_factory=list)
    tried_per_position: list[int] = field(default_factory=list)
    # positions drafted ahead per iteration (tree: depth)
    gamma_history: list[int] = field(default_factory=list)
    # tree="auto": iterations per shape
    tree_shapes: dict[tuple[int, ...], int] = field(default_factory=dict)
    overlap_sum: float = 0.0  # sum over verified positions of sum_x min(p, q)
    draft_time_s: float = 0.0  # wall time drafting (draft forwards, warping, sampling)
    target_time_s: float = 0.0  # wall time in target forwards (verification is loop work)
    decode_time_s: float = 0.0  # wall time of the generation loop
    # The first iteration also reads the prompt; decode speed leaves it out.
    first_iteration_s: float = 0.0
    first_iteration_tokens: int = 0
    first_calls_s: float = (
        0.0  # the first iteration's drafter and target calls, the prompt's pass among them
    )
    wall_time_s: float = 0.0  # the whole call, cache allocation included
    stop_reason: str | None = None  # "eos", "max_new_tokens" or "max_seq_len"
    stop_token: int | None = None  # the end-of-sequence id that ended it (a model may have several)

    def record(
        self,
        gamma: int,
        calls: int,
        accepted: int,
        overlaps: list[float],
        drafted: int | None = None,
    ) -> None:
        """Count one iteration that drafted `gamma` positions ahead (`drafted` tokens: more for
        a tree, whose depth is gamma) with `calls` drafter forwards and accepted `accepted`."""
        self.target_calls += 1
        self.draft_calls += calls
        self.drafted_tokens += gamma if drafted is None else drafted
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
        """c: the mean time of one drafter call / the mean time of one target call. An iteration
        costs k c + 1 target calls, k its drafter calls: one per token drafted for a model or a
        feature head (the paper's c, and a tree's one call per depth), one for a whole parallel
        draft. A lookup makes no calls: its c is per position drafted ahead."""
        calls = self.draft_calls or sum(self.gamma_history)
        if not calls or not self.target_calls or not self.target_time_s:
            return None
        return (self.draft_time_s / calls) / (self.target_time_s / self.target_calls)

    @property
    def predicted_tokens_per_target_call(self) -> float | None:
        """The paper's eq. 1, (1 - alpha^(g+1)) / (1 - alpha), with this run's alpha, averaged
        over the g each iteration actually drafted (near max_new_tokens, the context's end or
        a lookup without a match it drafts fewer than gamma, or none)."""
        alpha = self.acceptance_rate
        if alpha is None or not self.gamma_history:
            return None
        return sum(expected_tokens_per_iteration(alpha, g) for g in self.gamma_history) / len(
            self.gamma_history
        )

    @property
    def predicted_speedup(self) -> float | None:
        """Theorem 3.8 over the iterations of this run: the expected tokens of every iteration,
        sum (1 - alpha^(g_i+1)) / (1 - alpha), over its expected cost in target calls,
        sum (k_i c + 1) with k_i its drafter calls (:attr:`cost_ratio`); for a fixed g drafted
        token by token that is (1 - alpha^(g+1)) / ((1 - alpha)(g c + 1)), for a parallel
        draft (1 - alpha^(g+1)) / ((1 - alpha)(c + 1))."""
        alpha, c = self.acceptance_rate, self.cost_ratio
        if alpha is None or c is None or not self.gamma_history:
            return None
        tokens = sum(expected_tokens_per_iteration(alpha, g) for g in self.gamma_history)
        calls = self.draft_calls or sum(self.gamma_history)
        return tokens / (calls * c + len(self.gamma_history))

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
        for name in (
            "verified_positions",
            "acceptance_rate",
            "empirical_acceptance",
            "gamma",
            "tokens_per_target_call",
            "cost_ratio",
            "predicted_tokens_per_target_call",
            "predicted_speedup",
            "tokens_per_second",
        ):
            out[name] = getattr(self, name)
        out["gamma_histogram"] = {str(g): n for g, n in self.gamma_histogram.items()}
        out["tree_shapes"] = {
            ",".join(map(str, s)) or "none": n for s, n in self.tree_shapes.items()
        }
        return out


@dataclass
class AutoregressiveStats:
    """Counters and timings of one autoregressive_generate call (the baseline)."""

    target_calls: int = 0
    new_tokens: int = 0
    target_time_s: float = 0.0  # wall time of the generation loop: forwards, warping, sampling
    wall_time_s: float = 0.0  # the whole call, cache allocation included
    first_call_s: float = 0.0  # the first forward, which reads the prompt and gives token 1
    stop_reason: str | None = None  # "eos", "max_new_tokens" or "max_seq_len"
    stop_token: int | None = None  # the end-of-sequence id that ended it (a model may have several)

    @property
    def tokens_per_second(self) -> float | None:
        """Decode speed, prompt excluded: tokens 2.. over the time after the first forward."""
        seconds = self.target_time_s - self.first_call_s
        if self.new_tokens > 1 and seconds > 0:
            return (self.new_tokens - 1) / seconds
        return self.new_tokens / self.target_time_s if self.target_time_s else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}

    @classmethod
    def of(cls, record: SpeculativeStats) -> AutoregressiveStats:
        """The baseline's view of an engine row that drafted nothing."""
        return cls(
            target_calls=record.target_calls,
            new_tokens=record.new_tokens,
            target_time_s=record.decode_time_s,
            wall_time_s=record.wall_time_s,
            first_call_s=record.first_iteration_s,
            stop_reason=record.stop_reason,
            stop_token=record.stop_token,
        )


@dataclass
class BatchStats:
    """What a batched call measured. The engine's own counts are its iterations (one target
    call each, for all rows), its drafter calls, the rows in each iteration and the times;
    everything about tokens is the sum of the rows' own records (``rows``), so a row's alpha
    and tau and the batch's come from one record of what happened."""

    prompts: int
    batch_size: int  # rows at most in one call
    seed: int | list[int] | None = None  # as given: prompt i used seed + i (or seed[i])
    iterations: int = 0  # batched target calls
    draft_calls: int = 0  # batched drafter calls
    rows_history: list[int] = field(default_factory=list)  # rows in each iteration
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    verify_time_s: float = 0.0  # judging and committing every row
    decode_time_s: float = 0.0
    wall_time_s: float = 0.0
    rows: list[SpeculativeStats] = field(default_factory=list, repr=False)  # every row's record

    def _sum(self, name: str) -> Any:
        return sum(getattr(row, name) for row in self.rows)

    @property
    def row_iterations(self) -> int:
        """Sum over iterations of the rows in them."""
        return self._sum("target_calls")

    @property
    def new_tokens(self) -> int:
        return self._sum("new_tokens")

    @property
    def drafted_tokens(self) -> int:
        return self._sum("drafted_tokens")

    @property
    def accepted_draft_tokens(self) -> int:
        return self._sum("accepted_draft_tokens")

    @property
    def overlap_sum(self) -> float:
        return self._sum("overlap_sum")

    @property
    def verified_positions(self) -> int:
        return self._sum("verified_positions")

    @property
    def mean_batch(self) -> float | None:
        return self.row_iterations / self.iterations if self.iterations else None

    @property
    def tokens_per_second(self) -> float | None:
        """All rows' new tokens over the loop's time (prompts included: rows join at different times)."""
        return self.new_tokens / self.decode_time_s if self.decode_time_s else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.overlap_sum / self.verified_positions if self.verified_positions else None

    @property
    def tokens_per_row_iteration(self) -> float | None:
        """tau: tokens a row gained per iteration it took part in."""
        return self.new_tokens / self.row_iterations if self.row_iterations else None

    def to_dict(self) -> dict[str, Any]:
        names = (
            "prompts",
            "batch_size",
            "seed",
            "iterations",
            "draft_calls",
            "row_iterations",
            "new_tokens",
            "drafted_tokens",
            "accepted_draft_tokens",
            "overlap_sum",
            "verified_positions",
            "rows_history",
            "draft_time_s",
            "target_time_s",
            "verify_time_s",
            "decode_time_s",
            "wall_time_s",
            "mean_batch",
            "tokens_per_second",
            "acceptance_rate",
            "tokens_per_row_iteration",
        )
        return {name: getattr(self, name) for name in names}


S = TypeVar("S", SpeculativeStats, AutoregressiveStats)


@dataclass
class GenerationResult(Generic[S]):
    """``tokens``: the new token ids only (not the prompt); ``stats``: what was measured."""

    tokens: list[int]
    stats: S


@dataclass
class BatchResult:
    """``results[i]``: prompt i's new tokens and its own stats; ``stats``: the batch's totals."""

    results: list[GenerationResult]
    stats: BatchStats


def record_iteration(
    totals: BatchStats, clock: Clock, rows: list[Any], draft: Any, steps: list[Any], marks: tuple
) -> None:
    """The counts and times of one engine iteration, per row and for the engine (marks: before
    proposing, scoring and verifying, and after committing)."""
    t0, t1, t2, now = marks
    totals.iterations += 1
    totals.draft_calls += draft.calls
    totals.rows_history.append(len(rows))
    for name, start, end in (
        ("draft_time_s", t0, t1),
        ("target_time_s", t1, t2),
        ("verify_time_s", t2, now),
    ):
        clock.add(totals, name, start, end)
    for b, (row, step) in enumerate(zip(rows, steps)):
        # a failed row verified nothing
        depth, stats = (
            (0 if row.error else draft.depth(b)),
            row.stats,
        )
        stats.record(
            depth,
            draft.calls if depth else 0,
            step.accepted,
            step.overlap,
            drafted=draft.lengths[b] if depth else 0,
        )
        clock.add(stats, "draft_time_s", t0, t1)
        clock.add(stats, "target_time_s", t1, t2)
        if stats.target_calls == 1:  # this iteration also read the prompt: timed apart
            clock.add(stats, "first_iteration_s", row.joined, now)
            clock.add(stats, "first_calls_s", t0, t2)
            stats.first_iteration_tokens = row.produced
