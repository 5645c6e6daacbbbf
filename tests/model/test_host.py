"""The host, read in one place (model/host.py): every environment variable named SPECULATIVE_...,
each renamed one still read by its old name for one release with a warning, and one description
of the CPU, which the compiled-step cache keys its entries by."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model.fast.aot import device_name
from model.fast.compile import MODE_ENV, default_mode
from model.host import PREFIX, RENAMED, describe_cpu, parse_cpuinfo, setting
from tests.support.toy_models import random_llama
from weights.registry import ENV_VAR, search_dirs
from weights.step_cache import ENV, default_dir


@pytest.fixture(autouse=True)
def unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for new, old in RENAMED.items():
        monkeypatch.delenv(new, raising=False)
        monkeypatch.delenv(old, raising=False)


@pytest.mark.parametrize("new", sorted(RENAMED))
def test_the_old_name_still_works_and_warns(new: str, monkeypatch: pytest.MonkeyPatch) -> None:
    old = RENAMED[new]
    assert new.startswith(PREFIX) and setting(new) is None
    monkeypatch.setenv(old, "from-the-old-name")
    with pytest.warns(FutureWarning, match=rf"\${old} is deprecated: set \${new} instead"):
        assert setting(new) == "from-the-old-name"
    monkeypatch.setenv(new, "from-the-new-name")
    with warnings.catch_warnings():
        # the new name set: read first, and nothing said of the old one
        warnings.simplefilter("error")
        assert setting(new) == "from-the-new-name"
    monkeypatch.setenv(new, "")  # empty is unset, as `VAR= command` means
    with pytest.warns(FutureWarning):
        assert setting(new) == "from-the-old-name"


def test_a_variable_of_another_prefix_is_refused() -> None:
    with pytest.raises(ValueError, match="SPECULATIVE_"):
        setting("SPECDEC_WEIGHTS")


READERS: dict[
    str, Callable[[str], bool]
] = {  # each reader of a renamed variable: whether it took ``value``
    ENV_VAR: lambda value: Path(value) in search_dirs(),
    ENV: lambda value: default_dir() == Path(value),
    MODE_ENV: lambda value: (
        default_mode(
            random_llama(
                vocab=8, dim=8, n_layers=1, n_heads=1, n_kv_heads=1, hidden_dim=8, max_seq_len=8
            )
        )
        == value
    ),
}


def test_every_renamed_variable_has_a_reader() -> None:
    assert set(READERS) == set(RENAMED)


@pytest.mark.parametrize("new", sorted(READERS))
def test_each_reader_takes_both_names(
    new: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    value = "default" if new == MODE_ENV else str(tmp_path)
    monkeypatch.setenv(RENAMED[new], value)
    with pytest.warns(FutureWarning, match=new):
        assert READERS[new](value)
    monkeypatch.delenv(RENAMED[new])
    monkeypatch.setenv(new, value)
    assert READERS[new](value)


X86 = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
stepping\t: 8
flags\t\t: fpu avx2 avx512f amx_tile
vmx flags\t: vnmi

processor\t: 1
model name\t: another part
flags\t\t: fpu
"""
ARM = """
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd sve
CPU implementer\t: 0x41

processor\t: 1
Features\t: fp
"""


def test_cpuinfo_is_read_for_its_first_processor() -> None:
    x86 = parse_cpuinfo(X86)
    assert (
        x86["model name"] == "Intel(R) Xeon(R) Platinum 8480+"
        and x86["flags"] == "fpu avx2 avx512f amx_tile"
    )
    assert x86["vmx flags"] == "vnmi" and x86["model"] == "143"
    arm = parse_cpuinfo(ARM)  # a blank line before the first processor is not its end
    assert arm["Features"] == "fp asimd sve" and "model name" not in arm


def test_the_cache_keys_entries_by_the_one_description() -> None:
    cpu = describe_cpu()
    assert cpu.name and device_name(torch.device("cpu")).startswith(f"{cpu.name} ")
    if Path("/proc/cpuinfo").exists():
        assert cpu.flags and cpu.cpuinfo
    # lscpu is a subprocess: run only when asked (the benchmarks' pages)
    assert describe_cpu().lscpu == {}


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ("fpu avx2 avx512f avx512_bf16", True),
        ("fpu avx512f amx_bf16", True),
        ("fp asimd bf16", True),
        ("fpu avx2 avx512f avx512bw", False),
        ("", False),
    ],
)
def test_native_bfloat16_is_read_from_the_flags(flags: str, native: bool) -> None:
    """AVX512-BF16, AMX-BF16 (x86) and ARM's BF16 compute bfloat16; AVX-512 without them only emulates it."""
    from model.host import CPU

    assert CPU("some cpu", tuple(flags.split())).native_bf16 is native
