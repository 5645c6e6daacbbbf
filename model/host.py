"""The host the code runs on, read in one place: its settings (environment variables, all named
``SPECULATIVE_...``) and a description of its CPU.

Settings: :func:`setting` reads a variable by its name, and by its old name for one release
(:data:`RENAMED`) with a FutureWarning, not a DeprecationWarning: whoever sets a variable runs a
script, and Python shows DeprecationWarning only to code run as ``__main__``.

The CPU: :func:`describe_cpu` is the one reader of ``/proc/cpuinfo`` (and, when asked, of
``lscpu``): the compiled-step cache keys its entries by it (model/fast/aot.py) and the
benchmarks print it (benchmarks/harness.py).
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "SPECULATIVE_"
# The new name of each renamed variable -> its old name, read until the release after 0.1.0.
RENAMED: dict[str, str] = {
    "SPECULATIVE_WEIGHTS": "SPECDEC_WEIGHTS",
    "SPECULATIVE_CACHE": "SPECULATIVE_LLAMA_CACHE",
    "SPECULATIVE_COMPILE_MODE": "SPECULATIVE_LLAMA_COMPILE_MODE",
}


def setting(name: str) -> str | None:
    """The value of environment variable ``name`` (one of ours: ``SPECULATIVE_...``), else of its
    old name with a FutureWarning that names the new one, else None. Empty counts as unset, as
    ``VAR= command`` means."""
    if not name.startswith(PREFIX):
        raise ValueError(f"the project's environment variables are named {PREFIX}..., not {name}")
    if os.environ.get(name):
        return os.environ[name]
    old = RENAMED.get(name)
    if old and os.environ.get(old):
        warnings.warn(
            f"${old} is deprecated: set ${name} instead (the old name is read until the next release)",
            FutureWarning,
            stacklevel=2,
        )
        return os.environ[old]
    return None


# ----------------------------------------------------------------------------- the CPU
@dataclass(frozen=True)
class CPU:
    """What is known of the CPU: its name, its instruction-set flags, and the fields it came from
    (the first processor's of /proc/cpuinfo; lscpu's, where asked for)."""

    name: str
    flags: tuple[str, ...]
    cpuinfo: Mapping[str, str] = field(default_factory=dict)
    lscpu: Mapping[str, str] = field(default_factory=dict)

    @property
    def native_bf16(self) -> bool:
        """Whether the CPU has bfloat16 arithmetic of its own (AVX512-BF16, AMX, or ARM's BF16): there
        a step bound by reading weights runs faster in bfloat16 than in float32, not emulated."""
        return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(self.flags))

    @property
    def ident(self) -> str:
        """Family, model and stepping (x86), for telling apart two parts of one name; else ""."""
        return ", ".join(
            f"{k} {self.cpuinfo[k]}"
            for k in ("cpu family", "model", "stepping")
            if k in self.cpuinfo
        )


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo's ``text`` (every processor repeats them)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


@functools.cache  # the file is a kernel table of every core: read once, the CPU does not change
def _cpuinfo() -> tuple[tuple[str, str], ...]:
    try:
        return tuple(parse_cpuinfo(Path("/proc/cpuinfo").read_text()).items())
    except OSError:  # not Linux
        return ()


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {
        key.strip(): value.strip()
        for key, _, value in (line.partition(":") for line in out.splitlines())
    }


@functools.cache  # the machine's caches do not change while it runs
def last_level_cache_bytes() -> int | None:
    """The size of the CPU's largest cache (the highest level of the first core's, from sysfs) in
    bytes; None where the system does not say (off Linux)."""
    sizes: dict[int, int] = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            value = _cache_bytes((index / "size").read_text().strip())
        except (OSError, ValueError, IndexError, KeyError):
            continue
        sizes[level] = max(sizes.get(level, 0), value)
    return sizes[max(sizes)] if sizes else None


def _cache_bytes(size: str) -> int:
    """A sysfs cache size ("48K", "2M", or a plain count) in bytes."""
    if size[-1] in "KMG":
        return int(size[:-1]) << {"K": 10, "M": 20, "G": 30}[size[-1]]
    return int(size)


def describe_cpu(lscpu: bool = False) -> CPU:
    """This machine's CPU from /proc/cpuinfo, and from lscpu too with ``lscpu`` (a subprocess: its
    caches and hypervisor, and the name and flags where /proc/cpuinfo has none). Off Linux, the
    name is Python's ``platform``'s and the flags are empty."""
    info = dict(_cpuinfo())
    ls = _lscpu() if lscpu else {}
    name = (
        info.get("model name") or ls.get("Model name") or platform.processor() or platform.machine()
    )
    flags = (
        info.get("flags") or info.get("Features") or ls.get("Flags") or ""
    ).split()  # Features: ARM
    return CPU(name, tuple(flags), info, ls)
