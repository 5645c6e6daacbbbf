"""The summaries and the JSON form of results (speculative/cli/report.py), on stats written by
hand: every number in a line is the one the stats hold, formatted as docs/cli.md shows it."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from speculative import AutoregressiveStats, SpeculativeStats
from speculative.cli.report import (
    JSON_NOTES,
    batch_compare_line,
    batch_summary_lines,
    compare_batch,
    compare_line,
    compare_stats,
    jsonable,
    stats_dict,
    summary_lines,
)


def speculative_stats(**fields: object) -> dict:
    stats = {
        "new_tokens": 40,
        "tokens_per_second": 123.456,
        "target_calls": 12,
        "draft_calls": 48,
        "stop_reason": "eos",
        "acceptance_rate": 0.8,
        "gamma": 4,
        "cost_ratio": 0.1,
        "tokens_per_target_call": 3.3333,
        "predicted_tokens_per_target_call": 3.3616,
        "gamma_history": [4] * 12,
        "predicted_speedup": 2.4011,
    }
    return {**stats, **fields}


def test_the_summary_of_a_speculative_run() -> None:
    first, cost = summary_lines(speculative_stats(), speculative=True)
    assert first == (
        "40 new tokens at 123.5 tokens/s (decoding: the prompt's pass and loading excluded); 12 target "
        "calls, 48 draft calls; stopped: eos (the model ended the text (end-of-sequence))"
    )
    assert cost.startswith(
        "cost model: alpha=0.800 gamma=4 c=0.100 (a draft call / a target call), k=4.00 draft "
        "calls per iteration: tau (tokens per target call) 3.33 measured vs 3.36 predicted"
    )
    assert "(1-alpha^(g+1))/((1-alpha)(k*c+1))" in cost
    parallel = summary_lines(speculative_stats(draft_calls=12), speculative=True)[1]
    assert "k=1.00 draft calls per iteration" in parallel
    assert cost.endswith("= 2.40x (--compare measures it)")
    assert summary_lines(speculative_stats(), speculative=True, compare=True)[1].endswith("= 2.40x")


def test_the_summary_says_when_fewer_were_drafted_and_what_is_unknown() -> None:
    lines = summary_lines(
        speculative_stats(
            gamma_history=[4, 4, 1],
            cost_ratio=None,
            stop_reason="max_seq_len",
            tokens_per_second=None,
        ),
        speculative=True,
    )
    assert (
        "at ? tokens/s" in lines[0]
        and "stopped: max_seq_len (the context is full: max_seq_len, or --ctx-size)" in lines[0]
    )
    assert "gamma=4 (drafted 3.00 per iteration) c=n/a" in lines[1]


def test_the_summary_of_the_target_alone_has_no_cost_model() -> None:
    stats = stats_dict(
        AutoregressiveStats(
            target_calls=5,
            new_tokens=5,
            target_time_s=0.5,
            first_call_s=0.1,
            stop_reason="max_new_tokens",
        ),
        speculative=False,
    )
    assert (
        stats["acceptance_rate"] is None
        and stats["gamma"] is None
        and stats["predicted_speedup"] is None
    )
    assert stats["draft_calls"] == 0 and stats["tokens_per_second"] == 4 / 0.4
    lines = summary_lines(stats, speculative=False)
    assert lines == [
        "5 new tokens at 10.0 tokens/s (decoding: the prompt's pass and loading excluded); 5 target calls "
        "(one per token); stopped: max_new_tokens (--max-new-tokens reached)"
    ]


def test_stats_dict_of_a_speculative_run_holds_the_derived_numbers() -> None:
    stats = SpeculativeStats(
        gamma_setting=2,
        target_calls=2,
        new_tokens=5,
        drafted_tokens=4,
        accepted_draft_tokens=3,
        tried_per_position=[2, 1],
        accepted_per_position=[2, 1],
        overlap_sum=2.4,
    )
    out = stats_dict(stats, speculative=True)
    assert (
        out["acceptance_rate"] == 2.4 / 3
        and out["empirical_acceptance"] == 3 / 4
        and out["gamma"] == 2
    )
    assert out["tokens_per_target_call"] == 2.5


def baseline(tokens: list[int], tokens_per_second: float) -> SimpleNamespace:
    stats = AutoregressiveStats(target_calls=len(tokens), new_tokens=len(tokens))
    stats = SimpleNamespace(
        **vars(stats),
        tokens_per_second=tokens_per_second,
        to_dict=lambda: {"new_tokens": len(tokens), "tokens_per_second": tokens_per_second},
    )
    return SimpleNamespace(tokens=torch.tensor(tokens), stats=stats)


def test_compare_measures_the_speedup_and_where_greedy_tokens_part() -> None:
    stats = speculative_stats(tokens_per_second=300.0, predicted_speedup=2.5)
    same = compare_stats(stats, baseline([1, 2, 3], 120.0), [1, 2, 3], temperature=0)
    assert (
        same["measured_speedup"] == 2.5
        and same["same_tokens"] is True
        and same["first_difference"] is None
    )
    assert same["baseline_tokens"] == [1, 2, 3] and same["baseline"]["draft_calls"] == 0
    parted = compare_stats(stats, baseline([1, 2, 9, 4], 150.0), [1, 2, 3, 4], temperature=0)
    assert parted["same_tokens"] is False and parted["first_difference"] == 2
    shorter = compare_stats(stats, baseline([1, 2], 150.0), [1, 2, 3], temperature=0)
    assert shorter["first_difference"] == 2
    sampled = compare_stats(stats, baseline([5, 6], 150.0), [1, 2], temperature=1)
    assert sampled["same_tokens"] is None and sampled["first_difference"] is None
    assert compare_line(same) == (
        "compare: speculative 300.0 tokens/s, target alone 120.0 tokens/s: measured speedup "
        "2.50x, predicted 2.50x by the cost model; the same greedy tokens"
    )
    timed = {**same, "predicted_speedup_measured_calls": 2.25}  # where both runs timed their calls
    assert compare_line(timed) == (
        "compare: speculative 300.0 tokens/s, target alone 120.0 tokens/s: measured "
        "speedup 2.50x, predicted 2.50x by the cost model, 2.25x with the calls as measured "
        "(a verification's own cost); the same greedy tokens"
    )
    assert "part at token 2" in compare_line(parted) and "greedy" not in compare_line(sampled)


def batch(rows: list[list[int]], tokens_per_second: float) -> SimpleNamespace:
    stats = SimpleNamespace(
        prompts=len(rows),
        batch_size=2,
        mean_batch=1.5,
        new_tokens=sum(map(len, rows)),
        tokens_per_second=tokens_per_second,
        iterations=4,
        draft_calls=8,
        decode_time_s=0.25,
        acceptance_rate=0.75,
        tokens_per_row_iteration=2.0,
        row_iterations=6,
        accepted_draft_tokens=6,
        drafted_tokens=8,
        to_dict=lambda: {"prompts": len(rows)},
    )
    results = [
        SimpleNamespace(
            tokens=row, stats=SimpleNamespace(stop_reason="eos" if i else "max_new_tokens")
        )
        for i, row in enumerate(rows)
    ]
    return SimpleNamespace(stats=stats, results=results)


def test_a_batch_summary_and_its_compare() -> None:
    result = batch([[1, 2], [3], [4, 5, 6]], 80.0)
    first, second = batch_summary_lines(result, speculative=True)
    assert first == (
        "batch: 3 prompts, batch size 2 (mean 1.50 rows per target call), 6 new tokens at 80.0 tokens/s "
        "over all rows (the prompts' passes included); 4 target calls, 8 draft calls, 0.25s decoding; "
        "stopped: 2 eos, 1 max_new_tokens"
    )
    assert second == (
        "alpha=0.750, tau 2.00 tokens per row per target call (6 row-iterations); 6 of 8 drafted tokens "
        "accepted"
    )
    assert len(batch_summary_lines(result, speculative=False)) == 1
    compared = compare_batch(result, batch([[1, 2], [3, 7], [4, 5, 6]], 40.0), temperature=0)
    assert compared["measured_speedup"] == 2.0 and compared["differing_prompts"] == [1]
    assert compared["same_tokens"] is False and compared["baseline_tokens"][1] == [3, 7]
    assert "differ for prompt(s) 1" in batch_compare_line(compared)
    assert compare_batch(result, result, temperature=1)["differing_prompts"] is None


def test_jsonable_is_plain_json() -> None:
    doc = jsonable(
        {
            "t": torch.tensor([1, 2]),
            "nan": math.nan,
            "inf": [math.inf, 1.5],
            "tuple": (1, "a"),
            "other": torch.float32,
            3: None,
            "ok": True,
        }
    )
    assert doc == {
        "t": [1, 2],
        "nan": None,
        "inf": [None, 1.5],
        "tuple": [1, "a"],
        "other": "torch.float32",
        "3": None,
        "ok": True,
    }
    json.dumps(doc, allow_nan=False)


def test_the_json_notes_name_both_acceptance_numbers() -> None:
    assert (
        "alpha" in JSON_NOTES["acceptance_rate"]
        and "never verified" in JSON_NOTES["empirical_acceptance"]
    )


def test_the_measured_calls_prediction_leaves_out_the_prompt_and_counts_the_loops_own_work() -> (
    None
):
    """A prompt's pass of 0.5 s (target alone) and 0.7 s (speculative, its draft too), steps of 0.1 s, 8 tokens/s
    alone (0.025 s of the loop's own work a token), 5 later iterations of 0.05 s drafting and 0.15 s verifying,
    2 tokens expected each: 2 x 0.125 / (0.2 + 0.025) = 10/9. Counting the prompt's pass in the iterations would
    say 2 x 0.125 / (2.4 / 6 + 0.025) = 0.59, and leaving out the loop's work 2 x 0.1 / 0.2 = 1.0."""
    alone = baseline(list(range(11)), 8.0)
    alone.stats.target_time_s, alone.stats.first_call_s = 1.5, 0.5
    stats = {
        **speculative_stats(tokens_per_second=9.0, predicted_speedup=2.0),
        "target_calls": 6,
        "draft_time_s": 0.1 + 5 * 0.05,
        "target_time_s": 0.6 + 5 * 0.15,
        "first_calls_s": 0.7,
        "predicted_tokens_per_target_call": 2.0,
    }
    assert compare_stats(stats, alone, [], temperature=1)[
        "predicted_speedup_measured_calls"
    ] == pytest.approx(10 / 9)
