"""Device -> host reads per iteration of each loop, counted, so that the counts documented in
docs/compiled.md ("Host synchronisation") cannot drift.

Every read of a tensor's value on the host (``tolist``, ``item``, ``bool``, ``int``,
``float``) is a synchronisation on a GPU: the host waits for the device to finish. The
counts are taken by wrapping those methods of torch.Tensor for the duration of one call.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from speculative import (
    NonFiniteLogitsError,
    autoregressive_generate,
    autoregressive_generate_batch,
    speculative_generate,
    speculative_generate_batch,
)
from speculative.engine.gamma import AutoGamma
from speculative.engine.stats import Clock
from speculative.inputs import read_host
from tests.support.toy_models import noisy_copy, random_llama

torch.set_num_threads(1)
READS = ("tolist", "item", "__bool__", "__int__", "__float__")


def count_reads(fn: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, int]:
    counts: Counter = Counter()
    for name in READS:
        real = getattr(torch.Tensor, name)

        def wrapped(self, *args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    try:
        out = fn()
    finally:
        monkeypatch.undo()
    return out, sum(counts.values())


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = random_llama(
        vocab=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=128
    )
    return target, noisy_copy(target, std=0.05, seed=1)


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chain(
    pair: tuple, temperature: float, verify: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One read per iteration, greedy or sampled, either verifier: the verification's copy of
    its outcome (decisions, tokens, overlaps) carries the non-finite check of the logits."""
    out, reads = count_reads(
        lambda: speculative_generate(
            *pair, [1, 2, 3], 40, gamma=4, temperature=temperature, seed=0, verify=verify
        ),
        monkeypatch,
    )
    assert reads == out.stats.target_calls


@pytest.mark.parametrize(
    "temperature, mode", [(0.0, "deterministic"), (1.0, "deterministic"), (1.0, "iid")]
)
def test_tree(pair: tuple, temperature: float, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token tree: the walk's one copy (with the check) per iteration, and nothing more: the
    accepted path is moved into place in the cache from host lists, which the model checks on
    the host, and the tree's call (model.call.tree) is built from host lists too, each
    token seeing at least itself, so no call's mask is read back (the old explicit-mask call
    read the first call's mask once per run). (Drawing children without replacement adds a
    read per level: which draws were possible decides the tree's shape on the host.)"""
    moved = []
    real = type(pair[0]).move_cache

    def move_cache(self, rows, src=None, dst=None, upto=None):
        moved.append((rows, src, dst))
        return real(self, rows, src, dst, upto)

    monkeypatch.setattr(type(pair[0]), "move_cache", move_cache)
    out, reads = count_reads(
        lambda: speculative_generate(
            *pair, [1, 2, 3], 40, temperature=temperature, seed=0, tree=(2, 2, 1), tree_mode=mode
        ),
        monkeypatch,
    )
    assert reads == out.stats.target_calls
    # host lists: the model checks them without a read
    assert moved and all(
        isinstance(rows, list) and all(isinstance(slots, list) for slots in src + dst)
        for rows, src, dst in moved
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batch(pair: tuple, temperature: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """1 per iteration whatever the batch size, greedy or sampled: every row's verdict (its
    verifier's device tensors) and the check travel in one copy."""
    out, reads = count_reads(
        lambda: speculative_generate_batch(
            *pair, [[1, 2, 3], [4, 5], [6]], 40, gamma=4, temperature=temperature, seed=0
        ),
        monkeypatch,
    )
    assert reads == out.stats.iterations < out.stats.row_iterations


@pytest.mark.parametrize("eos", [None, 15])
def test_target_alone(pair: tuple, eos: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without EOS (and no callback) the tokens stay on the device until the end: ONE read in
    all, of the tokens and the non-finite flag kept on the device; with EOS one read per step,
    of the token and the check together."""
    out, reads = count_reads(
        lambda: autoregressive_generate(
            pair[0], [1, 2, 3], 30, temperature=1.0, seed=0, eos_id=eos
        ),
        monkeypatch,
    )
    assert reads == (1 if eos is None else out.stats.target_calls)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_target_alone_batched_reads_when_the_rows_change(
    pair: tuple, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched baseline reads its tokens only when a row leaves: two rows finish together,
    the third takes a place (one read), and it finishes (one more), out of 60 calls."""
    out, reads = count_reads(
        lambda: autoregressive_generate_batch(
            pair[0], [[1, 2], [3], [4, 5, 6]], 30, temperature=temperature, seed=0, batch_size=2
        ),
        monkeypatch,
    )
    assert reads == 2 and out.stats.iterations == 60


@pytest.fixture(scope="module")
def broken_pair(pair: tuple) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The target with NaN in its last norm: every logit NaN. The draft is fine."""
    target = copy.deepcopy(pair[0])
    with torch.no_grad():
        target.norm.weight[0] = float("nan")
    return target, pair[1]


RUNS = {
    "chain-greedy": lambda t, d: speculative_generate(t, d, [1, 2, 3], 20, temperature=0.0),
    "chain-token": lambda t, d: speculative_generate(t, d, [1, 2, 3], 20, temperature=1.0, seed=0),
    "chain-block": lambda t, d: speculative_generate(
        t, d, [1, 2, 3], 20, temperature=1.0, seed=0, verify="block"
    ),
    "tree-greedy": lambda t, d: speculative_generate(
        t, d, [1, 2, 3], 20, temperature=0.0, tree=(2, 1)
    ),
    "tree-sampled": lambda t, d: speculative_generate(
        t, d, [1, 2, 3], 20, temperature=1.0, seed=0, tree=(2, 1)
    ),
    "batch-greedy": lambda t, d: speculative_generate_batch(
        t, d, [[1, 2], [3]], 20, temperature=0.0
    ),
    "batch-sampled": lambda t, d: speculative_generate_batch(
        t, d, [[1, 2], [3]], 20, temperature=1.0, seed=0
    ),
    "alone-per-token": lambda t, d: autoregressive_generate(
        t, [1, 2, 3], 20, temperature=1.0, seed=0, eos_id=15
    ),
    "alone-deferred": lambda t, d: autoregressive_generate(
        t, [1, 2, 3], 20, temperature=1.0, seed=0
    ),
}


@pytest.mark.parametrize("run", RUNS)
def test_the_check_that_rides_in_the_copies_still_stops_nan_logits(
    broken_pair: tuple, run: str
) -> None:
    """The non-finite check has no read of its own any more: it must still fire in every loop."""
    with pytest.raises(NonFiniteLogitsError):
        RUNS[run](*broken_pair)


def test_read_host_one_copy_ints_floats_and_the_flag() -> None:
    ints, floats, flags = read_host(
        [torch.tensor([3, 128255]), torch.tensor([0.25, 1.0]), torch.tensor([True, False])],
        torch.tensor(True),
    )
    assert ints == [3, 128255] and floats == [0.25, 1.0] and flags == [1, 0]
    assert all(isinstance(v, int) for v in ints + flags)
    with pytest.raises(NonFiniteLogitsError):
        read_host([torch.tensor([1])], torch.tensor(False))


# ----------------------------------------------------------------------------- timing without waiting
class FakeEvent:
    """torch.cuda.Event on a CPU, as CUDA behaves: an event is complete once the host has waited
    for the device after it was recorded (a read of a tensor's value, or a synchronize), and
    elapsed_time of an incomplete event raises, as cudaEventElapsedTime does."""

    recorded: list[FakeEvent] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.time, self.complete = None, False

    def record(self) -> None:
        self.time = time.perf_counter()
        FakeEvent.recorded.append(self)

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.complete and end.complete):
            raise RuntimeError(
                "CUDA error: device not ready (an event the host has not waited for)"
            )
        return (end.time - self.time) * 1000

    @staticmethod
    def wait_for_device() -> None:
        for event in FakeEvent.recorded:
            event.complete = True


def count_waits(fn: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, int, int]:
    """(result, host reads, synchronizations) of fn() run as if on CUDA: the loops' Clock takes
    (fake) events, every read completes the events recorded before it, as a GPU's copy would."""
    counts: Counter = Counter()
    FakeEvent.recorded = []
    for name in READS:
        real = getattr(torch.Tensor, name)

        def wrapped(self, *args, _real=real, **kwargs):
            counts["reads"] += 1
            FakeEvent.wait_for_device()
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)

    def synchronize(*args: Any) -> None:
        counts["syncs"] += 1
        FakeEvent.wait_for_device()

    def as_if_cuda(self: Clock, device: torch.device) -> None:
        self.events, self.queued = True, []

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(Clock, "__init__", as_if_cuda)
    try:
        out = fn()
    finally:
        monkeypatch.undo()
    return out, counts["reads"], counts["syncs"]


TIMED = {
    "chain-greedy": lambda t, d: speculative_generate(t, d, [1, 2, 3], 30, temperature=0.0),
    "chain-auto-gamma": lambda t, d: speculative_generate(
        t, d, [1, 2, 3], 30, gamma="auto", temperature=1.0, seed=0
    ),
    "tree-sampled": lambda t, d: speculative_generate(
        t, d, [1, 2, 3], 30, temperature=1.0, seed=0, tree=(2, 1)
    ),
    "batch-greedy": lambda t, d: speculative_generate_batch(
        t, d, [[1, 2], [3], [4, 5, 6]], 30, temperature=0.0, batch_size=2
    ),
    "batch-auto-gamma": lambda t, d: speculative_generate_batch(
        t, d, [[1, 2], [3]], 30, gamma="auto", temperature=1.0, seed=0
    ),
    "alone-batch": lambda t, d: autoregressive_generate_batch(
        t, [[1, 2], [3]], 30, temperature=1.0, seed=0
    ),
    "alone-deferred": lambda t, d: autoregressive_generate(
        t, [1, 2, 3], 30, temperature=1.0, seed=0
    ),
    "alone-per-token": lambda t, d: autoregressive_generate(
        t, [1, 2, 3], 30, temperature=1.0, seed=0, eos_id=15
    ),
}


@pytest.mark.parametrize("run", TIMED)
def test_timing_never_waits_for_the_device(
    pair: tuple, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the loops time with events: no synchronize inside the loop, one after it (to
    sum the durations that end after the last read), and no duration read before the device
    passed both its marks (the fake event raises then, as CUDA does). The host reads are the
    counts above, unchanged."""
    real = AutoGamma.update

    def fixed_times(self, overlaps, draft_step_s, target_call_s, **kwargs):
        if draft_step_s is not None and target_call_s is not None:
            real(self, overlaps, 1e-3, 1e-2, **kwargs)
        else:
            real(self, overlaps, None, None, **kwargs)

    real_observe = AutoGamma._observe

    def fixed_iterations(self, iteration, gamma, seconds, tokens):  # every whole iteration 10 ms
        real_observe(self, iteration, gamma, 1e-2, tokens)

    # gamma="auto" chooses from the times it measures (its calls' and its whole iterations'): fixed
    # times, so that both runs choose the same gammas (and make the same reads) however fast the
    # machine is at the moment; each count undoes every patch when it returns, so the times are fixed
    # again for the second
    for count in (count_waits, count_reads):
        monkeypatch.setattr(AutoGamma, "update", fixed_times)
        monkeypatch.setattr(AutoGamma, "_observe", fixed_iterations)
        if count is count_waits:
            out, reads, syncs = count(lambda: TIMED[run](*pair), monkeypatch)
        else:
            _, plain_reads = count(lambda: TIMED[run](*pair), monkeypatch)
    assert syncs == 1 and reads == plain_reads
    stats = out.stats
    assert stats.decode_time_s > 0 if hasattr(stats, "decode_time_s") else stats.target_time_s > 0
    if hasattr(stats, "draft_time_s"):
        assert 0 < stats.draft_time_s + stats.target_time_s <= stats.decode_time_s


def test_a_clock_that_synchronizes_is_counted(pair: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The count can fail: the old clock (synchronize, then perf_counter) at every mark."""

    def waiting_mark(self: Clock) -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    with monkeypatch.context() as patch:
        patch.setattr(Clock, "mark", waiting_mark)
        patch.setattr(Clock, "seconds", lambda self, start, end: end - start)
        patch.setattr(Clock, "settle", lambda self: None)
        out, _, syncs = count_waits(lambda: TIMED["chain-greedy"](*pair), patch)
    assert syncs >= 3 * out.stats.target_calls
