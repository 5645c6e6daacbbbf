"""benchmarks/widths.py, "a call by its width", without timing anything: each subject's defaults
and the options it reads, the bounds of the command line, and the layers the matmul subject
times (the same products as PyTorch's default)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks import widths


def test_each_subject_gets_its_defaults() -> None:
    for subject, defaults in widths.DEFAULTS.items():
        args = widths.parse(["--subject", subject])
        for option, value in defaults.items():
            assert getattr(args, option) == value, (subject, option)
    assert widths.parse(["--subject", "setups", "--widths", "1", "5"]).widths == [1, 5]
    assert set(widths.DEFAULTS) == set(widths.SUBJECTS) == set(widths.TITLES)


@pytest.mark.parametrize(
    "argv",
    [
        ["--subject", "matmul", "--rounds", "3"],  # matmul takes no rounds
        ["--subject", "draft", "--draft", "tiny-draft"],  # only pair reads --draft
        ["--subject", "pair", "--compiled", "4"],  # only setups reads --compiled
        ["--subject", "setups", "--dtypes", "int8"],  # a whole target: float32 or bfloat16
        ["--subject", "setups", "--widths", "0"],
        ["--subject", "setups", "--widths", "65"],
        ["--subject", "pair", "--rounds", "0"],
        ["--subject", "matmul", "--threads", "0"],
        [],  # the subject is required
    ],
)
def test_what_a_subject_does_not_read_is_an_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        widths.parse(argv)
    assert exit_.value.code == 2


def test_the_matmul_layers_compute_the_default_product() -> None:
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(1))
    plain, packed = widths.layers("float32", weight)
    torch.testing.assert_close(plain(x), F.linear(x, weight))
    if packed is not None:  # where oneDNN prepacks float32 on this CPU
        torch.testing.assert_close(packed(x), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    q8, kernel = widths.layers("int8", weight)
    torch.testing.assert_close(
        kernel(x).reshape(1, 5, 64), q8(x).reshape(1, 5, 64), rtol=1e-3, atol=1e-3
    )
    q4, none = widths.layers("int4", weight)
    assert none is None and q4(x).shape == (1, 5, 64)
