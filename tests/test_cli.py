"""generate.py end to end: text and JSON output on the shipped pair, greedy identity with and
without a draft, and every bad input ending in exit status 2 with one ``error:`` line.

Successful runs go through a real subprocess (exit status, stdout/stderr separation, no
stray output around the JSON). Most bad inputs are checked in-process through
``generate.main(argv)``, which is what the script runs, to keep the suite fast; a few are
repeated through a subprocess to prove the process-level contract (status 2, one line,
no traceback). Subprocesses run with one thread, for the 2-core CI.
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

import generate

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "weights" / "tiny-target"
DRAFT = ROOT / "weights" / "tiny-draft"
PAIR = ["--target", str(TARGET), "--draft", str(DRAFT)]
NEAR_TIE = 1e-4  # docs/algorithm.md, numerics policy: float32 greedy may differ only at such near-ties

needs_pair = pytest.mark.skipif(
    not (TARGET / "config.json").is_file() or not (DRAFT / "config.json").is_file(),
    reason="the shipped pair weights/tiny-target + weights/tiny-draft is absent (it is committed once trained)",
)


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run generate.py in a subprocess with one CPU thread."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    full_env.pop("NO_COLOR", None)
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *args], capture_output=True, text=True,
                          env=full_env, cwd=ROOT, timeout=timeout)


def run_json(*args: str) -> dict[str, Any]:
    proc = cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # the whole of stdout is one JSON document


def assert_one_error_line(status: int, stderr: str, stdout: str, *fragments: str) -> None:
    assert status == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip("\n").splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), (fragment, lines[0])
    assert stdout == ""


def main_error(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> str:
    """generate.main(argv) in-process: must return 2 with one error line naming ``fragments``."""
    status = generate.main(argv)
    out = capsys.readouterr()
    assert_one_error_line(status, out.err, out.out, *fragments)
    return out.err


# ----------------------------------------------------------------------------- bad input, no weights needed
def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--draft", "--target", "--prompt", "--device", "--dtype", "--gamma", "--temperature", "--top-k",
                 "--top-p", "--max-new-tokens", "--seed", "--no-draft", "--chat", "--json", "--no-color",
                 "--no-prepack", "--no-fuse"):
        assert flag in text


@pytest.mark.parametrize(("argv", "fragment"), [
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
    (["--system", "Be brief."], "--chat"),
    (["--frobnicate"], "unrecognized"),
])
def test_bad_arguments(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    main_error(capsys, argv, fragment)


def test_bad_arguments_in_a_real_process() -> None:
    for argv, fragment in ((["--gamma", "0"], "--gamma"), (["--target", "no-such-model"], "unknown")):
        proc = cli(*argv)
        assert_one_error_line(proc.returncode, proc.stderr, proc.stdout, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
def test_cuda_asked_for_but_absent(capsys: pytest.CaptureFixture[str]) -> None:
    main_error(capsys, ["--device", "cuda"], "cuda", "not available")
    main_error(capsys, ["--device", "cuda:1"], "cuda", "not available")


def test_unknown_checkpoint_name(capsys: pytest.CaptureFixture[str]) -> None:
    main_error(capsys, ["--target", "llama-9000"], "unknown checkpoint", "7b", "tiny-target")


@pytest.mark.skipif((ROOT / "weights" / "Llama-2-70b-hf").is_dir(), reason="Llama-2-70b-hf is present here")
def test_missing_llama_checkpoint_says_what_to_download(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_WEIGHTS", str(tmp_path))
    main_error(capsys, ["--target", "70b"], "meta-llama/Llama-2-70b-hf", str(tmp_path / "Llama-2-70b-hf"))


@needs_pair
@pytest.mark.skipif((ROOT / "weights" / "Llama-2-7b-hf").is_dir(), reason="Llama-2-7b-hf is present here")
def test_missing_draft_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_WEIGHTS", str(tmp_path))
    main_error(capsys, ["--target", str(TARGET), "--draft", "7b"], "meta-llama/Llama-2-7b-hf", "download")


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
    config = generate.ModelConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                  hidden_dim=28672, max_seq_len=4096)
    weights, kv = 68_976_648_192 * 2, 2 * 80 * 8 * 128 * 4096 * 2  # 137.95 GB + 1.34 GB in bfloat16
    needed = weights + kv + generate.DEFAULT_RESERVE
    monkeypatch.setattr(generate, "available_bytes", lambda device: needed - 1)
    with pytest.raises(generate.UsageError, match=r"70b needs about 140\.4 GB in bfloat16 \(weights 138\.0 GB "
                                                  r"\+ KV cache 1\.3 GB for 4096 positions \+ 1\.1 GB runtime"):
        generate.check_memory(("70b", config), None, 4096, torch.bfloat16, torch.device("cuda", 0))
    monkeypatch.setattr(generate, "available_bytes", lambda device: needed)
    assert generate.check_memory(("70b", config), None, 4096, torch.bfloat16, torch.device("cuda", 0)).fits
    # On the CPU there is no CUDA reserve; a draft adds its weights and its own cache.
    monkeypatch.setattr(generate, "available_bytes", lambda device: 2 * (weights + kv) - 1)
    with pytest.raises(generate.UsageError, match=r"70b \+ 70b need about 278\.6 GB"):
        generate.check_memory(("70b", config), ("70b", config), 4096, torch.bfloat16, torch.device("cpu"))


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
    for key in ("acceptance_rate", "target_calls", "draft_calls", "new_tokens", "tokens_per_second", "gamma",
                "predicted_speedup", "cost_ratio", "tokens_per_target_call"):
        assert key in stats, key
    tokens = doc["tokens"]
    assert all(isinstance(t, int) for t in tokens)
    assert 1 <= len(tokens) == stats["new_tokens"] <= 24
    assert 0 <= stats["acceptance_rate"] <= 1
    assert stats["gamma"] == 4 and stats["draft_calls"] >= 1 and stats["target_calls"] >= 1
    assert stats["tokens_per_second"] > 0 and stats["predicted_speedup"] > 0
    tokenizer = generate.load_tokenizer(TARGET)
    prompt = tokenizer.encode(generate.DEFAULT_PROMPT)
    assert doc["prompt_tokens"] == len(prompt)
    assert doc["text"] == generate.continuation_text(tokenizer, prompt, tokens) and doc["text"].strip()
    assert doc["settings"]["temperature"] == 1 and doc["settings"]["seed"] == 3


@needs_pair
def test_json_without_a_draft() -> None:
    doc = run_json("--target", str(TARGET), "--no-draft", "--max-new-tokens", "12")
    stats = doc["stats"]
    assert stats["acceptance_rate"] is None and stats["predicted_speedup"] is None and stats["gamma"] is None
    assert stats["draft_calls"] == 0
    assert stats["target_calls"] == stats["new_tokens"] == len(doc["tokens"])
    assert doc["settings"]["draft"] is None


@needs_pair
def test_seeded_sampling_is_reproducible() -> None:
    args = (*PAIR, "--max-new-tokens", "16", "--temperature", "1", "--top-k", "50", "--top-p", "0.9", "--seed", "11")
    assert run_json(*args)["tokens"] == run_json(*args)["tokens"]


def assert_equal_up_to_a_near_tie(got: list[int], reference: list[int], what: str) -> None:
    """float32 greedy token lists may part only where the target's top two logits (after the
    common prefix, computed here in float32 with PyTorch's default matmul) are a near-tie."""
    if got == reference:
        return
    k = next(i for i, (a, b) in enumerate(zip(got, reference)) if a != b)
    tokenizer = generate.load_tokenizer(TARGET)
    model = generate.load_model(TARGET, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode(generate.DEFAULT_PROMPT) + reference[:k]]))[0, -1]
    top2 = logits.topk(2).values
    assert float(top2[0] - top2[1]) < NEAR_TIE, f"{what} diverge at token {k} without a near-tie"


@pytest.fixture(scope="module")
def greedy_alone() -> dict[str, list[int]]:
    """The target's own greedy tokens, per dtype (computed once)."""
    if not (TARGET / "config.json").is_file():
        pytest.skip("the shipped pair is absent")
    return {dtype: run_json("--target", str(TARGET), "--no-draft", "--max-new-tokens", "40", "--dtype",
                            dtype)["tokens"] for dtype in ("float64", "float32")}


@needs_pair
@pytest.mark.parametrize("gamma", ["1", "4", "auto"])
def test_greedy_float64_equals_the_target_alone(greedy_alone: dict[str, list[int]], gamma: str) -> None:
    doc = run_json(*PAIR, "--max-new-tokens", "40", "--dtype", "float64", "--gamma", gamma)
    assert doc["tokens"] == greedy_alone["float64"]


@needs_pair
def test_greedy_float32_differs_only_at_near_ties(greedy_alone: dict[str, list[int]]) -> None:
    spec = run_json(*PAIR, "--max-new-tokens", "40", "--dtype", "float32", "--gamma", "3")["tokens"]
    assert_equal_up_to_a_near_tie(spec, greedy_alone["float32"], "greedy outputs")


@needs_pair
def test_prepacking_is_on_by_default_on_cpu_float32_and_can_be_turned_off() -> None:
    from model.prepack import prepack_supported

    args = ("--target", str(TARGET), "--no-draft", "--max-new-tokens", "20", "--dtype", "float32")
    packed, plain = run_json(*args), run_json(*args, "--no-prepack")
    assert plain["settings"]["prepacked_layers"] == 0
    if prepack_supported():
        assert packed["settings"]["prepacked_layers"] > 0
    # the same greedy tokens, up to float32 near-ties (the two differ only in the order of additions)
    assert_equal_up_to_a_near_tie(packed["tokens"], plain["tokens"], "prepacked and plain greedy outputs")


@needs_pair
def test_stacked_projections_are_on_by_default_and_can_be_turned_off() -> None:
    args = (*PAIR, "--max-new-tokens", "20", "--dtype", "float32", "--no-prepack")
    fused, plain = run_json(*args), run_json(*args, "--no-fuse")
    assert plain["settings"]["fused_groups"] == 0
    target_layers = json.loads((TARGET / "config.json").read_text())["num_hidden_layers"]
    draft_layers = json.loads((DRAFT / "config.json").read_text())["num_hidden_layers"]
    assert fused["settings"]["fused_groups"] == 2 * (target_layers + draft_layers)  # attention and MLP per block
    assert_equal_up_to_a_near_tie(fused["tokens"], plain["tokens"], "stacked and plain greedy outputs")


@needs_pair
def test_chat_template() -> None:
    tokenizer = generate.load_tokenizer(TARGET)
    plain = generate.encode_prompt(tokenizer, "Tell me a story.", chat=True, system=None)
    assert plain == tokenizer.encode("[INST] Tell me a story. [/INST]", bos=True)
    with_system = generate.encode_prompt(tokenizer, "Tell me a story.", chat=True, system="Be brief.")
    assert with_system == tokenizer.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nTell me a story. [/INST]")
    assert with_system[0] == tokenizer.bos_id
    doc = run_json(*PAIR, "--chat", "--system", "Be brief.", "--prompt", "Tell me a story.", "--max-new-tokens", "4")
    assert doc["prompt_tokens"] == len(with_system)


@needs_pair
def test_streaming_detokenisation_keeps_spaces_and_multibyte_characters() -> None:
    """Fed one token at a time, the streamer prints exactly the text of the whole sequence, although
    "🙂" and "é" are byte-fallback pieces that decode to nothing sensible alone."""
    import io

    tokenizer = generate.load_tokenizer(TARGET)
    prompt = tokenizer.encode("Once upon a time")
    new = tokenizer.encode(" the café said 🙂 and Ünal smiled.", bos=False)
    assert any(tokenizer.piece(t).startswith("<0x") for t in new)  # byte-fallback tokens are in there
    out = io.StringIO()
    streamer = generate.Streamer(tokenizer, prompt, out, color=False)
    for i, token in enumerate(new):
        streamer([token], [i % 2 == 0])
        assert "\ufffd" not in out.getvalue()  # half a character is never printed
    streamer.finish()
    assert out.getvalue() == tokenizer.decode(prompt + new)[len(tokenizer.decode(prompt)):] + "\n"
    assert generate.continuation_text(tokenizer, prompt, new) == out.getvalue()[:-1]


@needs_pair
@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_colours_on_a_terminal_only() -> None:
    import pty

    def on_tty(*args: str) -> tuple[str, str]:
        master, slave = pty.openpty()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("NO_COLOR", None)
        proc = subprocess.Popen([sys.executable, str(ROOT / "generate.py"), *PAIR, "--max-new-tokens", "24", *args],
                                stdout=slave, stderr=subprocess.PIPE, env=env, cwd=ROOT)
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
    assert generate.GREEN in out or generate.YELLOW in out
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
    from sentencepiece import sentencepiece_model_pb2

    draft = copy_draft(tmp_path)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((draft / "tokenizer.model").read_bytes())
    proto.pieces[300].piece, proto.pieces[301].piece = proto.pieces[301].piece, proto.pieces[300].piece
    (draft / "tokenizer.model").write_bytes(proto.SerializeToString())  # same size, different ids
    proc = cli("--target", str(TARGET), "--draft", str(draft))
    assert_one_error_line(proc.returncode, proc.stderr, proc.stdout, "tokenizer")


@needs_pair
def test_prompt_longer_than_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    context = generate.read_config(TARGET).max_seq_len
    main_error(capsys, [*PAIR, "--prompt", "Once upon a time " * context], "prompt", f"{context}-token context")


@needs_pair
def test_pair_too_big_for_memory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Refused from config.json alone: this 'checkpoint' has no weights file at all."""
    huge = tmp_path / "huge"
    huge.mkdir()
    config = json.loads((TARGET / "config.json").read_text())
    config.update(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                  head_dim=128, num_hidden_layers=100_000)  # ~8e13 parameters
    (huge / "config.json").write_text(json.dumps(config))
    shutil.copy(TARGET / "tokenizer.model", huge)
    main_error(capsys, ["--target", str(huge), "--draft", str(DRAFT)], "KV cache", "free")


@needs_pair
def test_checkpoint_without_weights(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = copy_draft(tmp_path)
    (broken / "model.safetensors").unlink()
    main_error(capsys, ["--target", str(TARGET), "--draft", str(broken)], "model.safetensors")
