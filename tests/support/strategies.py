"""Shared pieces of the exactness tests: hypothesis strategies for distributions and decoding
settings; random n-gram tables with holes (toy_table) and the gap between two exact
distributions (max_gap) come from speculative/proofs/toys.py, which python -m speculative.prove uses
too. Written without the code under test (only speculative.sampling.Sampling, a plain settings
record, is imported)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from speculative.proofs.toys import max_gap, toy_table  # noqa: F401 -- the tests import them from here
from speculative.sampling import Sampling


def distribution(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


weight = st.one_of(st.just(0.0), st.floats(1e-9, 1.0), st.floats(0.5, 1.0))


@st.composite
def distribution_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q over 2..6 tokens: arbitrary, with zeros, equal, disjoint, or near one-hot."""
    vocab = draw(st.integers(2, 6))
    kind = draw(st.sampled_from(["any", "equal", "disjoint", "one-hot-ish"]))

    def weights() -> list[float]:
        w = draw(st.lists(weight, min_size=vocab, max_size=vocab))
        w[draw(st.integers(0, vocab - 1))] = draw(st.floats(0.1, 1.0))  # never all zero
        return w

    if kind == "equal":
        p = distribution(weights())
        return p, p.clone()
    if kind == "disjoint":
        cut = draw(st.integers(1, vocab - 1))
        w = weights()
        a = [x if i < cut else 0.0 for i, x in enumerate(w)]
        b = [x if i >= cut else 0.0 for i, x in enumerate(w)]
        a[0], b[-1] = max(a[0], 0.3), max(b[-1], 0.3)
        return distribution(a), distribution(b)
    if kind == "one-hot-ish":
        eps = draw(st.floats(1e-15, 1e-6))
        i, j = draw(st.integers(0, vocab - 1)), draw(st.integers(0, vocab - 1))
        a = [1.0 if k == i else eps for k in range(vocab)]
        b = [1.0 if k == j else eps * draw(st.floats(0.1, 10.0)) for k in range(vocab)]
        return distribution(a), distribution(b)
    return distribution(weights()), distribution(weights())


samplings = st.one_of(
    st.just(Sampling()),
    st.builds(Sampling, temperature=st.sampled_from([0.0, 0.5, 1.6])),
    st.builds(Sampling, temperature=st.sampled_from([0.7, 1.0]), top_k=st.integers(1, 3)),
    st.builds(
        Sampling, temperature=st.sampled_from([0.7, 1.0]), top_p=st.sampled_from([0.3, 0.61, 0.87])
    ),
    st.builds(Sampling, top_k=st.just(3), top_p=st.just(0.77)),
)
