"""weights.convert llama2c: the stories260K checkpoint against llama2.c's published output, and a
synthetic export against a from-scratch NumPy forward written the way llama2.c's run.c computes."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from model.call import chain
from tests.support.paths import REPO_ROOT, SHARED_DATA, needs_shared
from weights import CheckpointError, load_model, load_tokenizer
from weights.convert import convert_llama2c, interleaved_to_rotate_half, main, read_llama2c_header

STORIES_BIN = SHARED_DATA / "stories260K" / "stories260K.bin"
TOK512 = SHARED_DATA / "stories260K" / "tok512.model"

# `expected_stdout` in karpathy/llama2.c test_all.py: `./run stories260K.bin -z tok512.bin -t 0.0 -n 200`.
# run.c's loop forwards positions 0..steps-1 (position 0 is the BOS token) and prints the token
# each forward picks, so -n 200 prints 200 new tokens (test_all.py's PyTorch twin agrees:
# generate(BOS, max_new_tokens=200)). run.c drops the space that starts the first piece after
# BOS ("▁Once" -> "Once"), as SentencePiece's decode drops the dummy-prefix space.
LLAMA2C_EXPECTED = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
    "she saw a big, red ball. She wanted to play with it, but it was too high.\n"
    "Lily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't know what to do. She said, "
    '"I want to play with your ball, but I can\'t find it."\n'
    "Lily was sad and didn't know what to do. She said, \"I'm sorry, Lily. I didn't know what to do.\"\n"
    "Lily didn't want to help her mom, so she"
)
NEW_TOKENS = 200


# ----------------------------------------------------------------------------- stories260K
@pytest.fixture(scope="module")
def stories_dir(tmp_path_factory) -> Path:
    """stories260K converted once for this module, through the real command line."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is absent (a fresh clone); CI provides it")
    out = tmp_path_factory.mktemp("stories260K-hf")
    cmd = [
        sys.executable,
        "-m",
        "weights.convert",
        "llama2c",
        "--checkpoint",
        str(STORIES_BIN),
        "--tokenizer",
        str(TOK512),
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


def _greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding with the KV cache: one forward per position, like run.c."""
    model.setup_cache(max_batch_size=1, max_seq_len=len(prompt) + new_tokens)
    tokens = list(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), chain(0, len(prompt), model.device))[0, -1]
        for _ in range(new_tokens):
            tokens.append(int(logits.argmax()))
            logits = model(torch.tensor([[tokens[-1]]]), chain(len(tokens) - 1, 1, model.device))[
                0, -1
            ]
    return tokens


@needs_shared
def test_stories260k_reproduces_llama2c(stories_dir: Path) -> None:
    assert sorted(p.name for p in stories_dir.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.model",
    ]
    assert (stories_dir / "tokenizer.model").read_bytes() == TOK512.read_bytes()
    model, tok = load_model(stories_dir), load_tokenizer(stories_dir)
    tokens = _greedy(model, [tok.bos_id], NEW_TOKENS)
    assert 1 not in tokens[1:]  # run.c would stop at a BOS
    text = tok.decode(tokens)
    assert text.startswith("Once upon a time, there was a little girl named Lily.")
    assert text == LLAMA2C_EXPECTED


@needs_shared
def test_stories260k_header_and_size(stories_dir: Path) -> None:
    """SOURCES.md: dim 64, hidden 172, 5 layers, 8 heads, 4 KV heads, vocab 512 (shared), seq 512."""
    header = read_llama2c_header(STORIES_BIN)
    assert (
        header.dim,
        header.hidden_dim,
        header.n_layers,
        header.n_heads,
        header.n_kv_heads,
        header.vocab_size,
        header.shared_classifier,
        header.max_seq_len,
    ) == (64, 172, 5, 8, 4, 512, True, 512)
    model = load_model(stories_dir)
    # 264,128 floats in the file, minus the two 512 x 4 rotary tables.
    assert sum(p.numel() for p in model.parameters()) == 264_128 - 2 * 512 * 4


@needs_shared
def test_converted_stories260k_matches_transformers(stories_dir: Path) -> None:
    """transformers reads the converted folder to the same logits, and greedy-generates the same story."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the reference) is in the [test] extras"
    )
    reference = transformers.LlamaForCausalLM.from_pretrained(
        stories_dir, dtype=torch.float32
    ).eval()
    ours, tok = load_model(stories_dir), load_tokenizer(stories_dir)
    tokens = torch.tensor([tok.encode(LLAMA2C_EXPECTED, bos=True)[:120]])
    with torch.no_grad():
        diff = (ours(tokens) - reference(input_ids=tokens).logits).abs().max().item()
    print(f"stories260K: max |logits diff| = {diff:.3g}")
    assert diff <= 1e-5
    generated = reference.generate(
        torch.tensor([[tok.bos_id]]),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert tok.decode(generated[0].tolist()) == LLAMA2C_EXPECTED


@needs_shared
def test_tokenizer_must_fit_the_checkpoint(tmp_path: Path) -> None:
    llama2_tok = SHARED_DATA / "llama2_tokenizer" / "tokenizer.model"
    with pytest.raises(
        CheckpointError, match="has 32000 pieces but the checkpoint's vocab_size is 512"
    ):
        convert_llama2c(STORIES_BIN, tmp_path / "out", llama2_tok)
    with pytest.raises(CheckpointError, match="is not a SentencePiece model"):
        convert_llama2c(STORIES_BIN, tmp_path / "out", STORIES_BIN)
    with pytest.raises(CheckpointError, match="tokenizer .*nope.model does not exist"):
        convert_llama2c(STORIES_BIN, tmp_path / "out", tmp_path / "nope.model")


# ----------------------------------------------------------------------------- synthetic exports
SMALL = dict(
    dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, max_seq_len=16
)


def write_llama2c(
    path: Path, shared: bool, seed: int = 0, theta: float = 10000.0, **shape
) -> dict[str, np.ndarray]:
    """Write a random llama2.c v0 file and return its arrays (float64 copies of what was written)."""
    s = {**SMALL, **shape}
    d, h, L, vocab, hd = (
        s["dim"],
        s["hidden_dim"],
        s["n_layers"],
        s["vocab_size"],
        s["dim"] // s["n_heads"],
    )
    kv = s["n_kv_heads"] * hd
    rng = np.random.default_rng(seed)
    w = {
        "tok": rng.normal(0, 1.0, (vocab, d)),
        "rms_att": 1 + 0.1 * rng.normal(size=(L, d)),
        "wq": rng.normal(0, 0.3, (L, d, d)),
        "wk": rng.normal(0, 0.3, (L, kv, d)),
        "wv": rng.normal(0, 0.3, (L, kv, d)),
        "wo": rng.normal(0, 0.3, (L, d, d)),
        "rms_ffn": 1 + 0.1 * rng.normal(size=(L, d)),
        "w1": rng.normal(0, 0.3, (L, h, d)),
        "w2": rng.normal(0, 0.3, (L, d, h)),
        "w3": rng.normal(0, 0.3, (L, h, d)),
        "rms_final": 1 + 0.1 * rng.normal(size=d),
    }
    angles = np.arange(s["max_seq_len"])[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]
    w["freq_cis_real"], w["freq_cis_imag"] = np.cos(angles), np.sin(angles)
    if not shared:
        w["wcls"] = rng.normal(0, 0.5, (vocab, d))
    w = {k: v.astype(np.float32).astype(np.float64) for k, v in w.items()}
    header = (d, h, L, s["n_heads"], s["n_kv_heads"], vocab if shared else -vocab, s["max_seq_len"])
    with path.open("wb") as f:
        f.write(struct.pack("<7i", *header))
        for array in w.values():  # insertion order above is the file order
            f.write(array.astype("<f4").tobytes())
    return w


def llama2c_forward(
    w: dict[str, np.ndarray], tokens: list[int], n_heads: int, n_kv_heads: int
) -> np.ndarray:
    """Logits for every position, computed as llama2.c's run.c does (interleaved rotary pairs), in float64."""
    T, dim = len(tokens), w["tok"].shape[1]
    hs = dim // n_heads

    def rmsnorm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * weight

    def rope(
        x: np.ndarray,
    ) -> np.ndarray:  # x: [T, heads*hs]; rotate (x[2i], x[2i+1]) by pos * 10000^(-2i/hs)
        pairs = x.reshape(T, -1, hs // 2, 2)
        freq = 10000.0 ** (-np.arange(0, hs, 2) / hs)
        ang = np.arange(T)[:, None, None] * freq[None, None, :]
        a, b = pairs[..., 0], pairs[..., 1]
        return np.stack(
            [a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], -1
        ).reshape(T, -1)

    x = w["tok"][tokens]
    causal = np.tril(np.ones((T, T), dtype=bool))
    for layer in range(w["wq"].shape[0]):
        h = rmsnorm(x, w["rms_att"][layer])
        q, k, v = rope(h @ w["wq"][layer].T), rope(h @ w["wk"][layer].T), h @ w["wv"][layer].T
        out = np.zeros_like(q)
        for head in range(n_heads):
            kvh = head // (n_heads // n_kv_heads)
            qh, kh, vh = (m[:, i * hs : (i + 1) * hs] for m, i in ((q, head), (k, kvh), (v, kvh)))
            scores = np.where(causal, qh @ kh.T / np.sqrt(hs), -np.inf)
            att = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head * hs : (head + 1) * hs] = (att / att.sum(-1, keepdims=True)) @ vh
        x = x + out @ w["wo"][layer].T
        h = rmsnorm(x, w["rms_ffn"][layer])
        gate = h @ w["w1"][layer].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w["w3"][layer].T)) @ w["w2"][layer].T
    return rmsnorm(x, w["rms_final"]) @ w.get("wcls", w["tok"]).T


@pytest.mark.parametrize("shared", [False, True], ids=["separate-classifier", "shared-classifier"])
def test_synthetic_export_matches_llama2c_forward(tmp_path: Path, shared: bool) -> None:
    weights = write_llama2c(tmp_path / "model.bin", shared=shared)
    out = convert_llama2c(tmp_path / "model.bin", tmp_path / "hf")
    model = load_model(out)
    assert model.config.tie_word_embeddings == shared
    assert not (out / "tokenizer.model").exists()
    tokens = list(np.random.default_rng(1).integers(0, SMALL["vocab_size"], SMALL["max_seq_len"]))
    expected = llama2c_forward(weights, tokens, SMALL["n_heads"], SMALL["n_kv_heads"])
    with torch.no_grad():
        got = model(torch.tensor([tokens])).double()[0].numpy()
    assert np.abs(expected).max() > 1.0
    assert np.abs(got - expected).max() < 1e-4
    # Without the q/k permutation the same weights give clearly different logits.
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.self_attn
            for proj, heads in (
                (attn.q_proj, SMALL["n_heads"]),
                (attn.k_proj, SMALL["n_kv_heads"]),
            ):
                proj.weight.copy_(_rotate_half_to_interleaved(proj.weight, heads))
        unpermuted = model(torch.tensor([tokens])).double()[0].numpy()
    assert np.abs(unpermuted - expected).max() > 1e-2


def _rotate_half_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    out_features, in_features = weight.shape
    return (
        weight.reshape(n_heads, 2, out_features // n_heads // 2, in_features)
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def test_permutation_moves_pairs_to_halves() -> None:
    """Rows of one 8-row head: interleaved (r0, r1), (r2, r3), ... become halves [r0 r2 r4 r6 | r1 r3 r5 r7]."""
    rows = torch.arange(16, dtype=torch.float32)[:, None]  # two heads of 8
    got = interleaved_to_rotate_half(rows, n_heads=2)[:, 0].tolist()
    assert got == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


# ----------------------------------------------------------------------------- clear errors
def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=f"llama2.c checkpoint {tmp_path / 'nope.bin'} does not exist"
    ):
        convert_llama2c(tmp_path / "nope.bin", tmp_path / "out")


def test_truncated_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    write_llama2c(path, shared=False)
    full = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(
        CheckpointError,
        match=rf"is truncated: {full - 10} bytes, but the header \(dim=32, .*\) "
        rf"implies {full}",
    ):
        convert_llama2c(path, tmp_path / "out")
    # absurd but well-formed: a size mismatch
    path.write_bytes(struct.pack("<7i", 32, 48, 2**30, 4, 2, 40, 16))
    with pytest.raises(CheckpointError, match=r"is truncated: 28 bytes"):
        convert_llama2c(path, tmp_path / "out")
    path.write_bytes(b"\x01\x00")
    with pytest.raises(CheckpointError, match=r"is 2 bytes, too short for a llama2.c header"):
        convert_llama2c(path, tmp_path / "out")


def test_longer_than_header(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    write_llama2c(path, shared=True)
    path.write_bytes(path.read_bytes() + b"\x00" * 8)
    with pytest.raises(CheckpointError, match="is longer than its header implies"):
        convert_llama2c(path, tmp_path / "out")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ((32, 48, 2, 0, 2, 40, 16), "n_heads not positive"),
        ((32, 48, 2, 5, 5, 40, 16), "dim must be a multiple of n_heads"),
        ((32, 48, 2, 4, 3, 40, 16), "n_heads of n_kv_heads"),
        ((32, 48, -2, 4, 2, 40, 16), "n_layers not positive"),
    ],
)
def test_bad_header(tmp_path: Path, header: tuple[int, ...], message: str) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(struct.pack("<7i", *header) + b"\x00" * 64)
    with pytest.raises(CheckpointError, match=f"has a bad llama2.c header .*{message}"):
        convert_llama2c(path, tmp_path / "out")


def test_versioned_export_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(struct.pack("<Ii", 0x616B3432, 1) + b"\x00" * 248)
    with pytest.raises(
        CheckpointError, match="version 1/2 export .* only the legacy version 0 format"
    ):
        convert_llama2c(path, tmp_path / "out")


def test_rotary_tables_of_another_theta_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    write_llama2c(path, shared=True, theta=500000.0)
    with pytest.raises(CheckpointError, match="rotary tables are not those of rope theta 10000"):
        convert_llama2c(path, tmp_path / "out")


def test_command_line_error_is_one_line(tmp_path: Path, capsys) -> None:
    code = main(
        [
            "llama2c",
            "--checkpoint",
            str(tmp_path / "nope.bin"),
            "--tokenizer",
            str(tmp_path / "t.model"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert (
        err.count("\n") == 1
        and err.startswith("error: llama2.c checkpoint")
        and "does not exist" in err
    )
    assert not (tmp_path / "out").exists()
