"""How a 4-bit GGUF file is read when the command line does not say: its own codes, or floats.

A file stored as Q4_0 or Q4_1 is run by llama.cpp on its codes, an eighth of float32's bytes. Here the
same codes go through torch's int4 kernel (model/scale/codes.py), which is fast where the CPU computes
bfloat16 natively and may be slower than float32 elsewhere. So the default is measured, not assumed:
one pass over every 4-bit matrix of the file, as float32 floats and as codes through the int4 kernel in
float32 and in bfloat16, the fastest kept. The pass reads the matrices from memory, as a decode step
does, rather than timing one matrix that stays in the cache.

The answer is recorded once per machine, thread count and file shape (weights/step_cache.py's
``readings.json``), so that later runs start at once and decode alike: a choice remade at every start
would let timing noise pick between readings whose greedy outputs may differ at a near-tie.
``--quantize file`` and ``--quantize none`` choose by name.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from model.fast.setup import machine
from model.fast.timing import time_call
from model.scale.codes import GroupCodes, dequantize, int4_layer
from model.scale.quantize import INT4_DTYPES
from weights.checkpoint import CheckpointError, gguf_file
from weights.gguf import is_gguf
from weights.registry import UnknownCheckpointError, resolve

READINGS = "readings.json"
# (name, quantize, dtype) of every reading timed
CANDIDATES = (
    ("float32 floats", None, torch.float32),
    ("float32 codes", "file", torch.float32),
    ("bfloat16 codes", "file", torch.bfloat16),
)


@dataclass(frozen=True)
class Reading:
    """How to read the file: ``quantize`` (None or "file") and the dtype to compute in, with the
    seconds each candidate took for one pass (``timings``) and whether they were recorded before."""

    quantize: str | None
    dtype: torch.dtype
    timings: dict[str, float]
    recorded: bool

    def note(self) -> str:
        name = next(n for n, q, d in CANDIDATES if q == self.quantize and d == self.dtype)
        how = "as measured once on this machine" if self.recorded else "measured now, and recorded"
        return (
            f"the 4-bit file is read as {name} ({how}; --quantize none reads it as float32, "
            "--quantize file keeps its codes)"
        )


def gguf_of(target: str | os.PathLike) -> Any:
    """The opened GGUF file of ``target`` (weights.gguf.GGUFFile), or None for any other checkpoint."""
    try:
        path = resolve(target)
    except (UnknownCheckpointError, CheckpointError, OSError):
        return None
    return gguf_file(Path(path)) if is_gguf(path) else None


def four_bit_codes(file: Any) -> list[GroupCodes]:
    """The block matrices ``file`` (a GGUFFile) stores as 4-bit codes, decoded."""
    return list(file.codes(file.four_bit_shapes()).values())


def time_pass(codes: list[GroupCodes], quantize: str | None, dtype: torch.dtype) -> float:
    """Seconds of one product through every matrix at one row (the median of a few passes)."""
    if quantize == "file":
        layers = [int4_layer(c, dtype) for c in codes]
    else:
        weights = [dequantize(c, dtype) for c in codes]
        layers = [lambda x, w=w: F.linear(x, w) for w in weights]
    inputs = {c.shape[1]: torch.randn(1, c.shape[1], dtype=dtype) for c in codes}

    def one_pass() -> None:
        for layer, c in zip(layers, codes):
            layer(inputs[c.shape[1]])

    return time_call(one_pass, 5, warmup=2).median


def file_reading(
    target: str | os.PathLike, store: Any, dtype: str | None = None, codes_only: bool = False
) -> Reading | None:
    """The reading of a 4-bit GGUF ``target`` on this CPU: recorded in ``store`` (a StepCache) or
    measured now and recorded; in ``dtype`` ("float32", "bfloat16") when the command line named one,
    through the codes only with ``codes_only`` (--quantize file). None for a target that is not a
    4-bit GGUF file, or a dtype its codes do not run in."""
    if dtype not in (None, "float32", "bfloat16"):
        return None
    file = gguf_of(target)
    four_bit = file.four_bit_shapes() if file is not None else {}
    if not four_bit:
        return None
    shapes = repr(sorted(set(four_bit.values()))) + f"x{len(four_bit)}"
    key = "4-bit file " + hashlib.blake2b(shapes.encode(), digest_size=8).hexdigest()
    where = machine(torch.device("cpu"))
    seen = store.measured(where, key, file=READINGS)
    recorded = isinstance(seen, dict) and set(seen) == {n for n, _, _ in CANDIDATES}
    if recorded:
        timings = {name: float(seen[name]) for name, _, _ in CANDIDATES}
    else:
        codes = four_bit_codes(file)  # decoded only to be timed
        timings = {
            name: time_pass(codes, quantize, dtype)
            for name, quantize, dtype in CANDIDATES
            if quantize is None or dtype in INT4_DTYPES
        }
        store.record(where, key, timings, file=READINGS)
    allowed = [
        n
        for n, q, d in CANDIDATES
        if (dtype is None or str(d) == f"torch.{dtype}") and (q == "file" or not codes_only)
    ]
    best = min(allowed, key=timings.__getitem__)
    _, quantize, dtype = next(c for c in CANDIDATES if c[0] == best)
    return Reading(quantize, dtype, timings, recorded)


def settle_reading(
    target: str | os.PathLike,
    quantize: str | None,
    dtype: str | None,
    device: torch.device,
    cache_dir: str | os.PathLike | None,
    world_size: int = 1,
) -> tuple[str | None, str | None, str | None]:
    """--quantize and --dtype as a run uses them, and a note on the choice: where --quantize was not
    given, a 4-bit GGUF on one CPU process is read as :func:`file_reading` says; ``none`` reads it
    as floats (the loaders' None)."""
    if quantize == "none":
        return None, dtype, None
    chosen = quantize is None or (quantize == "file" and dtype is None)
    if not chosen or device.type != "cpu" or world_size != 1:
        return quantize, dtype, None
    from weights.step_cache import StepCache

    reading = file_reading(target, StepCache(cache_dir), dtype, codes_only=quantize == "file")
    if reading is None:
        return quantize, dtype, None
    return reading.quantize, dtype or str(reading.dtype).removeprefix("torch."), reading.note()
