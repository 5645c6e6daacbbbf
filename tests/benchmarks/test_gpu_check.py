"""benchmarks/gpu_check.py runs only on a GPU machine; the CPU CI checks that it imports and answers --help."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from model import ModelConfig
from tests.support.paths import ROOT


def load_script():
    return importlib.import_module("benchmarks.gpu_check")


def test_imports_and_has_its_checks() -> None:
    module = load_script()
    for name in (
        "main",
        "run_pytest",
        "measure_bandwidth",
        "check_7b_decode",
        "check_shipped_pair",
    ):
        assert callable(getattr(module, name))


def test_help_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--out" in proc.stdout and "pytest -m cuda" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_says_so(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert load_script().main(["--out", str(out)]) == 2
    assert "no CUDA GPU" in json.loads(out.read_text())["error"]


def test_decode_check_smoke_on_cpu() -> None:
    """The 7B decode check's code path, with a tiny config on the CPU: both dtypes measured, int8 half the bytes."""
    config = ModelConfig(
        vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, hidden_dim=64, max_seq_len=256
    )
    result = load_script().check_7b_decode(1e9, config=config, device="cpu", steps=4)
    assert result["bfloat16"]["tokens_per_second"] > 0 and result["int8"]["tokens_per_second"] > 0
    # Per layer: q, k, v, o are 32x32, gate/up 64x32, down 32x64 = 10240 weights in 288 output rows.
    # Read per token: those, lm_head (64x32), 3 norms of 32, and one 32-wide embedding row.
    assert result["bfloat16"]["weight_bytes_read_per_token"] == (10240 + 2048 + 96 + 32) * 2
    assert result["int8"]["weight_bytes_read_per_token"] == 10240 + 288 * 2 + (2048 + 96 + 32) * 2
    assert result["int8"]["bandwidth_bound_tokens_per_second"] == 1e9 / (
        10240 + 288 * 2 + (2048 + 96 + 32) * 2
    )


def test_dry_run_runs_the_compiled_and_speculative_sections(tmp_path: Path) -> None:
    """--dry-run: the eager/compiled decode, the 7B-shaped speculative run (tiny shapes, CPU)
    and the shipped pair run without an error, and greedy speculation gives the target's tokens."""
    out = tmp_path / "dry.json"
    assert load_script().main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    decode, spec = report["decode_compiled"], report["speculative_7b_shaped"]
    assert decode["eager"]["tokens_per_second"] > 0 and decode["compiled"]["tokens_per_second"] > 0
    assert 0 < decode["compiled"]["fraction_of_bound"] and decode["compile_seconds"] > 0
    for label in ("eager", "compiled"):
        assert spec[label]["same_output"] and spec[label]["acceptance_rate"] > 0
    assert spec["compiled"]["same_output_as_eager"]
    assert spec["draft_parameters"] < spec["target_parameters"]


def test_a_section_past_its_timeout_is_recorded_not_waited_for() -> None:
    report: dict = {}
    start = time.perf_counter()
    load_script().section(report, "slow", lambda: time.sleep(30), timeout_s=0.5)
    assert time.perf_counter() - start < 5
    assert "timeout" in report["slow"]["error"]
