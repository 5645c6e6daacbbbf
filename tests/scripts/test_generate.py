"""generate.py end to end: text and JSON output on the shipped pair, greedy identity with and
without a draft, and every bad input ending in exit status 2 with one ``error:`` line.

Successful runs go through a real subprocess (exit status, stdout/stderr separation, no
stray output around the JSON). Most bad inputs are checked in-process through
``generate.main(argv)``, which is what the script runs, to keep the suite fast; a few are
repeated through a subprocess to prove the process-level contract (status 2, one line,
no traceback). Subprocesses run with one thread, for the 2-core CI.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from sentencepiece import sentencepiece_model_pb2

import generate
from model import ModelConfig
from model.fast.prepack import prepack_supported
from model.scale import memory as memory_lib
from model.scale.memory import (
    DEFAULT_RESERVE,
    LLAMA2_CONFIGS,
    NotEnoughMemoryError,
    cheapest_fit,
    check_memory,
    plan,
)
from speculative.cli import output
from speculative.cli.report import JSON_NOTES
from tests.support.cli import (
    DRAFT,
    PAIR,
    ROOT,
    TARGET,
    assert_one_error_line,
    assert_unused_flags,
    cli,
    main_error,
    main_json,
    main_ok,
    needs_pair,
    warnings_in,
)
from tests.support.damage import overwrite_middle
from weights import load_model, load_tokenizer, read_config

NEAR_TIE = (
    1e-4  # docs/algorithm.md, numerics policy: float32 greedy may differ only at such near-ties
)


def run_json(*args: str) -> dict[str, Any]:
    proc = cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # the whole of stdout is one JSON document


# ----------------------------------------------------------------------------- bad input, no weights needed
def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--draft",
        "--target",
        "--prompt",
        "--device",
        "--dtype",
        "--gamma",
        "--temperature",
        "--top-k",
        "--top-p",
        "--max-new-tokens",
        "--seed",
        "--no-draft",
        "--chat",
        "--json",
        "--no-color",
        "--no-prepack",
        "--no-fuse",
    ):
        assert flag in text


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--gamma", "0"], "--gamma"),
        (["--gamma", "-3"], "--gamma"),
        (["--gamma", "two"], "--gamma"),
        (["--temperature", "-0.5"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--top-k", "0"], "--top-k"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--max-new-tokens", "-4"], "--max-new-tokens"),
        (["--dtype", "float8"], "--dtype"),
        (["--dtype", "int4"], "invalid choice"),
        (["--device", "tpu"], "device"),
        (["--threads", "0"], "--threads"),
        (["--tp", "0"], "--tp must be >= 1"),
        (["--frobnicate"], "unrecognized"),
    ],
)
def test_bad_arguments(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    main_error(capsys, argv, fragment)


def test_bad_arguments_in_a_real_process() -> None:
    for argv, fragment in (
        (["--gamma", "0"], "--gamma"),
        (["--target", "no-such-model"], "unknown"),
    ):
        proc = cli(*argv)
        assert_one_error_line(proc.returncode, proc.stderr, proc.stdout, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
def test_cuda_asked_for_but_absent(capsys: pytest.CaptureFixture[str]) -> None:
    main_error(capsys, ["--device", "cuda"], "cuda", "not available")
    main_error(capsys, ["--device", "cuda:1"], "cuda", "not available")


def test_unknown_checkpoint_name(capsys: pytest.CaptureFixture[str]) -> None:
    main_error(capsys, ["--target", "llama-9000"], "unknown checkpoint", "7b", "tiny-target")


@pytest.mark.skipif(
    (ROOT / "weights" / "Llama-2-70b-hf").is_dir(), reason="Llama-2-70b-hf is present here"
)
def test_missing_llama_checkpoint_says_what_to_download(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECULATIVE_WEIGHTS", str(tmp_path))
    main_error(
        capsys, ["--target", "70b"], "meta-llama/Llama-2-70b-hf", str(tmp_path / "Llama-2-70b-hf")
    )


@needs_pair
@pytest.mark.skipif(
    (ROOT / "weights" / "Llama-2-7b-hf").is_dir(), reason="Llama-2-7b-hf is present here"
)
def test_missing_draft_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECULATIVE_WEIGHTS", str(tmp_path))
    main_error(
        capsys, ["--target", str(TARGET), "--draft", "7b"], "meta-llama/Llama-2-7b-hf", "download"
    )


def test_missing_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    main_error(capsys, ["--target", str(tmp_path / "nowhere")], "does not exist")


def test_bfloat16_refused_on_a_gpu_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A V100-like GPU (compute capability 7.0): bfloat16 asked for is an error, the default falls back."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    gpu = torch.device("cuda", 0)
    with pytest.raises(generate.UsageError, match="bfloat16"):
        generate.pick_dtype("bfloat16", gpu)
    assert generate.pick_dtype(None, gpu) == torch.float16
    assert generate.pick_dtype("float32", gpu) == torch.float32
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert generate.pick_dtype(None, gpu) == torch.bfloat16
    assert generate.pick_dtype(None, torch.device("cpu")) == torch.float32


def test_memory_estimate_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights: parameters x dtype bytes; KV cache: 2 x layers x kv_heads x head_dim x positions x bytes;
    on a GPU also the runtime reserve. Computed here from Llama-2-70b's published numbers."""
    config = ModelConfig(
        vocab_size=32000,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        hidden_dim=28672,
        max_seq_len=4096,
    )
    weights, kv = 68_976_648_192 * 2, 2 * 80 * 8 * 128 * 4096 * 2  # 137.95 GB + 1.34 GB in bfloat16
    needed = weights + kv + DEFAULT_RESERVE
    monkeypatch.setattr(memory_lib, "available_bytes", lambda device: needed - 1)
    with pytest.raises(
        NotEnoughMemoryError,
        match=r"70b needs about 140\.4 GB in bfloat16 \(weights 138\.0 GB "
        r"\+ KV cache 1\.3 GB for 4096 positions \+ 1\.1 GB runtime",
    ):
        check_memory(("70b", config), None, 4096, torch.bfloat16, torch.device("cuda", 0))
    monkeypatch.setattr(memory_lib, "available_bytes", lambda device: needed)
    assert check_memory(("70b", config), None, 4096, torch.bfloat16, torch.device("cuda", 0)).fits
    # On the CPU there is no CUDA reserve; a draft adds its weights and its own cache.
    monkeypatch.setattr(memory_lib, "available_bytes", lambda device: 2 * (weights + kv) - 1)
    with pytest.raises(NotEnoughMemoryError, match=r"70b \+ 70b need about 278\.6 GB"):
        check_memory(("70b", config), ("70b", config), 4096, torch.bfloat16, torch.device("cpu"))


# ----------------------------------------------------------------------------- the shipped pair
@needs_pair
def test_no_arguments_runs_the_shipped_pair() -> None:
    proc = cli()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(generate.DEFAULT_PROMPT)
    assert len(proc.stdout.strip()) > len(generate.DEFAULT_PROMPT) + 20
    assert "\x1b[" not in proc.stdout  # not a terminal: no colour
    assert "draft tiny-draft -> target tiny-target on cpu in float32" in proc.stderr
    assert "cost model: alpha=" in proc.stderr and "predicted speedup" in proc.stderr


@needs_pair
def test_json_schema() -> None:
    doc = run_json(*PAIR, "--max-new-tokens", "24", "--temperature", "1", "--seed", "3")
    assert {"text", "tokens", "prompt_tokens", "settings", "stats"} <= set(doc)
    stats = doc["stats"]
    for key in (
        "acceptance_rate",
        "target_calls",
        "draft_calls",
        "new_tokens",
        "tokens_per_second",
        "gamma",
        "predicted_speedup",
        "cost_ratio",
        "tokens_per_target_call",
    ):
        assert key in stats, key
    tokens = doc["tokens"]
    assert all(isinstance(t, int) for t in tokens)
    assert 1 <= len(tokens) == stats["new_tokens"] <= 24
    assert 0 <= stats["acceptance_rate"] <= 1
    assert stats["gamma"] == 4 and stats["draft_calls"] >= 1 and stats["target_calls"] >= 1
    assert stats["tokens_per_second"] > 0 and stats["predicted_speedup"] > 0
    tokenizer = load_tokenizer(TARGET)
    prompt = tokenizer.encode(generate.DEFAULT_PROMPT)
    assert doc["prompt_tokens"] == len(prompt)
    assert (
        doc["text"] == generate.continuation_text(tokenizer, prompt, tokens) and doc["text"].strip()
    )
    assert doc["settings"]["temperature"] == 1 and doc["settings"]["seed"] == 3


@needs_pair
def test_json_without_a_draft() -> None:
    doc = run_json("--target", str(TARGET), "--no-draft", "--max-new-tokens", "12")
    stats = doc["stats"]
    assert (
        stats["acceptance_rate"] is None
        and stats["predicted_speedup"] is None
        and stats["gamma"] is None
    )
    assert stats["draft_calls"] == 0
    assert stats["target_calls"] == stats["new_tokens"] == len(doc["tokens"])
    assert doc["settings"]["draft"] is None


@needs_pair
def test_seeded_sampling_is_reproducible() -> None:
    args = (
        *PAIR,
        "--max-new-tokens",
        "16",
        "--temperature",
        "1",
        "--top-k",
        "50",
        "--top-p",
        "0.9",
        "--seed",
        "11",
    )
    assert run_json(*args)["tokens"] == run_json(*args)["tokens"]


def assert_equal_up_to_a_near_tie(got: list[int], reference: list[int], what: str) -> None:
    """float32 greedy token lists may part only where the target's top two logits (after the
    common prefix, computed here in float32 with PyTorch's default matmul) are a near-tie."""
    if got == reference:
        return
    k = next(i for i, (a, b) in enumerate(zip(got, reference)) if a != b)
    tokenizer = load_tokenizer(TARGET)
    model = load_model(TARGET, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode(generate.DEFAULT_PROMPT) + reference[:k]]))[
            0, -1
        ]
    top2 = logits.topk(2).values
    assert float(top2[0] - top2[1]) < NEAR_TIE, f"{what} diverge at token {k} without a near-tie"


@pytest.fixture(scope="module")
def greedy_alone() -> dict[str, list[int]]:
    """The target's own greedy tokens, per dtype (computed once)."""
    if not (TARGET / "config.json").is_file():
        pytest.skip("the shipped pair is absent")
    return {
        dtype: run_json(
            "--target", str(TARGET), "--no-draft", "--max-new-tokens", "40", "--dtype", dtype
        )["tokens"]
        for dtype in ("float64", "float32")
    }


@needs_pair
@pytest.mark.parametrize("gamma", ["1", "4", "auto"])
def test_greedy_float64_equals_the_target_alone(
    greedy_alone: dict[str, list[int]], gamma: str
) -> None:
    doc = run_json(*PAIR, "--max-new-tokens", "40", "--dtype", "float64", "--gamma", gamma)
    assert doc["tokens"] == greedy_alone["float64"]


@needs_pair
def test_greedy_float32_differs_only_at_near_ties(greedy_alone: dict[str, list[int]]) -> None:
    spec = run_json(*PAIR, "--max-new-tokens", "40", "--dtype", "float32", "--gamma", "3")["tokens"]
    assert_equal_up_to_a_near_tie(spec, greedy_alone["float32"], "greedy outputs")


@needs_pair
def test_prepacking_is_on_by_default_on_cpu_float32_and_can_be_turned_off(tmp_path: Path) -> None:
    # an empty compiled-step cache: where the session's holds this pair's steps (a test that compiled it
    # kept them there), the default run loads those instead of prepacking
    args = (
        "--target",
        str(TARGET),
        "--no-draft",
        "--max-new-tokens",
        "20",
        "--dtype",
        "float32",
        "--cache-dir",
        str(tmp_path),
    )
    packed, plain = run_json(*args), run_json(*args, "--no-prepack")
    assert plain["settings"]["prepacked_layers"] == 0
    if prepack_supported():
        assert packed["settings"]["prepacked_layers"] > 0
    # the same greedy tokens, up to float32 near-ties (the two differ only in the order of additions)
    assert_equal_up_to_a_near_tie(
        packed["tokens"], plain["tokens"], "prepacked and plain greedy outputs"
    )


@needs_pair
def test_stacked_projections_are_on_by_default_and_can_be_turned_off() -> None:
    args = (*PAIR, "--max-new-tokens", "20", "--dtype", "float32", "--no-prepack")
    fused, plain = run_json(*args), run_json(*args, "--no-fuse")
    assert plain["settings"]["fused_groups"] == 0
    target_layers = json.loads((TARGET / "config.json").read_text())["num_hidden_layers"]
    draft_layers = json.loads((DRAFT / "config.json").read_text())["num_hidden_layers"]
    # attention and MLP per block
    assert fused["settings"]["fused_groups"] == 2 * (target_layers + draft_layers)
    assert_equal_up_to_a_near_tie(
        fused["tokens"], plain["tokens"], "stacked and plain greedy outputs"
    )


@needs_pair
def test_chat_template(chat_target: Path) -> None:
    """A Llama-2 chat model without a template (conftest's chat_target): --chat and --system give Meta's format."""
    tokenizer = load_tokenizer(chat_target)
    plain = generate.encode_prompt(tokenizer, "Tell me a story.", chat=True, system=None)
    assert plain == tokenizer.encode("[INST] Tell me a story. [/INST]", bos=True)
    with_system = generate.encode_prompt(
        tokenizer, "Tell me a story.", chat=True, system="Be brief."
    )
    assert with_system == tokenizer.encode(
        "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nTell me a story. [/INST]"
    )
    assert with_system[0] == tokenizer.bos_id
    doc = run_json(
        "--target",
        str(chat_target),
        "--draft",
        str(DRAFT),
        "--chat",
        "--system",
        "Be brief.",
        "--prompt",
        "Tell me a story.",
        "--max-new-tokens",
        "4",
    )
    assert doc["prompt_tokens"] == len(with_system)


@needs_pair
def test_streaming_detokenisation_keeps_spaces_and_multibyte_characters() -> None:
    """Fed one token at a time, the streamer prints exactly the text of the whole sequence, although
    "🙂" and "é" are byte-fallback pieces that decode to nothing sensible alone."""
    tokenizer = load_tokenizer(TARGET)
    prompt = tokenizer.encode("Once upon a time")
    new = tokenizer.encode(" the café said 🙂 and Ünal smiled.", bos=False)
    # byte-fallback tokens are in there
    assert any(tokenizer.piece(t).startswith("<0x") for t in new)
    out = io.StringIO()
    streamer = output.Streamer(tokenizer, prompt, out, color=False)
    for i, token in enumerate(new):
        streamer([token], [i % 2 == 0])
        assert "\ufffd" not in out.getvalue()  # half a character is never printed
    streamer.finish()
    assert out.getvalue() == tokenizer.decode(prompt + new)[len(tokenizer.decode(prompt)) :] + "\n"
    assert generate.continuation_text(tokenizer, prompt, new) == out.getvalue()[:-1]


@needs_pair
@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_colours_on_a_terminal_only() -> None:
    import pty  # POSIX only: the test is skipped on Windows, where the module does not exist

    def on_tty(*args: str) -> tuple[str, str]:
        master, slave = pty.openpty()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("NO_COLOR", None)
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "generate.py"), *PAIR, "--max-new-tokens", "24", *args],
            stdout=slave,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=300) == 0, err
        os.close(master)
        return b"".join(chunks).decode(errors="replace"), err

    out, err = on_tty()
    assert output.GREEN in out or output.YELLOW in out
    assert "colours:" in err  # the legend
    out, err = on_tty("--no-color")
    assert "\x1b[" not in out and "colours:" not in err


# ----------------------------------------------------------------------------- bad input on the shipped pair
def copy_draft(tmp_path: Path) -> Path:
    out = tmp_path / "draft"
    shutil.copytree(DRAFT, out)
    return out


@needs_pair
def test_vocabulary_mismatch(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    draft = copy_draft(tmp_path)
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] += 64
    (draft / "config.json").write_text(json.dumps(config))
    main_error(capsys, ["--target", str(TARGET), "--draft", str(draft)], "vocabulary")


@needs_pair
def test_tokenizer_mismatch(tmp_path: Path) -> None:
    pytest.importorskip("google.protobuf")

    draft = copy_draft(tmp_path)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((draft / "tokenizer.model").read_bytes())
    proto.pieces[300].piece, proto.pieces[301].piece = (
        proto.pieces[301].piece,
        proto.pieces[300].piece,
    )
    (draft / "tokenizer.model").write_bytes(proto.SerializeToString())  # same size, different ids
    proc = cli("--target", str(TARGET), "--draft", str(draft))
    assert_one_error_line(proc.returncode, proc.stderr, proc.stdout, "tokenizer")


@needs_pair
def test_prompt_longer_than_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    context = read_config(TARGET).max_seq_len
    main_error(
        capsys,
        [*PAIR, "--prompt", "Once upon a time " * context],
        "prompt",
        f"{context}-token context",
    )


@needs_pair
def test_pair_too_big_for_memory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Refused from config.json alone: this 'checkpoint' has no weights file at all."""
    huge = tmp_path / "huge"
    huge.mkdir()
    config = json.loads((TARGET / "config.json").read_text())
    # ~8e13 parameters
    config.update(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=100_000,
    )
    (huge / "config.json").write_text(json.dumps(config))
    shutil.copy(TARGET / "tokenizer.model", huge)
    main_error(capsys, ["--target", str(huge), "--draft", str(DRAFT)], "KV cache", "free")


@needs_pair
def test_checkpoint_without_weights(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = copy_draft(tmp_path)
    (broken / "model.safetensors").unlink()
    main_error(capsys, ["--target", str(TARGET), "--draft", str(broken)], "model.safetensors")


# ----------------------------------------------------------------------------- a new user's first hour (issue 12)
def copy_checkpoint(source: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(source, out)
    return out


@needs_pair
@pytest.mark.parametrize("role", ["draft", "target"])
def test_corrupted_weights_are_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, role: str
) -> None:
    """A safetensors file with its header intact and 0xFF (NaN) bytes in the middle of its data:
    greedy used to print token 0 forever and sampling to crash in the tokenizer. Now loading
    refuses it, naming the file and the tensor, whatever the decoding settings."""
    broken = copy_checkpoint(DRAFT if role == "draft" else TARGET, tmp_path, role)
    name = overwrite_middle(broken / "model.safetensors")
    pair = {"target": TARGET, "draft": DRAFT, role: broken}
    argv = ["--target", str(pair["target"]), "--draft", str(pair["draft"]), "--max-new-tokens", "4"]
    main_error(capsys, argv, str(broken / "model.safetensors"), f"tensor {name}", "non-finite")
    if role == "target":  # the crash: sampling from the target alone
        main_error(
            capsys,
            ["--target", str(broken), "--no-draft", "--temperature", "1", "--max-new-tokens", "4"],
            f"tensor {name}",
            "non-finite",
        )


@needs_pair
def test_corrupted_weights_in_a_real_process(tmp_path: Path) -> None:
    broken = copy_checkpoint(DRAFT, tmp_path, "draft")
    name = overwrite_middle(broken / "model.safetensors")
    proc = cli("--target", str(TARGET), "--draft", str(broken), "--max-new-tokens", "4")
    assert_one_error_line(proc.returncode, proc.stderr, proc.stdout, f"tensor {name}", "NaN or inf")


@needs_pair
def test_non_finite_logits_are_one_error_line_and_no_tokens(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Finite weights whose arithmetic overflows: the final norm's weight at float16's largest value
    makes every normalised activation above 1 infinite, so the logits are inf/NaN. The run ends with
    one error line, after its header, and stdout holds nothing (not even the prompt)."""
    hot = copy_checkpoint(TARGET, tmp_path, "hot")
    tensors = load_file(hot / "model.safetensors")
    tensors["model.norm.weight"].fill_(torch.finfo(torch.float16).max)
    save_file(tensors, hot / "model.safetensors")
    for extra in ([], ["--no-draft", "--temperature", "1"]):
        status = generate.main(
            [
                "--target",
                str(hot),
                "--draft",
                str(DRAFT),
                "--dtype",
                "float16",
                "--max-new-tokens",
                "4",
                *extra,
            ]
        )
        out = capsys.readouterr()
        assert status == 2 and out.out == "" and "Traceback" not in out.err, out.err
        lines = out.err.strip().splitlines()
        assert lines[-1].startswith("error: ") and "non-finite logits" in lines[-1], lines
        assert not any(line.startswith("error: ") for line in lines[:-1]), lines


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--top-k", "5"], ["--top-k has no effect at temperature 0"]),
        (["--top-p", "0.5", "--seed", "5"], ["--top-p and --seed have no effect at temperature 0"]),
        (["--top-k", "5", "--temperature", "1"], []),
        (
            ["--no-draft", "--gamma", "8", "--draft", "x"],
            ["--draft and --gamma have no effect with --no-draft"],
        ),
        (
            ["--no-draft", "--gamma", "4"],
            ["--gamma has no effect with --no-draft"],
        ),  # even at its default value
        (["--no-draft", "--compare"], ["--compare has no effect with --no-draft"]),
        (["--system", "Be brief."], ["--system has no effect without --chat"]),
        (["--system", "Be brief.", "--chat"], []),
        (
            ["--tp", "2"],
            ["--tp has no effect without --plan; to run on N GPUs, launch with torchrun"],
        ),
        (["--plan-device", "h200"], ["--plan-device has no effect without --plan"]),
        (
            ["--plan", "--prompt", "Hi", "--temperature", "1", "--max-new-tokens", "9"],
            ["--prompt, --temperature and --max-new-tokens have no effect with --plan"],
        ),
        (["--json", "--no-color"], ["--no-color has no effect with --json"]),
        (["--temperature", "0", "--gamma", "4"], []),
    ],
)
def test_flags_a_run_cannot_use_get_one_warning_each(argv: list[str], expected: list[str]) -> None:
    assert_unused_flags(argv, expected)


@needs_pair
def test_unused_flags_warn_on_stderr_and_the_run_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc, err = main_json(
        capsys,
        [
            "--target",
            str(TARGET),
            "--no-draft",
            "--max-new-tokens",
            "3",
            "--top-k",
            "5",
            "--seed",
            "5",
            "--gamma",
            "8",
            "--system",
            "Be brief.",
            "--tp",
            "2",
        ],
    )
    assert warnings_in(err) == [
        "warning: --tp has no effect without --plan; to run on N GPUs, launch with torchrun --nproc-per-node N "
        "generate.py ...",
        "warning: --top-k and --seed have no effect at temperature 0: greedy decoding takes the most likely token",
        "warning: --gamma has no effect with --no-draft: the target decodes alone",
        "warning: --system has no effect without --chat",
    ]
    # greedy: the seed was not used
    assert len(doc["tokens"]) == 3 and doc["settings"]["seed"] is None


def test_help_states_the_rule_for_unused_flags_and_the_exit_statuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        generate.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fragment in (
        "A flag that a run cannot use",
        "warning: ...",
        "Exit status: 0",
        "1 when --plan",
        "acceptance_rate is the paper's alpha",
        "empirical_acceptance",
        "max_seq_len",
        "--compare",
        "--prompt -",
        ".venv/bin/python generate.py",
        "docs/cli.md",
    ):
        assert fragment in text, fragment


@needs_pair
def test_header_shows_the_whole_sampling_setup(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = main_ok(
        capsys,
        [
            *PAIR,
            "--max-new-tokens",
            "4",
            "--temperature",
            "0.8",
            "--top-k",
            "50",
            "--top-p",
            "0.9",
            "--seed",
            "11",
            "--gamma",
            "3",
        ],
    )
    recorded = ", guarded (plain steps where recorded costs say speculating loses)"  # the default: cli.costs
    assert err[0].endswith(
        "temperature 0.8, top-k 50, top-p 0.9, seed 11, gamma 3, block-wise verification" + recorded
    ), err[0]
    guarded = ", guarded (plain steps where speculating loses)"
    _, err = main_ok(capsys, [*PAIR, "--max-new-tokens", "4", "--verify", "block"])
    assert err[0].endswith("greedy (temperature 0), gamma 4, block-wise verification" + recorded), (
        err[0]
    )
    _, err = main_ok(capsys, [*PAIR, "--max-new-tokens", "4", "--tree", "3,2,1,1"])
    assert err[0].endswith(
        "greedy (temperature 0), tree 3,2,1,1 (21 nodes, children without_replacement)" + recorded
    ), err[0]
    _, err = main_ok(capsys, [*PAIR, "--max-new-tokens", "4", "--no-guard"])
    assert err[0].endswith("greedy (temperature 0), gamma 4, token-wise verification"), err[0]
    _, err = main_ok(
        capsys, [*PAIR, "--max-new-tokens", "4", "--temperature", "1", "--seed", "1", "--guard"]
    )
    assert err[0].endswith("seed 1, gamma 4, block-wise verification" + guarded), err[0]
    # sampled, a chain is verified block-wise unless token is asked for; a tree by its own walk, with no error
    _, err = main_ok(
        capsys,
        [*PAIR, "--max-new-tokens", "4", "--temperature", "1", "--seed", "1", "--verify", "token"],
    )
    assert err[0].endswith("seed 1, gamma 4, token-wise verification" + recorded), err[0]
    doc, _ = main_json(
        capsys,
        [*PAIR, "--max-new-tokens", "4", "--temperature", "1", "--seed", "1", "--tree", "2,1"],
    )
    assert doc["settings"]["verify"] == "token" and doc["settings"]["tree"] == [2, 1], doc[
        "settings"
    ]


@needs_pair
@pytest.mark.parametrize(
    ("flags", "guard"),
    [
        (
            [],
            "recorded",
        ),  # greedy: by recorded costs, with no probe (the output is the same either way)
        (
            ["--temperature", "1", "--seed", "2"],
            "recorded",
        ),  # sampled: by recorded costs, so that the seed repeats it
        (["--guard"], True),  # by the run's own timings, asked for
        (
            ["--temperature", "1", "--seed", "2", "--guard"],
            True,
        ),  # by the run's own timings, asked for
        (["--temperature", "1", "--seed", "2", "--no-guard"], False),
        (["--no-guard"], False),
        (["--gamma", "auto"], True),  # AutoGamma turns itself off where it loses
        (["--no-draft"], False),
    ],
)
def test_the_guard_reads_recorded_costs_unless_asked_otherwise(
    flags: list[str], guard: bool | str
) -> None:
    doc = run_json(*PAIR, "--max-new-tokens", "4", *flags)
    assert doc["settings"]["guard"] == guard and type(doc["settings"]["guard"]) is type(guard)


@needs_pair
def test_a_sampled_run_reads_the_costs_recorded_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A sampled run measures its set-up's costs once, records them, and later runs read them: the same seed gives
    the same tokens, and the record decides. One that says speculating costs 100 plain steps gives plain steps
    after the first iteration; one that says it costs nothing keeps every iteration drafting."""
    argv = [
        *PAIR,
        "--max-new-tokens",
        "24",
        "--temperature",
        "1",
        "--seed",
        "5",
        "--cache-dir",
        str(tmp_path),
    ]
    first, err = main_json(capsys, argv)
    assert not any(line.startswith("note: guard:") for line in err)  # --json prints no notes
    ((machine, records),) = json.loads((tmp_path / "guard_costs.json").read_text()).items()
    ((key, record),) = records.items()
    assert (
        record["plain_s"] > 0
        and record["speculating_s"] > 0
        and record["catch_up_s"] >= 0
        and "gamma 4 " in key
    )
    again, _ = main_json(capsys, argv)
    assert again["tokens"] == first["tokens"] and first["settings"]["guard"] == "recorded"
    for speculating_s in (100 * record["plain_s"], 0.0):
        (tmp_path / "guard_costs.json").write_text(
            json.dumps({machine: {key: {**record, "speculating_s": speculating_s}}})
        )
        doc, _ = main_json(capsys, argv)
        history = doc["stats"]["gamma_history"]
        assert (
            history[1:] == [0] * (len(history) - 1) if speculating_s else 0 not in history[:-1]
        ), str(history)
    (tmp_path / "guard_costs.json").unlink()
    _, err = main_ok(capsys, argv)
    assert any(line.startswith("note: guard: measured here once") for line in err), err
    _, err = main_ok(capsys, argv)
    assert not any(line.startswith("note: guard:") for line in err), err


@needs_pair
def test_guard_flags_that_do_nothing_are_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = main_ok(capsys, [*PAIR, "--max-new-tokens", "4", "--gamma", "auto", "--no-guard"])
    assert "warning: --guard has no effect with --gamma auto or --tree auto" in "\n".join(err)
    _, err = main_ok(capsys, [*PAIR, "--max-new-tokens", "4", "--no-draft", "--guard"])
    assert "--guard" in "\n".join(line for line in err if line.startswith("warning:"))


@needs_pair
def test_a_fresh_seed_is_shown_and_repeats_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*PAIR, "--max-new-tokens", "12", "--temperature", "1"]
    first, _ = main_json(capsys, args)
    seed = first["settings"]["seed"]
    assert isinstance(seed, int)
    again, _ = main_json(capsys, [*args, "--seed", str(seed)])
    assert again["tokens"] == first["tokens"]
    _, err = main_ok(capsys, [*args, "--seed", str(seed)])
    assert f"seed {seed}, gamma 4" in err[0]
    _, err = main_ok(capsys, args)
    assert "(fresh; --seed repeats it)" in err[0]


@needs_pair
def test_cost_model_uses_the_gamma_actually_drafted(capsys: pytest.CaptureFixture[str]) -> None:
    """--gamma 100 with 12 new tokens drafts at most 11 a call. The prediction used to take gamma =
    100 at its word (101 tokens per call against 12 measured); it averages the paper's formula
    over what each iteration drafted."""
    args = [*PAIR, "--gamma", "100", "--max-new-tokens", "12", "--prompt", "The dog and the cat"]
    doc, _ = main_json(capsys, args)
    stats = doc["stats"]
    assert stats["gamma"] == 100 and max(stats["gamma_history"]) <= 11
    measured, predicted = stats["tokens_per_target_call"], stats["predicted_tokens_per_target_call"]
    assert predicted <= 12 and abs(predicted - measured) <= 0.5 * measured, (measured, predicted)
    _, err = main_ok(capsys, args)
    line = next(line for line in err if line.startswith("cost model:"))
    assert "gamma=100 (drafted " in line and "over the g drafted in each iteration" in line, line
    assert f"{predicted:.2f} predicted" in line, line


def prompt_of(tokenizer: Any, length: int) -> str:
    """A story opening that encodes (with BOS) to exactly ``length`` tokens or one fewer."""
    words = ("Once upon a time there was a little dog who liked to run in the park. " * 200).split(
        " "
    )
    low, high = 1, len(words)
    while low < high:  # the longest prefix of words that stays within length
        mid = (low + high + 1) // 2
        low, high = (
            (mid, high)
            if len(tokenizer.encode(" ".join(words[:mid]))) <= length
            else (low, mid - 1)
        )
    return " ".join(words[:low])


@needs_pair
def test_every_run_says_why_it_stopped(capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = load_tokenizer(TARGET)
    # the default story ends well before
    doc, _ = main_json(capsys, [*PAIR, "--max-new-tokens", "400"])
    assert doc["stats"]["stop_reason"] == "eos" and doc["tokens"][-1] == tokenizer.eos_id
    assert len(doc["tokens"]) < 400
    context = read_config(TARGET).max_seq_len
    long_prompt = prompt_of(tokenizer, context - 6)
    for extra in ([], ["--no-draft"]):
        doc, _ = main_json(
            capsys, [*PAIR, "--prompt", long_prompt, "--max-new-tokens", "100", *extra]
        )
        assert doc["stats"]["stop_reason"] == "max_seq_len", doc["stats"]
        assert doc["prompt_tokens"] + len(doc["tokens"]) == context
        doc, _ = main_json(capsys, [*PAIR, "--max-new-tokens", "5", *extra])
        assert doc["stats"]["stop_reason"] == "max_new_tokens" and len(doc["tokens"]) == 5
    _, err = main_ok(capsys, [*PAIR, "--max-new-tokens", "5"])
    assert "; stopped: max_new_tokens (--max-new-tokens reached)" in err[1], err
    _, err = main_ok(capsys, ["--target", str(TARGET), "--max-new-tokens", "400", "--no-draft"])
    assert "; stopped: eos (the model ended the text" in err[1], err


def test_plan_that_does_not_fit_exits_1_with_the_cheapest_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--plan", "--draft", "7b", "--target", "70b"]
    out, err = main_ok(capsys, [*base, "--plan-device", "h200"], status=1)
    assert (
        "does NOT fit" in out
        and "the cheapest change that fits: --quantize int8" in out
        and not err
    )
    out, _ = main_ok(capsys, [*base, "--plan-device", "a100-80gb"], status=1)
    assert "the cheapest change that fits: --tp 4 (run with torchrun --nproc-per-node 4" in out
    out, _ = main_ok(capsys, [*base, "--plan-device", "h200", "--tp", "2"], status=0)
    assert "fits," in out and "cheapest" not in out
    out, _ = main_ok(capsys, [*base, "--plan-device", "a100-40gb", "--json"], status=1)
    doc = json.loads(out)
    assert doc["fits"] is False and doc["suggestion"] == (
        "the cheapest change that fits: --tp 8 (run with torchrun "
        "--nproc-per-node 8 generate.py ...)"
    )


def test_cheapest_fit_by_hand() -> None:
    """The order: bfloat16 for wider weights, then int8, then the fewest more GPUs, then a bigger GPU,
    then int8 on more GPUs. Each suggestion is checked to fit, and the cheaper ones not to."""

    t70, d7, t13 = LLAMA2_CONFIGS["70b"], LLAMA2_CONFIGS["7b"], LLAMA2_CONFIGS["13b"]
    assert cheapest_fit(t70, d7, device_name="h200", tp_size=2) is None  # it fits already
    assert cheapest_fit(t13, None, torch.float32, device_name="a100-40gb") == "--dtype bfloat16"
    assert not plan(t13, None, torch.float32, device_name="a100-40gb").fits
    assert plan(t13, None, torch.bfloat16, device_name="a100-40gb").fits
    assert cheapest_fit(t70, d7, device_name="h200") == "--quantize int8"
    assert plan(t70, d7, quantize="int8", device_name="h200").fits
    # 70B + 7B on 80 GB GPUs: int8 is not enough (80.6 GB) and neither are two; four are.
    assert not plan(t70, d7, quantize="int8", device_name="a100-80gb").fits
    assert not plan(t70, d7, tp_size=2, device_name="a100-80gb").fits
    assert plan(t70, d7, tp_size=4, device_name="a100-80gb").fits
    assert (
        cheapest_fit(t70, d7, device_name="a100-80gb")
        == "--tp 4 (run with torchrun --nproc-per-node 4 "
        "generate.py ...)"
    )
    # A model whose 5 heads split over no number of GPUs, 77 GB in bfloat16 and 41 GB in int8: on a
    # 40 GB GPU only a bigger GPU helps, the smallest that is big enough.
    odd = replace(t13, n_layers=164, n_heads=5, n_kv_heads=5)
    assert not plan(odd, None, quantize="int8", device_name="a100-40gb").fits
    assert (
        cheapest_fit(odd, None, device_name="a100-40gb")
        == "--plan-device h100-80gb (a NVIDIA H100 80GB (SXM))"
    )
    assert plan(odd, None, device_name="h100-80gb").fits
    # float32 70B + 7B on one 40 GB GPU: no single change is enough; int8 on four GPUs is the first to fit.
    got = cheapest_fit(t70, d7, torch.float32, device_name="a100-40gb")
    assert got == "--quantize int8 --tp 4 (run with torchrun --nproc-per-node 4 generate.py ...)"
    assert plan(t70, d7, torch.float32, tp_size=4, quantize="int8", device_name="a100-40gb").fits
    assert not plan(
        t70, d7, torch.float32, tp_size=2, quantize="int8", device_name="a100-40gb"
    ).fits
    huge = replace(odd, n_layers=1000)  # 240 GB in int8, and no split of its heads: nothing helps
    assert not plan(huge, None, quantize="int8", device_name="h200").fits
    assert cheapest_fit(huge, None, device_name="a100-40gb") is None


@needs_pair
def test_chat_on_a_base_model_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The shipped target is a base model without a chat template: --chat exits 2 with one line. The
    same files under a name that marks them for chat are a Llama-2 chat model without one: Llama-2's format."""
    args = ["--no-draft", "--chat", "--prompt", "Tell me a story.", "--max-new-tokens", "2"]
    assert generate.main(["--target", str(TARGET), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "has no chat template" in err, err
    marked = tmp_path / "tiny-chat"
    marked.symlink_to(TARGET, target_is_directory=True)
    _, err = main_json(capsys, ["--target", str(marked), *args])
    assert warnings_in(err) == []


@needs_pair
def test_compare_measures_the_speedup_next_to_the_prediction(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc, _ = main_json(capsys, [*PAIR, "--compare", "--max-new-tokens", "16"])
    compare = doc["compare"]
    assert compare["measured_speedup"] == pytest.approx(
        compare["speculative_tokens_per_second"] / compare["baseline_tokens_per_second"]
    )
    assert compare["predicted_speedup"] == doc["stats"]["predicted_speedup"] > 0
    assert compare["baseline"]["draft_calls"] == 0 and compare["baseline"]["target_calls"] == 16
    # with the calls as measured: tau tokens for an iteration's draft and verification time after the prompt's
    # pass, plus the loop's own work per token as the target alone pays it, against the target alone's token
    base, spec = compare["baseline"], doc["stats"]
    step, token = (
        (base["target_time_s"] - base["first_call_s"]) / 15,
        1 / compare["baseline_tokens_per_second"],
    )
    assert 0 < spec["first_calls_s"] < spec["first_iteration_s"]
    per_call = (spec["draft_time_s"] + spec["target_time_s"] - spec["first_calls_s"]) / (
        spec["target_calls"] - 1
    )
    assert compare["predicted_speedup_measured_calls"] == pytest.approx(
        spec["predicted_tokens_per_target_call"] * token / (per_call + max(0, token - step))
    )
    if not compare["same_tokens"]:
        assert_equal_up_to_a_near_tie(
            doc["tokens"], compare["baseline_tokens"], "--compare's two greedy runs"
        )
    assert doc["settings"]["compare"] is True
    out, err = main_ok(
        capsys, [*PAIR, "--compare", "--max-new-tokens", "8", "--temperature", "1", "--seed", "1"]
    )
    line = err[-1]
    assert line.startswith("compare: speculative ") and "target alone" in line, err
    # sampled: not compared
    assert "measured speedup" in line and "predicted" in line and "greedy" not in line, line
    # the text once, not twice
    assert out.startswith(generate.DEFAULT_PROMPT) and out.count("\n") == 1


@needs_pair
def test_prompt_from_standard_input(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = load_tokenizer(TARGET)
    monkeypatch.setattr(sys, "stdin", io.StringIO("The dog and the cat\n"))
    doc, _ = main_json(capsys, [*PAIR, "--prompt", "-", "--max-new-tokens", "3"])
    assert doc["prompt_tokens"] == len(tokenizer.encode("The dog and the cat"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    main_error(capsys, [*PAIR, "--prompt", "-"], "--prompt -", "standard input is empty")


@needs_pair
def test_prompt_from_standard_input_in_a_real_process() -> None:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "generate.py"),
            *PAIR,
            "--prompt",
            "-",
            "--max-new-tokens",
            "3",
            "--no-color",
        ],
        input="The dog and the cat\n",
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The dog and the cat")


def test_busy_hint_from_step_times() -> None:
    cpu = torch.device("cpu")
    steady = [0.008 * i for i in range(40)]
    assert output.busy_hint(steady, [4] * 40, threads=2, device=cpu) is None
    # Measured with 2 threads next to two spinning processes: most steps wait for a descheduled thread.
    times, t = [], 0.0
    for i in range(40):
        t += 0.0075 if i % 3 == 0 else 0.55
        times.append(t)
    hint = output.busy_hint(times, [4] * 40, threads=2, device=cpu)
    assert hint is not None and hint.startswith("hint: ") and "--threads 1" in hint, hint
    assert output.busy_hint(times, [4] * 40, threads=1, device=cpu) is None  # nothing to suggest
    assert output.busy_hint(times, [4] * 40, threads=2, device=torch.device("cuda", 0)) is None
    # too few steps to tell
    assert output.busy_hint(times[:8], [4] * 8, threads=2, device=cpu) is None
    # Iterations that drafted fewer tokens are cheaper by design: they are not compared with the rest.
    mixed = [0.008 * i + (0.02 if i % 2 else 0) for i in range(40)]
    assert (
        output.busy_hint(mixed, [4 if i % 2 else 1 for i in range(40)], threads=2, device=cpu)
        is None
    )


@needs_pair
def test_busy_machine_prints_one_hint(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's own step times, as a busy machine gives them (a fake clock: no timing in the test)."""
    clock = {"t": 0.0, "calls": 0}

    def busy_now() -> float:  # two steps in three wait 0.5 s for a descheduled thread
        clock["calls"] += 1
        clock["t"] += 0.008 if clock["calls"] % 3 == 0 else 0.5
        return clock["t"]

    monkeypatch.setattr(output, "perf_counter", busy_now)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _, err = main_ok(capsys, ["--target", str(TARGET), "--no-draft", "--max-new-tokens", "30"])
    hints = [line for line in err if line.startswith("hint: ")]
    assert len(hints) == 1 and "--threads 1" in hints[0], err


def test_json_documents_the_acceptance_numbers() -> None:
    assert "alpha" in JSON_NOTES["acceptance_rate"]
    assert "never verified" in JSON_NOTES["empirical_acceptance"]
    text = (ROOT / "docs" / "cli.md").read_text()
    for field in (
        "acceptance_rate",
        "empirical_acceptance",
        "stop_reason",
        "predicted_tokens_per_target_call",
        "gamma_history",
        "compare",
        "notes",
        "measured_speedup",
    ):
        assert f"`{field}`" in text, field


@needs_pair
def test_json_carries_the_notes_and_the_stop_reason(capsys: pytest.CaptureFixture[str]) -> None:
    doc, _ = main_json(capsys, [*PAIR, "--max-new-tokens", "6"])
    assert doc["notes"] == JSON_NOTES
    assert doc["stats"]["stop_reason"] == "max_new_tokens"
    assert 0 <= doc["stats"]["empirical_acceptance"] <= 1


def test_readme_examples_use_the_virtual_environment() -> None:
    """A fresh clone has torch only in .venv: `python generate.py` fails with ModuleNotFoundError."""
    readme = (ROOT / "README.md").read_text()
    blocks = readme.split("```")[1::2]
    commands = [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip().startswith(("python", "torchrun", ".venv/", "source"))
    ]
    assert commands, "no command examples found"
    for command in commands:
        assert not command.startswith("python "), command
        assert not command.startswith("torchrun ") or ".venv/bin/torchrun" in command, command
    quick = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert [line for line in quick.splitlines() if line.strip()] == [
        'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[test]" && .venv/bin/python generate.py',
        ".venv/bin/python -m pytest -q -n 2",
    ]
    assert "## Train your own pair" in readme
    for card in ("weights/tiny-target/README.md", "weights/tiny-draft/README.md"):
        assert card in readme and (ROOT / card).is_file()


@needs_pair
def test_no_prepack_where_nothing_is_prepacked_warns(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--target", str(TARGET), "--no-draft", "--max-new-tokens", "1", "--no-prepack"]
    _, err = main_json(capsys, [*args, "--dtype", "float64"])
    assert warnings_in(err) == [
        "warning: --no-prepack has no effect on cpu in float64: weights are prepacked only "
        "on the CPU in float32 (and bfloat16 with native bf16)"
    ]
    _, err = main_json(capsys, [*args, "--dtype", "float32"])
    assert warnings_in(err) == []


@needs_pair
def test_a_config_field_nobody_classified_is_one_note_and_the_run_goes_on(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-target-plus"
    folder.mkdir()
    for file in TARGET.iterdir():
        if file.name != "config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((TARGET / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "a_field_from_the_future": 7}))
    out = cli("--target", str(folder), "--no-draft", "--max-new-tokens", "4", "--no-color")
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stderr.splitlines() if "a_field_from_the_future" in line]
    assert (
        len(notes) == 1
        and notes[0].startswith("note: config.json of ")
        and "not classified" in notes[0]
    )


@pytest.mark.parametrize("flags", [("avx512f", "avx512_bf16"), ("avx512f", "avx512bw")])
def test_a_bfloat16_checkpoint_runs_in_bfloat16_where_the_cpu_computes_it(
    flags: tuple[str, ...],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No --dtype: a checkpoint stored in bfloat16 runs in bfloat16 on a CPU with native bfloat16, in float32 on
    one without; a float16 checkpoint (the shipped pair) and --dtype given are left as they were."""
    from model.host import CPU
    from speculative.cli import options

    monkeypatch.setattr(options, "describe_cpu", lambda: CPU("a cpu", flags))
    folder = tmp_path / "bf16-target"
    shutil.copytree(TARGET, folder)
    config = json.loads((folder / "config.json").read_text())
    # the shipped target: stays float32 on a CPU either way
    assert config["torch_dtype"] == "float16"
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    native = "avx512_bf16" in flags

    def dtype_of(*args: str) -> str:
        capsys.readouterr()
        assert generate.main([*args, "--no-draft", "--max-new-tokens", "2", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["settings"]["dtype"]

    assert dtype_of("--target", str(folder)) == ("bfloat16" if native else "float32")
    renamed = tmp_path / "bf16-target-transformers-5"  # which names it dtype
    shutil.copytree(TARGET, renamed)
    (renamed / "config.json").write_text(
        json.dumps({**{k: v for k, v in config.items() if k != "torch_dtype"}, "dtype": "bfloat16"})
    )
    assert dtype_of("--target", str(renamed)) == ("bfloat16" if native else "float32")
    assert dtype_of("--target", str(TARGET)) == "float32"
    assert dtype_of("--target", str(folder), "--dtype", "float32") == "float32"
    # quantized: as before
    assert dtype_of("--target", str(folder), "--quantize", "int8") == "float32"


@needs_pair
def test_ignore_eos_decodes_every_token_past_an_end_of_sequence_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The target's own third greedy token made its end-of-sequence id (generation_config.json): the run stops
    there, and with --ignore-eos goes on to --max-new-tokens with the same tokens as before the change."""
    run = [*PAIR, "--prompt", "Once upon a time", "--max-new-tokens", "12"]
    free, _ = main_json(capsys, run)
    assert free["stats"]["stop_reason"] == "max_new_tokens"
    third = free["tokens"][2]
    folder = tmp_path / "eos-target"
    shutil.copytree(TARGET, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [third]}))
    run[1] = str(folder)
    stopped, _ = main_json(capsys, run)
    first = free["tokens"].index(third)
    assert (
        stopped["stats"]["stop_reason"] == "eos"
        and stopped["tokens"] == free["tokens"][: first + 1]
    )
    ignored, _ = main_json(capsys, [*run, "--ignore-eos"])
    assert (
        ignored["stats"]["stop_reason"] == "max_new_tokens" and ignored["tokens"] == free["tokens"]
    )
    assert ignored["settings"]["ignore_eos"] is True and stopped["settings"]["ignore_eos"] is False


def test_an_empty_prompt_is_refused_before_loading(capsys, monkeypatch) -> None:
    """--prompt "" was refused only after the models had loaded, as "give at least one token id"."""

    def never(*args, **kwargs):
        raise AssertionError("loaded a model for an empty prompt")

    monkeypatch.setattr(generate, "load_named_pair", never)
    main_error(capsys, ["--prompt", ""], "--prompt is empty", "Once upon a time")


def test_the_usual_short_forms_are_the_long_flags(capsys) -> None:
    """llama.cpp's -m -p -n -t: the same run as --target --prompt --max-new-tokens --threads."""
    short, _ = main_ok(capsys, ["-m", "tiny-target", "-p", "Once", "-n", "6", "-t", "1", "--json"])
    long, _ = main_ok(
        capsys,
        ["--target", "tiny-target", "--prompt", "Once", "--max-new-tokens", "6", "--threads", "1"]
        + ["--json"],
    )
    short_doc, long_doc = json.loads(short), json.loads(long)
    assert short_doc["tokens"] == long_doc["tokens"] and len(short_doc["tokens"]) == 6
    assert short_doc["settings"]["threads"] == long_doc["settings"]["threads"] == 1
