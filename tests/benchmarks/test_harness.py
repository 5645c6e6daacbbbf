"""The harness's timer and its one median (benchmarks/harness.py): the timer is the runtime's one
(model/fast/timing.py, tested in tests/model/fast/test_timing.py), reached through the harness;
the median of figures, with its default. Nothing here measures the machine."""

from __future__ import annotations

import math

from benchmarks.harness import NAN, median, per_prompt, time_call
from model.fast.timing import Timing


def test_the_harness_times_with_the_one_timer() -> None:
    calls: list[int] = []

    def fn() -> int:
        calls.append(len(calls))
        return len(calls)

    timing = time_call(fn, 5, warmup=3, device="cpu")
    assert isinstance(timing, Timing)  # model.fast.timing's, not a second implementation
    assert len(calls) == 8 and len(timing.seconds) == 5 and timing.result == 8
    together = time_call(fn, 4, together=True)
    assert len(calls) == 12 and len(together.seconds) == 1 and together.result == 12


def test_the_median_and_its_default() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0 and median(iter([1.0, 2.0])) == 1.5
    assert median([]) is None and math.isnan(median([], NAN))
    # the best round per prompt (3, 5), then their median
    assert per_prompt([[1.0, 5.0], [3.0, 2.0]]) == 4.0
