"""generate.py with tensor parallelism, int8 and int4 weights and memory planning.

* Under ``torchrun --nproc-per-node 2`` (gloo, on the CPU) the target is sharded over two
  ranks, the draft replicated, and rank 0 alone prints: greedy float64 tokens equal the
  single-process run's.
* ``--quantize int8``: speculative decoding still reproduces the (quantized) target's own
  greedy output.
* ``--plan`` prints bytes per GPU from configs alone; checked against a hand count of the
  Llama-2 70B architecture, not against model.scale.memory.
* ``--tp 0`` ends with exit status 2 and one ``error:`` line (``--tp`` without ``--plan`` is a
  warning, like every flag a run cannot use: tests/scripts/test_generate.py).

Subprocesses run with one thread, for the 2-core CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from model.scale.quantize import Int4Linear, quantize_int4
from tests.support.paths import DRAFT, ROOT, TARGET
from weights import load_model, load_tokenizer
from weights.sharded import load_model_tp

needs_pair = pytest.mark.skipif(
    not (TARGET / "config.json").is_file() or not (DRAFT / "config.json").is_file(),
    reason="the shipped pair weights/tiny-target + weights/tiny-draft is absent",
)

GREEDY = ["--json", "--temperature", "0", "--max-new-tokens", "24", "--dtype", "float64"]


def env() -> dict[str, str]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for name in (
        "NO_COLOR",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        full.pop(name, None)
    return full


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), *args],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=timeout,
    )


def torchrun() -> list[str]:
    """This interpreter's torchrun, else `python -m torch.distributed.run` (the same program)."""
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def run_json(*args: str) -> dict[str, Any]:
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# ----------------------------------------------------------------------------- torchrun
@needs_pair
def test_torchrun_two_ranks_equals_one_process() -> None:
    single = run_json(*GREEDY)
    proc = subprocess.run(
        [*torchrun(), "--standalone", "--nproc-per-node", "2", str(ROOT / "generate.py"), *GREEDY],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # rank 0 alone prints
    doc = json.loads(lines[0])
    assert doc["settings"]["tensor_parallel"] == 2
    assert doc["settings"]["quantize"] is None
    assert len(doc["tokens"]) == 24
    assert doc["tokens"] == single["tokens"]
    assert doc["text"] == single["text"]


# ----------------------------------------------------------------------------- int8
@needs_pair
def test_int8_speculative_equals_the_int8_target_alone() -> None:
    args = ["--quantize", "int8", *GREEDY]
    with_draft = run_json(*args)
    alone = run_json(*args, "--no-draft")
    assert with_draft["settings"]["quantize"] == "int8"
    assert with_draft["stats"]["draft_calls"] > 0
    assert len(with_draft["tokens"]) == 24
    assert with_draft["tokens"] == alone["tokens"]


@needs_pair
def test_int4_runs_the_int4_target_and_speculation_reproduces_it() -> None:
    """--quantize int4 (a CPU, float32) is another target: generate.py's greedy tokens are those of
    the shipped target with its block weights quantized by model.scale.quantize, decoded here by a
    plain forward with no cache; speculation reproduces them."""
    args = [
        "--quantize",
        "int4",
        "--json",
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        "--device",
        "cpu",
        "--prompt",
        "Once upon a time",
    ]
    with_draft, alone = run_json(*args), run_json(*args, "--no-draft")
    assert with_draft["settings"]["quantize"] == "int4" and with_draft["stats"]["draft_calls"] > 0
    assert with_draft["tokens"] == alone["tokens"]
    model = quantize_int4(load_model(TARGET, dtype=torch.float32).eval())
    seq = load_tokenizer(TARGET).encode("Once upon a time", bos=True)
    prompt = len(seq)
    assert alone["prompt_tokens"] == prompt
    with torch.inference_mode():
        for _ in range(16):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert alone["tokens"] == seq[prompt:]
    proc = cli(*args, "--dtype", "float16")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --quantize int4 runs on a CPU in float32 or bfloat16 (torch's packed int4 kernel), not cpu in "
        "float16: add --device cpu, or drop --dtype"
    ]


@needs_pair
def test_int4_in_bfloat16_quantizes_the_checkpoints_values() -> None:
    """--quantize int4 --dtype bfloat16: codes, scales and zeros from the checkpoint's own values (not from
    their rounding to bfloat16), the scales and zeros and every other weight then in bfloat16. generate.py's
    greedy tokens are those of that model decoded here by a plain forward, up to bfloat16's near-ties (the
    comparison stops at the first step whose top two logits are within 0.1), and speculation reproduces them."""
    args = [
        "--quantize",
        "int4",
        "--dtype",
        "bfloat16",
        "--json",
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        "--device",
        "cpu",
        "--prompt",
        "Once upon a time",
    ]
    with_draft, alone = run_json(*args), run_json(*args, "--no-draft")
    assert with_draft["settings"]["dtype"] == "bfloat16" and with_draft["stats"]["draft_calls"] > 0
    assert with_draft["tokens"] == alone["tokens"]
    model, exact = (
        load_model(TARGET, dtype=torch.bfloat16).eval(),
        load_model(TARGET, dtype=torch.float32),
    )
    for name, layer in list(model.layers.named_modules()):
        if isinstance(layer, torch.nn.Linear):
            parent, _, child = name.rpartition(".")
            weight = exact.layers.get_submodule(name).weight.detach()
            setattr(
                model.layers.get_submodule(parent),
                child,
                Int4Linear.from_float(weight, 32).to(torch.bfloat16),
            )
    loaded = dict(
        load_model_tp(TARGET, dtype=torch.bfloat16, quantize="int4").layers.named_modules()
    )
    built = [
        (name, layer)
        for name, layer in model.layers.named_modules()
        if isinstance(layer, Int4Linear)
    ]
    assert len(built) == 7 * exact.config.n_layers
    assert all(
        torch.equal(loaded[name].weight, layer.weight)
        and torch.equal(loaded[name].scales_and_zeros, layer.scales_and_zeros)
        for name, layer in built
    )
    rounded_first = [
        Int4Linear.from_float(exact.layers.get_submodule(name).weight.bfloat16(), 32)
        for name, _ in built
    ]
    # its power
    assert any(
        not torch.equal(r.weight, layer.weight) for r, (_, layer) in zip(rounded_first, built)
    )
    seq = load_tokenizer(TARGET).encode("Once upon a time", bos=True)
    prompt, compared = len(seq), 0
    with torch.inference_mode():
        for _ in range(16):
            logits = model(torch.tensor([seq]))[0, -1].float()
            top = logits.topk(2).values
            if float(top[0] - top[1]) < 0.1:
                break
            seq.append(int(logits.argmax()))
            compared += 1
    assert compared >= 4 and alone["tokens"][:compared] == seq[prompt:]


# ----------------------------------------------------------------------------- --plan
# Llama-2-70B (meta-llama/Llama-2-70b-hf config.json), written out here on purpose.
DIM, LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB, CONTEXT = 8192, 80, 64, 8, 28672, 32000, 4096
HEAD_DIM = DIM // HEADS
BF16 = 2


def test_plan_70b_over_two_gpus_by_hand() -> None:
    tp = 2
    # gate, up, down
    per_layer = (
        DIM * HEADS * HEAD_DIM  # q_proj
        + 2 * DIM * KV_HEADS * HEAD_DIM  # k_proj, v_proj
        + HEADS * HEAD_DIM * DIM  # o_proj
        + 3 * DIM * HIDDEN
    )
    block_bytes = LAYERS * per_layer * BF16 // tp
    replicated_bytes = (2 * VOCAB * DIM + (2 * LAYERS + 1) * DIM) * BF16  # embed, lm_head, norms
    kv_bytes = 2 * LAYERS * (KV_HEADS // tp) * HEAD_DIM * CONTEXT * BF16
    assert block_bytes == 68_451_041_280  # 68.45 GB: about 69e9 parameters / 2 ranks x 2 bytes

    base = ["--plan", "--draft", "7b", "--target", "70b", "--tp", "2", "--plan-device", "h200"]
    proc = cli(*base)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "tensor-parallel over 2 GPUs" in text
    assert f"{block_bytes / 1e9:.2f} GB" in text
    assert f"{replicated_bytes / 1e9:.2f} GB" in text
    assert f"{kv_bytes / 1e9:.2f} GB" in text
    assert "of 141.00 GB" in text and "fits" in text

    doc = run_json(*base, "--json")
    assert doc["target_sharded"] == block_bytes
    assert doc["target_replicated"] == replicated_bytes
    assert doc["target_kv"] == kv_bytes
    assert doc["tp_size"] == 2 and doc["fits"] is True


# ----------------------------------------------------------------------------- bad --tp
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--plan", "--tp", "0"], "--tp must be >= 1"),
    ],
)
def test_bad_tp_exits_2_with_one_line(argv: list[str], fragment: str) -> None:
    proc = cli(*argv, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip("\n").splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    assert proc.stdout == ""
