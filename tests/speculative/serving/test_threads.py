"""ThreadTuner: it keeps the faster thread count on a simulated CPU, finds the other one when a
neighbour comes or goes, and its probes cost little when nothing changes."""

from __future__ import annotations

import random

import pytest

from speculative.serving.threads import ThreadTuner, ladder

ALONE = {2: 1.0, 1: 1.6}  # seconds of one iteration by thread count: two threads win alone
NEIGHBOUR = {2: 10.0, 1: 1.1}  # ... and lose by far when another process holds a core


class Cpu:
    """A simulated engine thread: the tuner sets its count, each iteration costs what the
    current conditions say for that count, with 5% noise."""

    def __init__(self, conditions: dict[int, float], seed: int = 0) -> None:
        self.conditions, self.threads, self.random = conditions, 2, random.Random(seed)
        self.spent = self.all_threads = 0.0  # seconds taken, and what 2 threads would have taken

    def set(self, threads: int) -> None:
        self.threads = threads

    def iterate(
        self,
        tuner: ThreadTuner,
        times: int,
        shape: tuple[int, int] | None = (1, 4),
        noise: float = 0.05,
    ) -> None:
        """``times`` iterations of ``shape``, or (None) of a busy server's changing shapes: 6 to 8
        rows, gamma 3 to 5, each costing in proportion to its tokens."""
        for _ in range(times):
            at = shape or (self.random.randint(6, 8), self.random.randint(3, 5))
            scale = self.random.uniform(1 - noise, 1 + noise) * (
                at[0] * (at[1] + 1) / 5 if shape is None else 1
            )
            seconds = self.conditions[self.threads] * scale
            self.all_threads += self.conditions[2] * scale
            self.spent += seconds
            tuner.observe(at, seconds)


def test_the_ladder_holds_all_cores_one_fewer_half_and_one() -> None:
    assert ladder(1) == [1]
    assert ladder(2) == [1, 2]
    assert ladder(16) == [1, 8, 15, 16]


def test_alone_it_keeps_every_thread_and_its_probes_cost_under_one_per_cent() -> None:
    cpu = Cpu(ALONE)
    tuner = ThreadTuner(2, cpu.set)
    cpu.iterate(tuner, 5000)
    assert tuner.threads == 2 and tuner.switches == 0
    assert tuner.probes >= 5  # it did look
    assert cpu.spent / (5000 * ALONE[2]) < 1.01


def test_a_neighbour_moves_it_to_one_thread_within_a_few_iterations_and_its_leaving_moves_it_back() -> (
    None
):
    cpu = Cpu(ALONE)
    tuner = ThreadTuner(2, cpu.set)
    cpu.iterate(tuner, 2000)
    cpu.conditions = NEIGHBOUR
    cpu.iterate(tuner, 20)
    assert tuner.threads == 1 and cpu.threads == 1
    spent = cpu.spent
    cpu.iterate(tuner, 5000)  # with the neighbour: within 5% of one thread all along
    assert (cpu.spent - spent) / (5000 * NEIGHBOUR[1]) < 1.05
    cpu.conditions = ALONE
    cpu.iterate(tuner, 2 * tuner.longest_gap + 50)
    assert tuner.threads == 2 and cpu.threads == 2


@pytest.mark.parametrize("seed", range(5))
def test_under_changing_shapes_and_noise_it_holds_its_choice_and_still_finds_the_neighbour(
    seed: int,
) -> None:
    cpu = Cpu({2: 1.0, 1: 1.3}, seed)  # two threads 30% faster alone: a close call under 25% noise
    tuner = ThreadTuner(2, cpu.set)
    cpu.iterate(tuner, 4000, None, noise=0.25)
    assert tuner.threads == 2 and tuner.switches == 0
    assert cpu.spent / cpu.all_threads < 1.03
    cpu.conditions = NEIGHBOUR
    cpu.iterate(tuner, 100, None, noise=0.25)
    assert tuner.threads == 1


def test_shapes_are_compared_with_their_own_kind() -> None:
    """Iterations of 8 rows cost more than those of 1 whatever the count: alternating them must
    not read as one count being faster."""
    cpu = Cpu(ALONE)
    tuner = ThreadTuner(2, cpu.set)
    for _ in range(1000):
        cpu.iterate(tuner, 1, (1, 4))
        cpu.conditions = {t: 8 * s for t, s in ALONE.items()}
        cpu.iterate(tuner, 1, (8, 4))
        cpu.conditions = ALONE
    assert tuner.threads == 2 and tuner.switches == 0


@pytest.mark.parametrize("most", [1])
def test_one_core_has_nothing_to_choose(most: int) -> None:
    calls: list[int] = []
    tuner = ThreadTuner(most, calls.append)
    for _ in range(100):
        tuner.observe((1, 4), 1.0)
    assert not tuner.active and calls == []


def test_the_openmp_setter_changes_this_thread_s_operator_threads() -> None:
    """serve.py's setter changes the count torch's operators use in the calling thread (checked
    in a thread of its own, whose OpenMP settings are its own)."""
    import threading

    import torch

    from speculative.serving.threads import openmp_threads

    seen: list[int] = []

    def probe() -> None:
        apply = openmp_threads()
        apply(1)
        seen.append(torch.get_num_threads())
        apply(2)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join(30)
    assert seen == [1, 2]
