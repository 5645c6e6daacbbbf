"""benchmarks/limit.py, a step against the memory limit: the bytes a step reads, counted by hand on
small models (a tied output head counted once, an untied embedding table one row), and a smoke
run of the table on the shipped tiny target (timing nothing that a test judges)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import limit
from model import ModelConfig
from model.model import Llama
from tests.support.cli import TARGET, needs_pair


def config(tied: bool) -> ModelConfig:
    return ModelConfig(
        dim=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=2,
        vocab_size=32,
        hidden_dim=24,
        max_seq_len=16,
        tie_word_embeddings=tied,
    )


@pytest.mark.parametrize("tied", [True, False])
def test_the_bytes_a_step_reads_by_hand(tied: bool) -> None:
    model = Llama(config(tied))
    dim, vocab, hidden = 16, 32, 24
    # one block: q, k, v, o (16 x 16 each, two heads of 8), gate, up, down (16 x 24 each), two norms
    block = 4 * dim * dim + 3 * dim * hidden + 2 * dim
    head = vocab * dim  # the output head reads every row
    embedding = vocab * dim if not tied else 0
    final_norm = dim
    # untied: the embedding table's one row a step
    floats = block + head + final_norm + (dim if not tied else 0)
    assert sum(p.numel() for p in model.parameters()) == block + head + final_norm + embedding
    assert limit.weight_bytes(model) == 4 * floats
    assert limit.weight_bytes(model.to(torch.bfloat16)) == 2 * floats


@needs_pair
def test_a_smoke_run_on_the_tiny_target(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    page = tmp_path / "limit.md"
    assert (
        limit.main(["--target", str(TARGET), "--threads", "1", "--rounds", "1", "--out", str(page)])
        == 0
    )
    text = page.read_text()
    assert "float32, stacked and prepacked" in text and "GB/s" in text
    assert "share of the limit" in text


def test_bad_arguments_are_refused() -> None:
    for argv in (["--rounds", "0"], ["--threads", "0"]):
        with pytest.raises(SystemExit) as exit_:
            limit.parse(argv)
        assert exit_.value.code == 2
