"""The one timer of a call (model/fast/timing.py), on a counting function: what is called, what is
timed, what comes back. Nothing here measures the machine."""

from __future__ import annotations

import statistics

from model.fast.timing import Timing, time_call


def counter() -> tuple[list[int], object]:
    calls: list[int] = []

    def fn() -> int:
        calls.append(len(calls))
        return len(calls)

    return calls, fn


def test_each_call_timed_alone_after_the_warm_up() -> None:
    calls, fn = counter()
    timing = time_call(fn, 5, warmup=3)
    assert len(calls) == 8 and len(timing.seconds) == 5 and all(s >= 0 for s in timing.seconds)
    assert timing.result == 8  # the last call's
    assert timing.median == statistics.median(timing.seconds)


def test_calls_timed_together_give_one_figure_per_call() -> None:
    calls, fn = counter()
    timing = time_call(fn, 4, together=True, device="cpu")  # a CPU device waits for nothing
    assert len(calls) == 4 and len(timing.seconds) == 1 and timing.result == 4


def test_one_call_by_default() -> None:
    timing = time_call(lambda: "done")
    assert isinstance(timing, Timing) and len(timing.seconds) == 1 and timing.result == "done"
