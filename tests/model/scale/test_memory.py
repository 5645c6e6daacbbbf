"""The memory plan against bytes computed by hand from the Llama-2 architecture.

Every expected number here is derived in the test from the published shapes, not by
calling the code under test, so a wrong factor (KV heads not split, norms sharded,
scales forgotten) shows up as a mismatch.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from model import ModelConfig
from model.scale import memory as memory_lib
from model.scale.memory import (
    DEFAULT_RESERVE,
    LLAMA2_CONFIGS,
    NotEnoughMemoryError,
    available_bytes,
    check_memory,
    plan,
    plan_suggestion,
)
from model.scale.tensor_parallel import TensorParallelError
from weights.sharded import plan_config

# (hidden, intermediate, layers, heads, kv heads) from meta-llama/Llama-2-*-hf config.json; vocab 32000.
SHAPES = {
    "7b": (4096, 11008, 32, 32, 32),
    "13b": (5120, 13824, 40, 40, 40),
    "70b": (8192, 28672, 80, 64, 8),
}
VOCAB, CONTEXT, BF16 = 32000, 4096, 2
PUBLISHED_PARAMS = {"7b": 6_738_415_616, "13b": 13_015_864_320, "70b": 68_976_648_192}


def by_hand(name: str, tp: int = 1) -> dict[str, int]:
    """Block-linear parameters per rank, replicated parameters, int8 scale rows per rank, KV values per position."""
    hidden, inter, layers, heads, kv = SHAPES[name]
    head_dim = hidden // heads
    q = o = hidden * heads * head_dim
    k = v = hidden * kv * head_dim
    mlp = 3 * hidden * inter
    # Output rows of each linear on one rank: column-parallel layers lose rows, row-parallel keep all.
    rows = (heads * head_dim + 2 * kv * head_dim) // tp + hidden + 2 * inter // tp + hidden
    return {
        "blocks": layers * (q + k + v + o + mlp) // tp,
        "replicated": 2 * VOCAB * hidden + (2 * layers + 1) * hidden,
        "scale_rows": layers * rows,
        "kv_per_position": 2 * layers * (kv // tp) * head_dim,
    }


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_parameter_counts_match_the_published_models(name: str) -> None:
    counts = by_hand(name)
    assert counts["blocks"] + counts["replicated"] == PUBLISHED_PARAMS[name]
    assert LLAMA2_CONFIGS[name].num_parameters() == PUBLISHED_PARAMS[name]


def test_70b_in_bfloat16_is_137_95_gb() -> None:
    result = plan(LLAMA2_CONFIGS["70b"], None, torch.bfloat16, tp_size=1, context=CONTEXT)
    assert (
        result.target_sharded + result.target_replicated == 68_976_648_192 * BF16 == 137_953_296_384
    )
    assert f"{(result.target_sharded + result.target_replicated) / 1e9:.2f}" == "137.95"
    # Alone it just fits one H200's nominal 141 GB at 4096 positions (weights + 1.34 GB KV + 1.07 GB reserve)...
    assert (
        result.fits
        and result.free == 141 * 10**9 - 137_953_296_384 - 2 * 80 * 8 * 128 * CONTEXT * BF16 - 2**30
    )
    # ...but not with a 7B draft beside it, nor on an 80 GB GPU.
    assert not plan(
        LLAMA2_CONFIGS["70b"], LLAMA2_CONFIGS["7b"], torch.bfloat16, 1, device_name="h200"
    ).fits
    assert not plan(LLAMA2_CONFIGS["70b"], None, torch.bfloat16, 1, device_name="a100-80gb").fits


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_7b_draft_70b_target_bytes_per_gpu(tp: int, quantize: str | None) -> None:
    target, draft = by_hand("70b", tp), by_hand("7b")
    if quantize is None:
        sharded = target["blocks"] * BF16
        draft_bytes = (draft["blocks"] + draft["replicated"]) * BF16
        workspace = DEFAULT_RESERVE
    else:  # 1 byte per weight and a bf16 scale per output row; embeddings, lm_head and norms stay bf16
        sharded = target["blocks"] + target["scale_rows"] * BF16
        draft_bytes = draft["blocks"] + draft["scale_rows"] * BF16 + draft["replicated"] * BF16
        # + the largest matrix dequantised to bf16 for one matmul: 70B's gate/up/down (8192 x 28672) / tp
        # or 7B's (4096 x 11008), whichever is larger.
        workspace = DEFAULT_RESERVE + max(8192 * 28672 // tp, 4096 * 11008) * BF16
    result = plan(
        LLAMA2_CONFIGS["70b"],
        LLAMA2_CONFIGS["7b"],
        torch.bfloat16,
        tp_size=tp,
        context=CONTEXT,
        quantize=quantize,
        device_name="h200",
    )
    assert result.target_sharded == sharded
    assert result.target_replicated == target["replicated"] * BF16 == 1_051_213_824
    assert result.draft_weights == draft_bytes
    assert result.target_kv == target["kv_per_position"] * CONTEXT * BF16
    assert result.draft_kv == draft["kv_per_position"] * CONTEXT * BF16 == 2_147_483_648
    assert result.workspace == workspace
    assert (
        result.total
        == sharded
        + target["replicated"] * BF16
        + draft_bytes
        + result.target_kv
        + 2**31
        + workspace
    )


def test_which_setups_fit() -> None:
    t70, d7 = LLAMA2_CONFIGS["70b"], LLAMA2_CONFIGS["7b"]
    assert not plan(t70, d7, torch.bfloat16, 1, device_name="h200").fits
    assert plan(t70, d7, torch.bfloat16, 2, device_name="h200").fits
    assert plan(t70, d7, torch.bfloat16, 4, device_name="a100-80gb").fits
    assert plan(t70, d7, torch.bfloat16, 8, device_name="a100-40gb").fits
    assert not plan(t70, d7, torch.bfloat16, 4, device_name="a100-40gb").fits
    # One 80 GB GPU with int8: 81.55 GB at the full 4096 positions is over the nominal 80e9 bytes;
    # what is left after the weights holds (80e9 - fixed) / per-position KV bytes positions.
    int8 = plan(t70, d7, torch.bfloat16, 1, quantize="int8", device_name="a100-80gb")
    assert not int8.fits
    t, d = by_hand("70b"), by_hand("7b")
    fixed = (
        t["blocks"]
        + t["scale_rows"] * BF16
        + t["replicated"] * BF16
        + d["blocks"]
        + d["scale_rows"] * BF16
        + d["replicated"] * BF16
        + DEFAULT_RESERVE
        + 8192 * 28672 * BF16
    )
    per_position = (t["kv_per_position"] + d["kv_per_position"]) * BF16
    assert int8.max_context == (80 * 10**9 - fixed) // per_position == 2273
    assert plan(
        t70, d7, torch.bfloat16, 1, context=2048, quantize="int8", device_name="a100-80gb"
    ).fits


def test_capacity_override() -> None:
    """generate.py checks a plan against the memory free right now rather than a named GPU's size."""
    result = plan(
        LLAMA2_CONFIGS["7b"],
        None,
        torch.bfloat16,
        1,
        context=CONTEXT,
        device_name="cuda:0 (free)",
        capacity_bytes=10**10,
    )
    assert result.capacity == 10**10 and not result.fits and result.device_name == "cuda:0 (free)"
    assert result.total == (6_738_415_616 + 2 * 32 * 32 * 128 * CONTEXT) * BF16 + DEFAULT_RESERVE


def test_render_is_a_readable_table() -> None:
    text = plan(
        LLAMA2_CONFIGS["70b"],
        LLAMA2_CONFIGS["7b"],
        torch.bfloat16,
        2,
        device_name="h200",
        target_name="70b",
        draft_name="7b",
    ).render()
    assert "draft 7b -> target 70b" in text and "tensor-parallel over 2 GPUs" in text
    assert "68.45 GB" in text and "13.48 GB" in text and "fits" in text
    short = plan(LLAMA2_CONFIGS["70b"], None, torch.bfloat16, 1, device_name="a100-80gb").render()
    assert "does NOT fit" in short and "weights alone exceed" in short
    for quantize in ("int8", "int4"):  # the table names the quantization it planned for
        text = plan(
            LLAMA2_CONFIGS["7b"], None, torch.bfloat16, 1, quantize=quantize, device_name="h200"
        ).render()
        assert (
            f"{quantize} + bfloat16" in text
            and f"{'int4' if quantize == 'int8' else 'int8'} +" not in text
        )


def test_bad_inputs_are_clear_errors() -> None:
    with pytest.raises(TensorParallelError, match="num_key_value_heads=8"):
        plan(LLAMA2_CONFIGS["70b"], None, torch.bfloat16, tp_size=16)
    with pytest.raises(ValueError, match="unknown device"):
        plan(LLAMA2_CONFIGS["7b"], None, device_name="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            plan(LLAMA2_CONFIGS["7b"], None, device_name="auto")


def test_builtin_shapes_equal_the_published_config_json() -> None:
    published = {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert ModelConfig.from_hf(published) == LLAMA2_CONFIGS["70b"]


def test_plan_config_falls_back_to_the_builtin_shapes(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("SPECULATIVE_WEIGHTS", str(tmp_path))  # nothing downloaded there
    assert plan_config("70b-chat") == LLAMA2_CONFIGS["70b"]
    with pytest.raises(ValueError):
        plan_config("not-a-model")


def test_the_memory_free_now() -> None:
    free = available_bytes(torch.device("cpu"))
    assert free is None or free > 10**8  # this machine has more than 100 MB free
    assert available_bytes(torch.device("meta")) is None  # nothing to ask


def test_check_memory_counts_batch_rows_and_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (no reserve): the 7B's bf16 weights and, per row, its KV cache; ranks on one host
    share its memory."""
    hand = by_hand("7b")
    weights, kv_row = (
        (hand["blocks"] + hand["replicated"]) * BF16,
        hand["kv_per_position"] * 1024 * BF16,
    )
    monkeypatch.setattr(memory_lib, "available_bytes", lambda device: weights + 4 * kv_row)
    cpu = torch.device("cpu")
    assert check_memory(("7b", LLAMA2_CONFIGS["7b"]), None, 1024, torch.bfloat16, cpu, batch=4).fits
    with pytest.raises(
        NotEnoughMemoryError, match=r"7b needs about .* for 1024 positions x 5 rows\) but cpu has"
    ):
        check_memory(("7b", LLAMA2_CONFIGS["7b"]), None, 1024, torch.bfloat16, cpu, batch=5)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks here: each has half of what is free
    with pytest.raises(NotEnoughMemoryError, match="per device over 2 ranks"):
        check_memory(
            ("7b", LLAMA2_CONFIGS["7b"]), None, 1024, torch.bfloat16, cpu, tp_size=2, batch=4
        )
    monkeypatch.setattr(memory_lib, "available_bytes", lambda device: None)
    # cannot tell
    assert check_memory(("7b", LLAMA2_CONFIGS["7b"]), None, 1024, torch.bfloat16, cpu) is None


def test_plan_suggestion_words_the_cheapest_fit() -> None:
    t70, d7 = LLAMA2_CONFIGS["70b"], LLAMA2_CONFIGS["7b"]
    assert plan_suggestion(t70, d7, torch.bfloat16, 2, None, "h200") is None  # it fits
    assert (
        plan_suggestion(t70, d7, torch.bfloat16, 1, None, "h200")
        == "the cheapest change that fits: --quantize int8"
    )
    # 240 GB int8, heads split by none
    huge = replace(LLAMA2_CONFIGS["13b"], n_layers=1000, n_heads=5, n_kv_heads=5)
    assert plan_suggestion(huge, None, torch.bfloat16, 1, None, "a100-40gb") == (
        "no single change of --dtype, --quantize, --tp or --plan-device fits it: use a smaller pair"
    )


def test_int4_bytes_are_half_a_byte_a_weight_and_a_scale_and_zero_per_group() -> None:
    # 4096 x 4096: 8 MiB of codes, and 4096 rows x 128 groups x (4-byte scale + 4-byte zero) = 4 MiB (bfloat16: 2)
    # 8388608 + 4194304
    assert memory_lib.linear_bytes([(4096, 4096)], torch.float32, "int4") == 12582912
    # 8388608 + 2097152
    assert memory_lib.linear_bytes([(4096, 4096)], torch.bfloat16, "int4") == 10485760
    with pytest.raises(ValueError, match="'int8', 'int4' or 'file'"):
        memory_lib.linear_bytes([(8, 8)], torch.float32, "int2")


def test_a_servers_default_context_fits_its_kv_budget() -> None:
    """serve.py's default context: the model's, at most 4096, at most what a KV cache of 768 MiB (or a
    quarter of the free memory) holds for all rows, in steps of 256. SmolLM2 (30 layers, 3 KV heads
    of 64) in bfloat16 for 16 rows: 2 x 30 x 3 x 64 x 2 bytes x 16 rows = 368,640 bytes a position."""
    per_position = 2 * 30 * 3 * 64 * 2 * 16
    assert (
        memory_lib.default_context(8192, per_position, None) == 2048
    )  # 3 * 2**28 // 368640 = 2184
    assert memory_lib.default_context(8192, per_position, 2**31) == 1280  # a quarter of 2 GiB: 1456
    assert memory_lib.default_context(512, 1, None) == 512  # the tiny pair keeps its whole context
    assert memory_lib.default_context(100_000, 1, None) == 4096  # llama.cpp's default at most
    assert memory_lib.default_context(8192, 2**40, None) == 256  # one step at least
    assert memory_lib.default_context(128, 2**40, None) == 128  # never past the model's
