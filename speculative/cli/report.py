"""A generation's results in words and in JSON: the summary lines next to the paper's cost
model (docs/cost_model.md), --compare's measured speedup, and what every JSON field means
(docs/cli.md). generate.py prints these; they read only the stats objects' public fields.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from speculative import BatchResult

STOP_REASONS = {
    "eos": "the model ended the text (end-of-sequence)",
    "max_new_tokens": "--max-new-tokens reached",
    "max_seq_len": "the context is full: max_seq_len, or --ctx-size",
    "stop_string": "the text met a --stop string",
}

# What the two acceptance numbers mean, in the JSON itself (docs/cli.md has every field).
JSON_NOTES = {
    "acceptance_rate": "the paper's alpha: the probability that the target accepts a drafted token, the mean of "
    "sum_x min(p(x), q(x)) over the draft positions it verified; the alpha of the cost model",
    "empirical_acceptance": "accepted_draft_tokens / drafted_tokens in this run: lower than alpha, because the "
    "tokens drafted after a rejection are counted but never verified",
    "tokens_per_second": "decode speed: new tokens over the loop's time after its first iteration (the prompt's)",
    "stop_reason": "eos: the model ended the text; max_new_tokens: --max-new-tokens reached; max_seq_len: the "
    "context is full; stop_string: the text met a --stop string",
}

# And for a batch.
BATCH_NOTES = {
    "batch": "the batch's totals (speculative.engine.stats.BatchStats): an iteration is one target call for all rows; "
    "tokens_per_second is all rows' new tokens over the whole loop (the prompts' passes included); "
    "tokens_per_row_iteration is tau, the tokens a row gained per target call it was in",
    "prompts": "one entry per line of --prompts-file, in order; prompt_index i (from 0, line i + 1) sampled with "
    "seed + i; each stats is that row's own, its times those of the batched calls it shared",
}


def stats_dict(stats: Any, speculative: bool) -> dict[str, Any]:
    """A stats object as a dict (its to_dict); without a draft, the fields of speculation that
    mean nothing for the target alone are None and draft_calls is 0."""
    out = stats.to_dict() if hasattr(stats, "to_dict") else dict(vars(stats))
    if not speculative:
        out.setdefault("draft_calls", 0)
        for key in ("acceptance_rate", "gamma", "predicted_speedup"):
            out[key] = None
    return out


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_lines(stats: dict[str, Any], speculative: bool, compare: bool = False) -> list[str]:
    """The run's numbers (a :func:`stats_dict`): tokens, speed, calls and why it stopped; with a
    draft, α, γ and c next to the measured and predicted tokens per target call and the
    predicted speedup (``compare``: the run measures it too, so the line does not say how)."""
    tps = stats.get("tokens_per_second")
    speed = f"{tps:.1f}" if tps else "?"
    calls = f"{stats.get('target_calls')} target calls"
    if speculative:
        calls += f", {stats.get('draft_calls')} draft calls"
    else:
        calls += " (one per token)"
    reason = stats.get("stop_reason")
    lines = [
        f"{stats.get('new_tokens')} new tokens at {speed} tokens/s (decoding: the prompt's pass and "
        f"loading excluded); {calls}; stopped: {reason} ({STOP_REASONS.get(reason, 'unknown')})"
    ]
    alpha = stats.get("acceptance_rate")
    gamma = stats.get("gamma")
    if speculative and alpha is not None and gamma is not None:
        lines.append(_cost_model_line(stats, alpha, gamma, compare))
    if shapes := stats.get("tree_shapes"):  # --tree auto: what it chose
        by_count = sorted(shapes.items(), key=lambda item: -item[1])
        counts = ", ".join(f"{shape} {n}" for shape, n in by_count)
        lines.append(f"tree auto: iterations by shape (none: a plain target step): {counts}")
    return lines


def _cost_model_line(stats: dict[str, Any], alpha: float, gamma: float, compare: bool) -> str:
    """α, γ and c next to the measured and predicted tau and the predicted speedup."""
    measured = stats.get("tokens_per_target_call")
    predicted = stats.get("predicted_tokens_per_target_call")
    drafted = stats.get("gamma_history") or []
    mean = sum(drafted) / len(drafted) if drafted else None
    # gamma is what was asked for (or auto's mean); near the end of the output or of the
    # context fewer are drafted, and the prediction uses what each iteration drafted.
    used = ""
    if mean is not None and abs(mean - gamma) > 1e-9:
        used = f" (drafted {mean:.2f} per iteration)"
    draft_calls = stats.get("draft_calls") or 0
    k = f"{draft_calls / len(drafted):.2f}" if drafted and draft_calls else "g"
    how = "" if compare else " (--compare measures it)"
    return (
        f"cost model: alpha={alpha:.3f} gamma={gamma:g}{used} c={_num(stats.get('cost_ratio'), '.3f')} "
        f"(a draft call / a target call), k={k} draft calls per iteration: tau (tokens per target "
        f"call) {_num(measured, '.2f')} measured vs {_num(predicted, '.2f')} predicted by "
        f"(1-alpha^(g+1))/(1-alpha) over the g drafted in each iteration; predicted speedup "
        f"(1-alpha^(g+1))/((1-alpha)(k*c+1)) = {_num(stats.get('predicted_speedup'), '.2f')}x{how}"
    )


def compare_stats(
    stats: dict[str, Any], baseline: Any, tokens: list[int], temperature: float
) -> dict[str, Any]:
    """--compare: both decode speeds, their ratio (the measured speedup) and the predicted one.
    ``stats``: the speculative run's :func:`stats_dict`; ``baseline``: the target alone's result.
    Greedy runs say whether the tokens are the same, else where they part."""
    fast = stats.get("tokens_per_second")
    slow = baseline.stats.tokens_per_second
    base_tokens = [int(t) for t in baseline.tokens]
    same = None  # sampled runs draw differently, by design
    first = None
    if not temperature > 0:
        same = base_tokens == tokens
        if not same:
            first = _first_difference(tokens, base_tokens)
    # The cost model with the calls as measured: an iteration costs its drafter and verification calls as they
    # cost here (a verification of g + 1 tokens is not one step on a CPU), the prompt's pass left out as decode
    # speed leaves it out, plus the loop's own work (sampling, host reads) as the target alone pays it per token.
    b = baseline.stats
    step = (b.target_time_s - b.first_call_s) / (b.target_calls - 1) if b.target_calls > 1 else None
    calls = stats.get("target_calls") or 0
    spent = (
        (stats.get("draft_time_s") or 0)
        + (stats.get("target_time_s") or 0)
        - (stats.get("first_calls_s") or 0)
    )
    tau = stats.get("predicted_tokens_per_target_call")
    by_width = None
    if tau and step and slow and calls > 1 and spent > 0:
        token = 1 / slow  # the target alone's token: its step and its loop's own work
        by_width = tau * token / (spent / (calls - 1) + max(0.0, token - step))
    return {
        "speculative_tokens_per_second": fast,
        "baseline_tokens_per_second": slow,
        "measured_speedup": fast / slow if fast and slow else None,
        "predicted_speedup": stats.get("predicted_speedup"),
        "predicted_speedup_measured_calls": by_width,
        "same_tokens": same,
        "first_difference": first,
        "baseline": stats_dict(baseline.stats, False),
        "baseline_tokens": base_tokens,
    }


def _first_difference(tokens: list[int], base_tokens: list[int]) -> int:
    """Where two token lists part: the first index where they differ, else the shorter's end."""
    for i, (a, b) in enumerate(zip(tokens, base_tokens)):
        if a != b:
            return i
    return min(len(tokens), len(base_tokens))


def compare_line(compare: dict[str, Any]) -> str:
    """:func:`compare_stats` in one line: the measured speedup next to the predicted one."""
    same = compare.get("same_tokens")
    # Greedy outputs may part only at a near-tie of the target's top two logits (rounding:
    # docs/algorithm.md, numerics policy); sampled runs draw differently and are not compared.
    if same is None:
        tokens = ""
    elif same:
        tokens = "; the same greedy tokens"
    else:
        first = compare.get("first_difference")
        tokens = (
            f"; the greedy tokens part at token {first} (see the numerics policy in "
            "docs/algorithm.md)"
        )
    by_width = compare.get("predicted_speedup_measured_calls")
    measured = ""
    if by_width is not None:
        measured = f", {by_width:.2f}x with the calls as measured (a verification's own cost)"
    return (
        f"compare: speculative {_num(compare['speculative_tokens_per_second'], '.1f')} tokens/s, target alone "
        f"{_num(compare['baseline_tokens_per_second'], '.1f')} tokens/s: measured speedup "
        f"{_num(compare['measured_speedup'], '.2f')}x, predicted {_num(compare['predicted_speedup'], '.2f')}x by "
        f"the cost model{measured}{tokens}"
    )


def batch_summary_lines(result: BatchResult, speculative: bool) -> list[str]:
    """A batch's totals: its rows, speed, calls and acceptance (no cost model: it is for one sequence)."""
    stats = result.stats
    reasons = Counter(row.stats.stop_reason for row in result.results)
    stopped = ", ".join(f"{count} {reason}" for reason, count in reasons.most_common())
    calls = f"{stats.iterations} target calls"
    if speculative:
        calls += f", {stats.draft_calls} draft calls"
    else:
        calls += " (one token per row each)"
    lines = [
        f"batch: {stats.prompts} prompts, batch size {stats.batch_size} (mean {_num(stats.mean_batch, '.2f')} "
        f"rows per target call), {stats.new_tokens} new tokens at {_num(stats.tokens_per_second, '.1f')} "
        f"tokens/s over all rows (the prompts' passes included); {calls}, "
        f"{stats.decode_time_s:.2f}s decoding; stopped: {stopped}"
    ]
    if speculative:
        lines.append(
            f"alpha={_num(stats.acceptance_rate, '.3f')}, tau {_num(stats.tokens_per_row_iteration, '.2f')} "
            f"tokens per row per target call ({stats.row_iterations} row-iterations); "
            f"{stats.accepted_draft_tokens} of {stats.drafted_tokens} drafted tokens accepted"
        )
    return lines


def compare_batch(result: BatchResult, baseline: BatchResult, temperature: float) -> dict[str, Any]:
    """--compare of a batch: its total tokens/s with the draft and without, their ratio, and
    (greedy) the prompts whose tokens differ."""
    fast = result.stats.tokens_per_second
    slow = baseline.stats.tokens_per_second
    base_tokens = [[int(t) for t in row.tokens] for row in baseline.results]
    differ = None  # sampled runs draw differently, by design
    if not temperature > 0:
        pairs = enumerate(zip(result.results, base_tokens))
        differ = [i for i, (row, base) in pairs if [int(t) for t in row.tokens] != base]
    return {
        "speculative_tokens_per_second": fast,
        "baseline_tokens_per_second": slow,
        "measured_speedup": fast / slow if fast and slow else None,
        "same_tokens": None if differ is None else not differ,
        "differing_prompts": differ,
        "baseline": baseline.stats.to_dict(),
        "baseline_tokens": base_tokens,
    }


def batch_compare_line(compare: dict[str, Any]) -> str:
    """:func:`compare_batch` in one line."""
    differ = compare["differing_prompts"]
    if differ is None:
        tokens = ""
    elif not differ:
        tokens = "; the same greedy tokens for every prompt"
    else:
        tokens = (
            f"; the greedy tokens differ for prompt(s) {', '.join(map(str, differ))} "
            "(see the numerics policy in docs/algorithm.md)"
        )
    return (
        f"compare: speculative {_num(compare['speculative_tokens_per_second'], '.1f')} tokens/s, target alone "
        f"{_num(compare['baseline_tokens_per_second'], '.1f')} tokens/s (both batched alike, all rows): measured "
        f"speedup {_num(compare['measured_speedup'], '.2f')}x{tokens}"
    )


def jsonable(value: Any) -> Any:
    """Plain JSON: tensors as lists, NaN and infinities as null, anything unknown as a string."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)
