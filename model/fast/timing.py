"""The one timer of a call in this project: the set-up choice (model/fast/setup.py) times its
candidates with it, and every script of benchmarks/ through ``benchmarks.harness.time_call``.

It lives here, with the code that runs, because the set-up choice is runtime code and runtime
code never imports benchmarks/. A call's figure is the median of its timed calls: a call that
another process interrupted does not move it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Timing:
    """What :func:`time_call` measured: seconds of each timed call (one figure, seconds per call,
    when the calls were timed together), and what the last call returned."""

    seconds: list[float]
    result: Any

    @property
    def median(self) -> float:
        """The median of the calls: a call that another process interrupted does not move it."""
        return statistics.median(self.seconds)


def time_call(
    fn: Callable[[], Any],
    repeats: int = 1,
    *,
    warmup: int = 0,
    together: bool = False,
    device: Any = None,
) -> Timing:
    """``repeats`` calls of ``fn`` by the wall clock (time.perf_counter), after ``warmup``
    untimed ones.

    Each call is timed alone, or (``together``) all of them between two readings of the clock,
    for calls too short to time one by one: then one figure, their seconds per call. ``device``
    (a CUDA device, or anything torch.device takes): the clock is read only after the device
    has finished what was queued, before the first timed call and after each timed one (after
    the last, with ``together``), as a launch that returns before its kernels run would
    otherwise be timed short. A CPU device, or None, waits for nothing."""
    wait = _waiter(device)
    result = None
    for _ in range(warmup):
        result = fn()
    wait()
    if together:
        start = time.perf_counter()
        for _ in range(repeats):
            result = fn()
        wait()
        return Timing([(time.perf_counter() - start) / repeats], result)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        wait()
        seconds.append(time.perf_counter() - start)
    return Timing(seconds, result)


def _waiter(device: Any) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work: torch.cuda.synchronize on a CUDA
    device, nothing otherwise (decided once, outside the timed calls)."""
    if device is None:
        return lambda: None
    device = torch.device(device)
    if device.type != "cuda":
        return lambda: None
    return lambda: torch.cuda.synchronize(device)
