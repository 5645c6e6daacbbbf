"""model/fast/progress.py: the lines a first --compile prints, driven by a clock the test holds."""

from __future__ import annotations

import threading

import pytest

from model.fast.progress import BuildProgress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_and_estimates_follow_the_clock():
    clock, lines = Clock(), []
    # never ticks by itself: the test calls tick()
    progress = BuildProgress(3, lines.append, clock=clock, every=3600)
    with progress.building("step A"):
        clock.now += 30
        progress.tick()
        clock.now += 30
    assert lines[0].startswith("building compiled step 1 of 3, the step A;")
    assert "estimated once one step is built" in lines[0]
    assert lines[1] == (
        "still building the step A: 30 s so far; time left estimated once one step is built"
    )
    assert lines[2] == "built the step A in 60 s (1 of 3)"
    with progress.building("step B"):
        assert progress.estimate() == (60.0 + 60.0, 60.0 + 60.0)
        clock.now += 20
        progress.tick()
        clock.now += 80  # slower than the first
    assert lines[4].endswith(
        "20 s so far; about 100 s left, at most 100 s at the slowest step's pace"
    )
    assert lines[5] == "built the step B in 100 s (2 of 3)"
    with progress.building("step C"):
        mean, longest = progress.estimate()
        assert (mean, longest) == (80.0, 100.0)
        clock.now += 200  # past every estimate: nothing left to say but 0
        assert progress.estimate() == (0.0, 0.0)
    assert progress.done == [60.0, 100.0, 200.0]


def test_lines_come_while_a_build_runs():
    """The ticker thread says a line every ``every`` seconds while the build blocks: the build below
    waits until two lines have come, whatever the machine's speed."""
    lines, two = [], threading.Event()

    def say(line: str) -> None:
        lines.append(line)
        if sum(line.startswith("still building") for line in lines) >= 2:
            two.set()

    progress = BuildProgress(1, say, every=0.01)
    with progress.building("step"):
        assert two.wait(60), lines
    assert lines[-1].startswith("built the step in")
    # the ticker stopped with the build (joined before the last line)
    assert not any(t.name == "compile-progress" for t in threading.enumerate())


def test_a_failed_build_says_no_built_line():
    lines = []
    progress = BuildProgress(1, lines.append, every=3600)
    with pytest.raises(RuntimeError), progress.building("step"):
        raise RuntimeError("the C++ compiler failed")
    assert not any(line.startswith("built") for line in lines)
