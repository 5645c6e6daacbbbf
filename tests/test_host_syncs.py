"""Device -> host reads per iteration of each loop, counted, so that the counts documented in
docs/compiled.md ("Host synchronisation") cannot drift.

Every read of a tensor's value on the host (``tolist``, ``item``, ``bool``, ``int``,
``float``) is a synchronisation on a GPU: the host waits for the device to finish. The
counts are taken by wrapping those methods of torch.Tensor for the duration of one call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from toy_models import noisy_copy, random_llama

from speculative import autoregressive_generate, speculative_generate, speculative_generate_batch

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
    target = random_llama(vocab=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=128)
    return target, noisy_copy(target, std=0.05, seed=1)


@pytest.mark.parametrize("temperature, per_iteration", [(0.0, 2), (1.0, 3)])
def test_chain(pair: tuple, temperature: float, per_iteration: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy: the non-finite check and one copy of argmaxes and drafts. Sampled: the check,
    the decisions and tokens, the overlaps (for alpha)."""
    out, reads = count_reads(lambda: speculative_generate(*pair, [1, 2, 3], 40, gamma=4, temperature=temperature,
                                                          seed=0), monkeypatch)
    assert reads == per_iteration * out.stats.target_calls


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batch(pair: tuple, temperature: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy: 2 per iteration whatever the batch size; sampled: 1 + 2 per row in the iteration."""
    out, reads = count_reads(lambda: speculative_generate_batch(*pair, [[1, 2, 3], [4, 5], [6]], 40, gamma=4,
                                                                temperature=temperature, seed=0), monkeypatch)
    stats = out.stats
    expected = 2 * stats.iterations if temperature == 0 else stats.iterations + 2 * stats.row_iterations
    assert reads == expected


@pytest.mark.parametrize("eos", [None, 15])
def test_target_alone(pair: tuple, eos: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without EOS (and no callback) the tokens stay on the device until the end: 2 reads in
    all; with EOS one read of the token and one of the non-finite check per step, and the
    final check of the flag kept on the device."""
    out, reads = count_reads(lambda: autoregressive_generate(pair[0], [1, 2, 3], 30, temperature=1.0, seed=0,
                                                             eos_id=eos), monkeypatch)
    assert reads == (2 if eos is None else 2 * out.stats.target_calls + 1)
