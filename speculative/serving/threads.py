"""How many threads the engine's operators use, chosen by measuring them while serving.

PyTorch's CPU operators run an OpenMP team of ``torch.get_num_threads()`` threads, which wait
for each other at the end of every parallel region. When another process takes one of the
cores (a sidecar, a load generator, a monitor), the team's slowest thread is the one that lost
its core, and every region waits for the scheduler to give it back: on two cores a decode step
can take ten times as long with two threads as with one. Alone, the same two threads are the
faster choice. Neither can be known at start-up, so :class:`ThreadTuner` measures.

It watches the seconds of every comparable iteration (no prompt read in it), keyed by its
shape (rows, gamma). Now and then (after 32 iterations, then twice as long each time the
choice is confirmed, at most every ``longest_gap``; and a smaller count at once when the
current count's times rise well above their usual) it *probes* a neighbouring
count on its ladder for a few iterations and compares the probe's times with the current
count's recent times at the same shapes. A probe that is clearly slower ends at its second
iteration (the first pays for the change itself), so probing the wrong count costs about two
slow iterations; a probe that is faster by ``margin`` becomes the choice.
"""

from __future__ import annotations

import ctypes
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path

Shape = tuple[int, int]  # (rows in the iteration, gamma)


def openmp_threads() -> Callable[[int], None]:
    """The function that sets the operators' thread count in the calling thread: omp_set_num_threads
    of the OpenMP runtime torch's operators use (of those this process loaded, in
    /proc/self/maps, the one whose setting torch.get_num_threads() then reports: other
    packages bring their own, sentencepiece for one), else torch.set_num_threads.
    torch.set_num_threads also turns MKL's choice of fewer threads for small products off for
    good and clears oneDNN's primitive cache: after it, batches of 8 rows decoded 9-10% slower
    on the machine of docs/serving.md, even at the same count."""
    import torch

    maps = Path("/proc/self/maps")
    paths = {line.split()[-1] for line in maps.read_text().splitlines()} if maps.exists() else set()
    now = torch.get_num_threads()
    other = 2 if now == 1 else 1
    for path in sorted(
        p for p in paths if any(name in Path(p).name for name in ("libgomp", "libiomp", "libomp"))
    ):
        try:
            apply = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        apply(other)
        works = torch.get_num_threads() == other
        apply(now)
        if works:
            return apply
    return torch.set_num_threads


def ladder(most: int) -> list[int]:
    """The counts worth trying on ``most`` cores: all of them, one fewer (a neighbour on one
    core), half, and one."""
    return sorted({most, max(1, most - 1), max(1, most // 2), 1})


class ThreadTuner:
    """Chooses the thread count among ``ladder(most)``; ``apply(n)`` sets it (in the thread
    that runs the operators: OpenMP's count is a per-thread setting). :meth:`observe` is
    called after every comparable iteration."""

    def __init__(
        self,
        most: int,
        apply: Callable[[int], None],
        *,
        window: int = 5,
        first_gap: int = 32,
        longest_gap: int = 1024,
        margin: float = 0.8,
        abort: float = 2.0,
        drift: float = 1.5,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:
        if most < 1:
            raise ValueError(f"most must be >= 1, got {most}")
        self.counts = ladder(most)
        self.apply = apply
        self.log = log
        self.threads = most
        self.window = window
        self.first_gap = first_gap
        self.longest_gap = longest_gap
        self.margin = margin
        self.abort = abort
        self.drift = drift
        self.clock = 0  # iterations observed
        # a time older than this many iterations is not compared with a probe's
        self.fresh = 8 * window
        # the current count's latest (clock, time) by shape
        self.recent: dict[Shape, deque[tuple[int, float]]] = {}
        self.usual: dict[Shape, float] = {}  # a slow average of this count's times by shape
        self.gap = first_gap  # iterations before the next probe (doubles after a vain one)
        self.since = 0  # iterations since the last probe ended
        self.probing: int | None = None
        self.ratios: list[float] = []  # probe time / current count's recent median, same shape
        self.probe_iterations = 0
        self.turn = 0  # which neighbour on the ladder the next probe tries
        self.switches = 0
        self.probes = 0

    @property
    def active(self) -> bool:
        return len(self.counts) > 1

    def observe(self, shape: Shape, seconds: float) -> None:
        if not self.active or seconds <= 0:
            return
        self.clock += 1
        if self.probing is not None:
            self.probe_iterations += 1
            times = [t for c, t in self.recent.get(shape, ()) if self.clock - c <= self.fresh]
            # The first iteration after a change of count pays for the change (the team's threads
            # wake or park): it says nothing about the count.
            if self.probe_iterations > 1 and len(times) >= 2:
                self.ratios.append(seconds / statistics.median(times))
            if (
                (self.ratios and self.ratios[-1] > self.abort)
                or len(self.ratios) >= self.window
                or self.probe_iterations > 2 * self.window
            ):
                self.conclude()
            return
        times = self.recent.setdefault(shape, deque(maxlen=self.window))
        times.append((self.clock, seconds))
        self.since += 1
        usual = self.usual.setdefault(shape, seconds)
        self.usual[shape] = usual + (seconds - usual) / (4 * self.window)
        if (
            len(times) == self.window
            and self.since >= self.first_gap
            and self.threads > self.counts[0]
            and statistics.median(t for _, t in times) > self.drift * usual
        ):
            # Well above this count's usual times for a while: something else runs now, so fewer
            # threads may be faster: try them at once.
            self.usual[shape] = statistics.median(t for _, t in times)
            self.start_probe(fewer=True)
        elif self.since >= self.gap:
            self.start_probe()

    def start_probe(self, fewer: bool = False) -> None:
        at = self.counts.index(self.threads)
        neighbours = [self.counts[i] for i in (at - 1, at + 1) if 0 <= i < len(self.counts)]
        self.probing = neighbours[0] if fewer else neighbours[self.turn % len(neighbours)]
        self.turn += not fewer
        self.probes += 1
        self.ratios = []
        self.probe_iterations = 0
        self.apply(self.probing)

    def conclude(self) -> None:
        better = len(self.ratios) >= self.window and statistics.median(self.ratios) < self.margin
        if better:  # the probed count is the choice; its own times start afresh
            self.log(
                f"threads: {self.probing} now (they measured {statistics.median(self.ratios):.2f} times the "
                f"time of {self.threads})"
            )
            self.threads = self.probing
            self.recent = {}
            self.usual = {}
            self.gap = self.first_gap
            self.switches += 1
        else:
            self.apply(self.threads)
            self.gap = min(2 * self.gap, self.longest_gap)
        self.probing = None
        self.since = 0


__all__ = ["ThreadTuner", "ladder"]
