"""Batched speculative decoding: many prompts at once, ONE target call per iteration for all
of them, and every row accepting its own number of tokens (ragged acceptance, as in vLLM,
SGLang and BASS, Qian et al. 2024). docs/batching.md explains what batching does to the
speedup.

One iteration over the rows in the batch, with the seams of the single-sequence loop
(speculative.speculative):

1. Propose (lines 1-3): the drafter drafts gamma_b tokens for every row b, one draft call
   per step for all rows (RowDrafter.propose_rows), row b drawing from its own stream.
2. Score (line 4): ONE target call over every row's unread tokens and its draft, row b at
   its own cache slots (speculative.calls.ragged), padded to the widest row.
3. Judge (lines 5-9): each row by itself, with its own p, q and random stream: the same
   :func:`speculative.speculative.judge` as the single loop. Every row's verdict is device
   tensors, and all of them reach the host in one copy (at temperature 0, all rows' argmaxes).
4. Commit (line 10): row b emits its own x_1..x_n, t; its cache position and its drafter's
   move by its own count. No row waits for, or is cut back to, another's acceptance.

Why a second loop and not speculative_generate run per row: the point is the one shared
target call, and with it every row's state (sequence, cache position, drafter state,
generator) becomes a list and the verification a loop over rows. The per-row work calls the
single loop's own functions.

Rows and their lifetime: a row finishes on EOS, max_new_tokens or the context. At the end of
the iteration it leaves the batch: the KV caches drop its row (model.move_cache
compacts the rest) and a waiting prompt takes its place (continuous batching), so a finished
row costs no work. A newcomer is read in the next iteration's calls, padded like the rest:
that one iteration is as wide as its prompt.

Seeds: the row of prompt i draws everything from its own torch.Generator, seeded with
seed + i (or seed[i] when a list is given), in the same order as speculative_generate would
draw for that prompt alone. So prompt i's tokens do not depend on which other prompts share
the batch, or on the batch size: speculative_generate(target, draft, prompts[i], seed=seed+i)
gives the same tokens, up to the numerics policy (docs/algorithm.md: a row's logits come
from a matmul of another shape, and near-ties may fall the other way). gamma="auto" is the
exception: it adapts one gamma for the batch from measured times, so rows see each other.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from speculative import calls
from speculative.drafter import RowDrafter, RowDrafts, pad_rows
from speculative.gamma import AutoGamma
from speculative.inputs import (
    check_gamma,
    check_max_new_tokens,
    check_prompt,
    finite_flag,
    model_device,
    read_host,
    usable_logits,
)
from speculative.sampling import Sampling, make_generator, sample_rows, warp
from speculative.speculative import DEFAULT_GAMMA, VERIFY_RULES, cut_at_eos, drafter_for, judge
from speculative.stats import AutoregressiveStats, Clock, GenerationResult, SpeculativeStats, stop_reason
from speculative.verify import Verdict, Verification, greedy_outcome, together

__all__ = ["BatchResult", "BatchStats", "autoregressive_generate_batch", "speculative_generate_batch"]


# ----------------------------------------------------------------------------- results
@dataclass
class BatchStats:
    """What a batched call measured, over all rows. An iteration is one batched target call."""

    prompts: int
    batch_size: int  # rows at most in one call
    seed: int | list[int] | None = None  # as given: prompt i used seed + i (or seed[i])
    iterations: int = 0  # batched target calls
    draft_calls: int = 0  # batched drafter calls
    row_iterations: int = 0  # sum over iterations of the rows in them
    new_tokens: int = 0
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    overlap_sum: float = 0.0
    verified_positions: int = 0
    rows_history: list[int] = field(default_factory=list)  # rows in each iteration
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    verify_time_s: float = 0.0  # judging and committing every row (host work)
    decode_time_s: float = 0.0
    wall_time_s: float = 0.0

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
        out = asdict(self)
        for name in ("mean_batch", "tokens_per_second", "acceptance_rate", "tokens_per_row_iteration"):
            out[name] = getattr(self, name)
        return out


@dataclass
class BatchResult:
    """``results[i]``: prompt i's new tokens and its own stats; ``stats``: the batch's totals."""

    results: list[GenerationResult]
    stats: BatchStats


# ----------------------------------------------------------------------------- rows
@dataclass
class Row:
    """One prompt while it is in the batch."""

    index: int  # its place in the list of prompts
    prompt: list[int]
    generator: torch.Generator
    stats: Any  # SpeculativeStats or AutoregressiveStats
    joined: Any  # the Clock's mark when it joined the batch
    ids: list[int] = field(default_factory=list)  # prompt + output, on the host
    target_next: int = 0  # the target's first cache slot not holding a token of the row

    @property
    def produced(self) -> int:
        return len(self.ids) - len(self.prompt)


def row_generator(device: torch.device, seeds: list[int | None], index: int) -> torch.Generator:
    """The generator of prompt ``index``: its own seed, so rows never share a random draw."""
    return make_generator(device, seeds[index])


def row_seeds(seed: int | Sequence[int] | None, count: int) -> list[int | None]:
    """seed + i for prompt i, a list as given, or None (fresh entropy) for every row."""
    if seed is None:
        return [None] * count
    if isinstance(seed, int) and not isinstance(seed, bool):
        return [seed + i for i in range(count)]
    seeds = list(seed) if isinstance(seed, Sequence) else None
    if seeds is None or len(seeds) != count or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
        raise ValueError(f"seed must be an integer, None, or a list of {count} integers (one per prompt), got {seed!r}")
    return seeds


def check_prompts(prompts: Any, vocab_size: int, limit: int) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence) or isinstance(prompts, str):
        raise ValueError("prompts must be a list of prompts, each a list of token ids")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    checked = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) or not isinstance(prompt, (Sequence, torch.Tensor)):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
        try:
            checked.append(check_prompt(prompt, vocab_size, limit))
        except ValueError as error:
            raise ValueError(f"prompt {i}: {error}") from None
    return checked


def check_batch_size(batch_size: Any, count: int) -> int:
    if batch_size is None:
        return count
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    return min(batch_size, count)


class Batch:
    """The rows in the batch (row b of the batch is row b of every KV cache), the prompts
    waiting, and the finished rows. Every row's tokens live on the host (``Row.ids``): each
    call's input is built from them in one copy."""

    def __init__(self, prompts: list[list[int]], seeds: list[int | None], batch_size: int, device: torch.device,
                 new_stats: Any, clock: Clock) -> None:
        self.prompts, self.seeds, self.batch_size, self.device, self.clock = prompts, seeds, batch_size, device, clock
        self.new_stats = new_stats
        self.waiting = deque(range(len(prompts)))
        self.rows: list[Row] = []
        self.done: dict[int, Row] = {}

    def refill(self, finished: list[bool]) -> tuple[list[int], int]:
        """Drop the finished rows, move the rest to the front and admit waiting prompts behind
        them. Returns the kept rows' old indices and the number admitted (for keep_rows)."""
        kept = [b for b, f in enumerate(finished) if not f]
        for b, f in enumerate(finished):
            if f:
                self.done[self.rows[b].index] = self.rows[b]
        self.rows = [self.rows[b] for b in kept]
        new = 0
        while self.waiting and len(self.rows) < self.batch_size:
            index = self.waiting.popleft()
            prompt = self.prompts[index]
            row = Row(index, prompt, row_generator(self.device, self.seeds, index), self.new_stats(),
                      self.clock.mark(), ids=list(prompt))
            self.rows.append(row)
            new += 1
        return kept, new

    def write(self, emitted: list[list[int]]) -> None:
        """Append each row's emitted tokens to its ids."""
        for row, tokens in zip(self.rows, emitted):
            row.ids.extend(tokens)

    def results(self, eos_id: int | None, max_new_tokens: int) -> list[GenerationResult]:
        out = []
        for i in range(len(self.prompts)):
            row = self.done[i]
            tokens = row.ids[len(row.prompt):]
            row.stats.new_tokens = len(tokens)
            row.stats.stop_reason = stop_reason(tokens, eos_id, max_new_tokens)
            out.append(GenerationResult(tokens=tokens, stats=row.stats))
        return out


def finished(row: Row, eos_id: int | None, max_new_tokens: int, limit: int) -> bool:
    return (row.produced >= max_new_tokens or len(row.ids) >= limit
            or (eos_id is not None and row.ids[-1] == eos_id and row.produced > 0))


# ----------------------------------------------------------------------------- speculative
def speculative_generate_batch(target: Any, draft: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                               gamma: int | str = DEFAULT_GAMMA, temperature: float = 1.0, top_k: int | None = None,
                               top_p: float | None = None, eos_id: int | None = None,
                               seed: int | Sequence[int] | None = None, verify: str = "token",
                               batch_size: int | None = None) -> BatchResult:
    """speculative_generate for every prompt of ``prompts`` (token-id lists, any lengths), at
    most ``batch_size`` rows at a time (default: all), one target call per iteration for all
    rows. Returns one GenerationResult per prompt, in order, and the batch's BatchStats.

    Each row's output has exactly the target's distribution, and row i's tokens are those of
    speculative_generate(target, draft, prompts[i], seed=seed + i, ...) up to the numerics
    policy (module docstring). ``draft`` is a model or a RowDrafter (all shipped drafters);
    ``verify`` is "token" or "block", as in speculative_generate. Token trees are not
    batched."""
    wall_start = time.perf_counter()
    drafter = drafter_for(target, draft)
    if not isinstance(drafter, RowDrafter):
        raise ValueError(f"{type(drafter).__name__} cannot draft for a batch (it has no propose_rows)")
    sampling = Sampling(temperature, top_k, top_p)
    if verify not in VERIFY_RULES:
        raise ValueError(f"verify must be one of {', '.join(map(repr, VERIFY_RULES))}, got {verify!r}")
    gamma_max = check_gamma(gamma)
    check_max_new_tokens(max_new_tokens)
    limit = min(target.config.max_seq_len, drafter.max_seq_len or target.config.max_seq_len)
    prompts = check_prompts(prompts, target.config.vocab_size, limit)
    seeds = row_seeds(seed, len(prompts))
    batch_size = check_batch_size(batch_size, len(prompts))
    auto = AutoGamma(gamma_max=gamma_max) if gamma == "auto" else None

    def new_stats() -> SpeculativeStats:
        return SpeculativeStats(gamma_setting=gamma if auto else gamma_max, accepted_per_position=[0] * gamma_max,
                                tried_per_position=[0] * gamma_max)

    totals = BatchStats(prompts=len(prompts), batch_size=batch_size, seed=seed)
    with torch.inference_mode():
        cache_len = min(limit, max(len(p) for p in prompts) + max_new_tokens + gamma_max + 1)
        target.setup_cache(batch_size, cache_len)
        drafter.start_rows(batch_size, cache_len, target)
        device = model_device(target)
        clock = Clock(device)
        batch = Batch(prompts, seeds, batch_size, device, new_stats, clock)
        decode_start = clock.mark()
        drafter.keep_rows(*batch.refill([]))
        while batch.rows:
            rows = batch.rows
            g = auto.gamma if auto else gamma_max
            gammas = [min(g, max_new_tokens - row.produced - 1, limit - len(row.ids) - 1) for row in rows]
            t0 = clock.mark()
            drafts = drafter.propose_rows([row.ids for row in rows], gammas, sampling,
                                          [row.generator for row in rows], device)  # lines 1-3
            t1 = clock.mark()
            logits, hidden = score_rows(target, rows, drafts, drafter.reads_features, device)  # line 4
            t2 = clock.mark()
            finite = finite_flag(logits)
            steps = judge_rows(logits, drafts, sampling, verify, rows, finite).read(finite)  # lines 5-9, one read
            starts = [row.target_next for row in rows]
            batch.write([cut_at_eos(step.tokens, eos_id) for step in steps])  # line 10
            advance(rows, steps)
            drafter.commit_rows([len(row.ids) for row in rows], hidden, starts)
            t3 = clock.mark()

            count(totals, rows, drafts, steps, clock, (t0, t1, t2, t3))
            if auto is not None and totals.iterations > 1 and max(gammas) > 0:
                auto.update([o for step in steps for o in step.overlap[:step.accepted + 1]],  # t0..t2: before
                            clock.seconds(t0, t1) / max(gammas), clock.seconds(t1, t2))  # the judge's host reads
            done = [finished(row, eos_id, max_new_tokens, limit) for row in rows]
            for row, f in zip(rows, done):
                if f:
                    clock.add(row.stats, "decode_time_s", row.joined, t3)
            if any(done) or (batch.waiting and len(rows) < batch_size):
                kept, new = batch.refill(done)
                if kept != list(range(len(kept))):
                    target.move_cache(kept)
                drafter.keep_rows(kept, new)
        clock.add(totals, "decode_time_s", decode_start, clock.mark())
        clock.settle()
    results = batch.results(eos_id, max_new_tokens)
    totals.new_tokens = sum(len(r.tokens) for r in results)
    totals.wall_time_s = time.perf_counter() - wall_start
    for r in results:
        r.stats.wall_time_s = totals.wall_time_s
    return BatchResult(results=results, stats=totals)


# ----------------------------------------------------------------------------- the seams, per row
def score_rows(target: Any, rows: list[Row], drafts: RowDrafts, reads_features: bool,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Line 4 for every row in ONE target call: row b feeds what the target has not read of
    it and its draft, at its own cache position. Returns row b's logits for its g_b + 1
    positions L_b-1 .. L_b+g_b-1 and, for a drafter that reads them, the call's features.
    The input is built in a handful of operators whatever B is: the unread tokens from the
    host in one copy, the drafted ones placed by one indexed write. The logits come back as
    one [sum of (g_b + 1), V] tensor, checked by the verification (judge_rows' ``finite``)."""
    unread = [row.ids[row.target_next:] for row in rows]
    sizes = [len(u) + g for u, g in zip(unread, drafts.lengths)]
    feed = pad_rows(unread, device, max(sizes))
    at = [(b, len(u) + j, j) for b, (u, g) in enumerate(zip(unread, drafts.lengths)) for j in range(g)]
    if at:
        index = torch.tensor(at, device=device).T
        feed[index[0], index[1]] = drafts.tokens[index[0], index[2]]
    call = calls.ragged([row.target_next for row in rows], feed.shape[1], target.cache_len, device)
    out = target(feed, call, return_hidden=True) if reads_features else target(feed, call)
    logits, hidden = out if reads_features else (out, None)
    wanted = [g + 1 for g in drafts.lengths]
    at_row = [b for b, n in enumerate(wanted) for _ in range(n)]
    at_col = [size - n + j for size, n in zip(sizes, wanted) for j in range(n)]
    index = torch.tensor([at_row, at_col], device=logits.device)
    return logits[index[0], index[1]], hidden


def judge_rows(logits: torch.Tensor, drafts: RowDrafts, sampling: Sampling, rule: str, rows: list[Row],
               finite: torch.Tensor | None = None) -> Verdict:
    """Lines 5-9 for every row, each with its own p, q and generator: the single loop's judge,
    its verdicts read together. ``logits``: every row's g_b + 1 rows, stacked; ``finite``:
    their finite_flag (a sampled row verifies usable logits until the read checks it). At
    temperature 0 the argmaxes of all rows and their drafts are the parts, whatever B is."""
    wanted = [g + 1 for g in drafts.lengths]
    if not sampling.greedy:
        return together([judge(p, drafts.row(b), sampling, rule, row.generator, finite)
                         for b, (p, row) in enumerate(zip(logits.split(wanted), rows))])
    width = drafts.tokens.shape[1]

    def finish(choices: list[int], drafted: list[int]) -> list[Verification]:
        out, at = [], 0
        for b, g in enumerate(drafts.lengths):
            out.append(greedy_outcome(drafted[b * width:b * width + g], choices[at:at + g + 1]))
            at += g + 1
        return out

    return Verdict([logits.argmax(-1), drafts.tokens.flatten().to(logits.device)], finish)


def advance(rows: list[Row], steps: list[Verification]) -> None:
    """Line 10's rollback, per row: everything before the row's newest token is in the
    target's cache, whatever the other rows accepted."""
    for row in rows:
        row.target_next = len(row.ids) - 1


def count(totals: BatchStats, rows: list[Row], drafts: RowDrafts, steps: list[Verification], clock: Clock,
          marks: tuple[Any, Any, Any, Any]) -> None:
    """One iteration into every row's stats and the batch's totals (marks: before proposing,
    scoring and judging, and after committing)."""
    t0, t1, t2, now = marks
    totals.iterations += 1
    totals.draft_calls += drafts.calls
    totals.row_iterations += len(rows)
    totals.rows_history.append(len(rows))
    for name, start, end in (("draft_time_s", t0, t1), ("target_time_s", t1, t2), ("verify_time_s", t2, now)):
        clock.add(totals, name, start, end)
    for row, depth, step in zip(rows, drafts.lengths, steps):
        stats = row.stats
        before = stats.overlap_sum, stats.verified_positions
        stats.record(depth, drafts.calls if depth else 0, step.accepted, step.overlap, drafted=depth)
        clock.add(stats, "draft_time_s", t0, t1)
        clock.add(stats, "target_time_s", t1, t2)
        if stats.target_calls == 1:
            clock.add(stats, "first_iteration_s", row.joined, now)
            stats.first_iteration_tokens = row.produced
        totals.drafted_tokens += depth
        totals.accepted_draft_tokens += step.accepted
        totals.overlap_sum += stats.overlap_sum - before[0]
        totals.verified_positions += stats.verified_positions - before[1]


# ----------------------------------------------------------------------------- the baseline
def autoregressive_generate_batch(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                                  eos_id: int | None = None, seed: int | Sequence[int] | None = None,
                                  batch_size: int | None = None) -> BatchResult:
    """autoregressive_generate for every prompt, one model call per token for all rows (each
    at its own position), at most ``batch_size`` rows at a time. Row i draws with seed + i,
    as autoregressive_generate(model, prompts[i], seed=seed + i) does alone."""
    wall_start = time.perf_counter()
    sampling = Sampling(temperature, top_k, top_p)
    check_max_new_tokens(max_new_tokens)
    limit = model.config.max_seq_len
    prompts = check_prompts(prompts, model.config.vocab_size, limit)
    seeds = row_seeds(seed, len(prompts))
    batch_size = check_batch_size(batch_size, len(prompts))
    totals = BatchStats(prompts=len(prompts), batch_size=batch_size, seed=seed)
    with torch.inference_mode():
        cache_len = min(limit, max(len(p) for p in prompts) + max_new_tokens)
        model.setup_cache(batch_size, cache_len)
        device = model_device(model)
        clock = Clock(device)
        batch = Batch(prompts, seeds, batch_size, device, AutoregressiveStats, clock)
        decode_start = clock.mark()
        batch.refill([])
        feed, last = None, None  # the next call's tokens: rebuilt whenever the rows change
        while batch.rows:
            rows = batch.rows
            t0 = clock.mark()
            if feed is None:  # the first call of a row reads its prompt: widths differ, padded
                feeds = [row.ids[row.target_next:] for row in rows]
                feed = pad_rows(feeds, device)
                last = torch.tensor([len(f) - 1 for f in feeds], device=device)
            out = model(feed, calls.ragged([row.target_next for row in rows], feed.shape[1], model.cache_len, device))
            logits = out[torch.arange(len(rows), device=device), last]
            usable = finite_flag(logits)  # read with the tokens; never sample NaN meanwhile
            tokens = logits.argmax(-1) if sampling.greedy else sample_rows(
                warp(usable_logits(logits, usable), sampling), [row.generator for row in rows])
            (host,) = read_host([tokens], usable)  # the check in the same copy as the tokens
            for row, token in zip(rows, host):
                row.target_next = len(row.ids)
                row.ids.append(token)
            feed, last = tokens.view(-1, 1), torch.zeros(len(rows), dtype=torch.long, device=device)
            t1 = clock.mark()
            totals.iterations += 1
            totals.row_iterations += len(rows)
            totals.rows_history.append(len(rows))
            clock.add(totals, "target_time_s", t0, t1)
            for row in rows:
                row.stats.target_calls += 1
                if row.stats.target_calls == 1:
                    clock.add(row.stats, "first_call_s", row.joined, t1)
            done = [finished(row, eos_id, max_new_tokens, limit) for row in rows]
            for row, f in zip(rows, done):
                if f:
                    clock.add(row.stats, "target_time_s", row.joined, t1)
            if any(done):
                kept, _ = batch.refill(done)
                if kept != list(range(len(kept))):
                    model.move_cache(kept)
                feed = None
        clock.add(totals, "decode_time_s", decode_start, clock.mark())
        clock.settle()
    results = batch.results(eos_id, max_new_tokens)
    totals.new_tokens = sum(len(r.tokens) for r in results)
    totals.wall_time_s = time.perf_counter() - wall_start
    for r in results:
        r.stats.wall_time_s = totals.wall_time_s
    return BatchResult(results=results, stats=totals)
