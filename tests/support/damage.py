"""Damaging a safetensors file the way a bad download or a failing disk does, for the tests.

A safetensors file is an 8-byte little-endian header length, a JSON header that gives each
tensor's dtype, shape and byte range, then the raw data. :func:`overwrite_middle` leaves
the header intact, so the file still opens and every name and shape checks out, and
overwrites bytes in the middle of the data with 0xFF. 0xFFFF and 0xFFFFFFFF are NaN in
float16, bfloat16 and float32 whatever the alignment, so the damaged tensor holds NaNs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def tensor_ranges(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(offset of the data in the file, {tensor name: (begin, end) byte range within the data})."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    ranges = {
        name: tuple(info["data_offsets"]) for name, info in header.items() if name != "__metadata__"
    }
    return 8 + header_len, ranges


def overwrite_middle(path: Path, nbytes: int = 4096) -> str:
    """Overwrite ``nbytes`` bytes (fewer if that tensor is smaller) in the middle of the data of
    ``path`` with 0xFF, inside one tensor; return that tensor's name."""
    data_start, ranges = tensor_ranges(path)
    middle = (max(end for _, end in ranges.values())) // 2
    name, (begin, end) = next((n, r) for n, r in ranges.items() if r[0] <= middle < r[1])
    first = max(begin, middle - nbytes // 2)
    last = min(end, first + nbytes)
    with open(path, "r+b") as f:
        f.seek(data_start + first)
        f.write(b"\xff" * (last - first))
    return name
