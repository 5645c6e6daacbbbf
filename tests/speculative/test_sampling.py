"""speculative.sampling: logits -> probabilities (temperature, top-k, top-p, greedy) and sampling.

Expected values are worked out by hand in the comments (logits chosen as logs of small
integers), or come from the plain-Python reference ``ref_warp`` (tests/support/toy_models.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative.sampling import Sampling, make_generator, sample, warp
from tests.support.toy_models import chi_square_pvalue, ref_warp

torch.set_num_threads(1)


def logits_of(*weights: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Logits whose softmax is weights / sum(weights)."""
    return torch.tensor([math.log(w) if w > 0 else -math.inf for w in weights], dtype=dtype)


def close(got: torch.Tensor, expected: list[float], tol: float = 1e-12) -> bool:
    return torch.allclose(got, torch.tensor(expected, dtype=got.dtype), atol=tol, rtol=0)


# ----------------------------------------------------------------------------- warp, by hand
def test_temperature_one_is_softmax() -> None:
    assert close(warp(logits_of(1, 2, 3), Sampling()), [1 / 6, 2 / 6, 3 / 6])


def test_temperature_sharpens_and_flattens() -> None:
    # logits log(1, 2, 3) / 0.5 -> weights 1, 4, 9; / 2 -> weights 1, sqrt 2, sqrt 3
    assert close(warp(logits_of(1, 2, 3), Sampling(temperature=0.5)), [1 / 14, 4 / 14, 9 / 14])
    s = 1 + math.sqrt(2) + math.sqrt(3)
    assert close(
        warp(logits_of(1, 2, 3), Sampling(temperature=2.0)),
        [1 / s, math.sqrt(2) / s, math.sqrt(3) / s],
    )


def test_temperature_zero_is_one_hot_argmax_first_on_ties() -> None:
    assert close(warp(logits_of(1, 3, 2), Sampling(temperature=0)), [0, 1, 0], tol=0)
    assert close(
        warp(torch.tensor([0.5, 2.0, 2.0, -1.0]), Sampling(temperature=0)), [0, 1, 0, 0], tol=0
    )


def test_a_temperature_too_small_to_divide_by_gives_its_limit_not_nan() -> None:
    """1e-300 overflowed logits / T to inf and softmax to NaN (a server request stopped the engine
    with it): the limit is greedy, ties sharing the mass."""
    for dtype in (torch.float32, torch.float64):
        tiny = Sampling(temperature=1e-300)
        assert close(warp(logits_of(1, 3, 2, dtype=dtype), tiny), [0, 1, 0], tol=0)
        assert close(
            warp(torch.tensor([0.5, 2.0, 2.0, -1.0], dtype=dtype), tiny), [0, 0.5, 0.5, 0], tol=0
        )
        assert close(
            warp(torch.tensor([[-3e38, 1.0], [1.0, 3e38]], dtype=dtype), tiny).flatten(),
            [0, 1, 0, 1],
            tol=0,
        )
        token = sample(
            warp(logits_of(1, 3, 2, dtype=dtype), tiny), torch.Generator().manual_seed(0)
        )
        assert int(token) == 1


def test_top_k() -> None:
    assert close(warp(logits_of(1, 2, 3), Sampling(top_k=2)), [0, 2 / 5, 3 / 5])
    assert close(warp(logits_of(1, 2, 3), Sampling(top_k=1)), [0, 0, 1])
    assert close(warp(logits_of(1, 2, 3), Sampling(top_k=3)), [1 / 6, 2 / 6, 3 / 6])
    # k > V keeps all
    assert close(warp(logits_of(1, 2, 3), Sampling(top_k=50)), [1 / 6, 2 / 6, 3 / 6])
    # ties with the k-th largest logit are kept (documented), as in transformers' TopKLogitsWarper
    assert close(warp(logits_of(2, 2, 1), Sampling(top_k=1)), [0.5, 0.5, 0])


def test_top_p() -> None:
    # probabilities .1 .2 .3 .4; descending .4 .3 .2 .1 with mass before each 0 .4 .7 .9
    p = logits_of(1, 2, 3, 4)
    assert close(warp(p, Sampling(top_p=0.35)), [0, 0, 0, 1])  # only .4 has mass-before < .35
    assert close(warp(p, Sampling(top_p=0.5)), [0, 0, 3 / 7, 4 / 7])
    assert close(warp(p, Sampling(top_p=0.75)), [0, 2 / 9, 3 / 9, 4 / 9])
    assert close(warp(p, Sampling(top_p=0.95)), [0.1, 0.2, 0.3, 0.4])
    assert close(warp(p, Sampling(top_p=1.0)), [0.1, 0.2, 0.3, 0.4])
    # the most likely token always survives
    assert close(warp(p, Sampling(top_p=1e-9)), [0, 0, 0, 1])


def test_order_is_temperature_then_top_k_then_top_p() -> None:
    # top_k=3 leaves .2 .3 .4 -> 2/9 3/9 4/9; top_p=.6: mass before 3/9 is 4/9 < .6 (kept), before 2/9 is 7/9
    assert close(warp(logits_of(1, 2, 3, 4), Sampling(top_k=3, top_p=0.6)), [0, 0, 3 / 7, 4 / 7])
    # temperature 0.5 squares the weights: 1 4 9 16 (/30). top_p=.5 keeps 16/30 (mass before it 0)
    # and drops 9/30 (mass before it 16/30 >= .5); top_p=.55 keeps 9/30 too (16/30 < .55)
    assert close(warp(logits_of(1, 2, 3, 4), Sampling(temperature=0.5, top_p=0.5)), [0, 0, 0, 1])
    assert close(
        warp(logits_of(1, 2, 3, 4), Sampling(temperature=0.5, top_p=0.55)), [0, 0, 9 / 25, 16 / 25]
    )


def test_minus_infinity_logits_get_probability_zero() -> None:
    got = warp(logits_of(0, 1, 0, 3), Sampling(temperature=0.7))
    assert got[0] == 0 and got[2] == 0 and got.sum().item() == pytest.approx(1, abs=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_and_shape_are_kept(dtype: torch.dtype) -> None:
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    for sampling in (Sampling(), Sampling(0), Sampling(0.8, 3, 0.9)):
        got = warp(logits, sampling)
        assert got.dtype == dtype and got.shape == logits.shape
        rows = torch.stack([warp(row, sampling) for row in logits.reshape(-1, 7)]).view_as(logits)
        assert torch.equal(got, rows)  # a batch of rows is warped row by row


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    logits=st.lists(st.floats(-6, 6), min_size=2, max_size=8),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.one_of(st.none(), st.integers(1, 8)),
    top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
)
def test_warp_matches_the_reference(
    logits: list[float], temperature: float, top_k: int | None, top_p: float | None
) -> None:
    """Against the plain-Python reference, away from top-p boundaries (where rounding decides)."""
    if top_p is not None:
        after_k = ref_warp(logits, temperature, top_k)
        masses = sorted(after_k, reverse=True)
        cumulative = [sum(masses[:i]) for i in range(len(masses))]
        if any(abs(c - top_p) < 1e-9 for c in cumulative):
            return
    got = warp(torch.tensor(logits, dtype=torch.float64), Sampling(temperature, top_k, top_p))
    assert close(got, ref_warp(logits, temperature, top_k, top_p))


# ----------------------------------------------------------------------------- sample
def test_sample_never_draws_a_zero_probability_token() -> None:
    gen = make_generator(torch.device("cpu"), 0)
    probs = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert all(int(sample(probs, gen)) == 1 for _ in range(200))
    probs = torch.tensor([[0.5, 0.0, 0.5], [0.0, 0.0, 1.0]])
    draws = torch.stack([sample(probs, gen) for _ in range(300)])
    assert draws.shape == (300, 2)
    assert set(draws[:, 0].tolist()) == {0, 2} and set(draws[:, 1].tolist()) == {2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_never_draws_a_masked_token_among_many(dtype: torch.dtype) -> None:
    """Top-k/top-p leave long runs of exact zeros between kept tokens; none may ever come out."""
    gen = make_generator(torch.device("cpu"), 3)
    weights = torch.rand(64, 2048, generator=gen, dtype=dtype)
    weights *= torch.rand(64, 2048, generator=gen) < 0.02  # about 40 kept tokens per row
    weights[:, 7] += 1e-3  # every row keeps at least one
    probs = weights / weights.sum(-1, keepdim=True)
    draws = torch.stack([sample(probs, gen) for _ in range(300)])  # 19,200 draws
    assert bool((probs.gather(-1, draws.T) > 0).all())


def test_sample_frequencies() -> None:
    gen = make_generator(torch.device("cpu"), 1)
    probs = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    draws = sample(probs.expand(20000, 3), gen).tolist()
    counts = {(k,): draws.count(k) for k in range(3)}
    assert chi_square_pvalue(counts, {(0,): 0.1, (1,): 0.2, (2,): 0.7}) > 1e-3
    wrong = {(0,): 0.12, (1,): 0.2, (2,): 0.68}
    assert chi_square_pvalue(counts, wrong) < 1e-3  # the test has the power to see a 2% shift


def test_generator_seeding() -> None:
    probs = torch.full((64, 10), 0.1)
    a = sample(probs, make_generator(torch.device("cpu"), 7))
    b = sample(probs, make_generator(torch.device("cpu"), 7))
    c = sample(probs, make_generator(torch.device("cpu"), None))
    d = sample(probs, make_generator(torch.device("cpu"), None))
    assert torch.equal(a, b)
    assert not torch.equal(c, d)  # 10^-64 chance of a false failure


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_invalid_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)
