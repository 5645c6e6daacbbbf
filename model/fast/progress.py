"""What a first ``--compile`` says while it builds: a line as each step starts, and one every few
seconds while it builds, with the time left estimated from the steps already built.

Building one compiled step (model/fast/aot.py: export, Inductor, the C++ compiler) takes a minute or
more on a small CPU, and a run builds one per call shape; without these lines a first ``--compile``
is minutes of silence. The lines go to ``say`` (generate.py: stderr). The clock and the wait between
lines are parameters, so that a test drives them instead of the machine's speed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

EVERY_S = 10.0  # seconds between two lines while one step builds


class BuildProgress:
    """Progress of building ``total`` compiled steps, one after another."""

    def __init__(
        self,
        total: int,
        say: Callable[[str], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        every: float = EVERY_S,
    ) -> None:
        self.total = total
        self.say = say
        self.clock = clock
        self.every = every
        self.done: list[float] = []  # seconds each finished step took
        self.label = ""
        self.started = 0.0

    def estimate(self) -> tuple[float, float] | None:
        """(estimated, at most) seconds left, from the steps built so far; None before the first."""
        if not self.done:
            return None
        elapsed = self.clock() - self.started if self.label else 0.0
        left = self.total - len(self.done) - (1 if self.label else 0)
        mean, longest = sum(self.done) / len(self.done), max(self.done)
        return (
            max(mean - elapsed, 0.0) + left * mean,
            max(longest - elapsed, 0.0) + left * longest,
        )

    def _left(self) -> str:
        estimate = self.estimate()
        if estimate is None:
            return "time left estimated once one step is built"
        return f"about {estimate[0]:.0f} s left, at most {estimate[1]:.0f} s at the slowest step's pace"

    def tick(self) -> None:
        """One line on the step being built: how long so far and what is left."""
        elapsed = self.clock() - self.started
        self.say(f"still building the {self.label}: {elapsed:.0f} s so far; {self._left()}")

    @contextlib.contextmanager
    def building(self, label: str) -> Iterator[None]:
        """Around the build of one step: a line now, then one every ``every`` seconds until it ends."""
        self.label, self.started = label, self.clock()
        number = len(self.done) + 1
        self.say(f"building compiled step {number} of {self.total}, the {label}; {self._left()}")
        stop = threading.Event()

        def lines() -> None:
            while not stop.wait(self.every):
                self.tick()

        ticker = threading.Thread(target=lines, name="compile-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            self.done.append(self.clock() - self.started)
            self.label = ""
        self.say(f"built the {label} in {self.done[-1]:.0f} s ({number} of {self.total})")
