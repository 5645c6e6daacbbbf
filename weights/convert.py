"""Convert checkpoints from other formats into the HF layout that :func:`weights.load_model` reads.

    python -m weights.convert llama2c --checkpoint stories260K.bin --tokenizer tok512.model --out DIR
    python -m weights.convert gguf --gguf model.Q4_1.gguf --out DIR [--dtype float32|bfloat16|float16]

``gguf`` reads a llama.cpp GGUF file of a Llama model (:mod:`weights.gguf` explains the format)
and writes the folder with its tokenizer, tokenizer_config, generation_config and chat template.

``llama2c`` reads the original ("legacy", version 0) export of karpathy/llama2.c: a header
of seven little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
max_seq_len; a negative vocab_size means the classifier is *not* shared with the token
embedding), then float32 tensors in this order, each layer's copy of a tensor one after
the other: token embedding, attention RMSNorm weights, wq, wk, wv, wo, FFN RMSNorm
weights, w1, w2, w3, the final RMSNorm weight, two legacy rotary tables (cos and sin,
max_seq_len x head_dim/2 each; the model recomputes them from theta 10000, so here they
only serve as a check that the header describes the file) and, when not shared, the classifier.

llama2.c rotates interleaved pairs (x0, x1), (x2, x3), ... of each head, while the HF
layout (and :mod:`model.model`) rotates (x_i, x_{i+d/2}). The attention scores only depend
on the order of a head's rows through the rotation, so reordering the output rows of wq
and wk per head (even rows first, then odd rows) gives exactly the same model in the
rotate-half convention. wv, wo and everything else are copied unchanged.
"""

from __future__ import annotations

import argparse
import math
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch

from model import ConfigError, Llama, ModelConfig
from weights.checkpoint import CheckpointError, build_model, save_model
from weights.gguf import GGUFError, convert_gguf

_HEADER = struct.Struct("<7i")
_FLOAT_BYTES = 4
_VERSIONED_MAGIC = 0x616B3432  # "ak42": first uint32 of llama2.c's version 1 and 2 exports
# llama2.c hard-codes these in model.py and run.c; the legacy format does not store them.
LLAMA2C_ROPE_THETA = 10000.0
LLAMA2C_NORM_EPS = 1e-5


@dataclass(frozen=True)
class Llama2cHeader:
    """The seven numbers at the start of a llama2.c v0 file, validated."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    shared_classifier: bool
    max_seq_len: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every array in the file, in file order; ``rope.*`` are the legacy tables."""
        d, h, hd, L = self.dim, self.hidden_dim, self.head_dim, self.n_layers
        kv = self.n_kv_heads * hd
        per_layer = [
            ("input_layernorm", (d,)),
            ("self_attn.q_proj", (d, d)),
            ("self_attn.k_proj", (kv, d)),
            ("self_attn.v_proj", (kv, d)),
            ("self_attn.o_proj", (d, d)),
            ("post_attention_layernorm", (d,)),
            ("mlp.gate_proj", (h, d)),
            ("mlp.down_proj", (d, h)),
            ("mlp.up_proj", (h, d)),
        ]
        out = [("model.embed_tokens.weight", (self.vocab_size, d))]
        out += [
            (f"model.layers.{i}.{name}.weight", shape)
            for name, shape in per_layer
            for i in range(L)
        ]
        out += [
            ("model.norm.weight", (d,)),
            ("rope.cos", (self.max_seq_len, hd // 2)),
            ("rope.sin", (self.max_seq_len, hd // 2)),
        ]
        if not self.shared_classifier:
            out.append(("lm_head.weight", (self.vocab_size, d)))
        return out

    def file_size(self) -> int:
        """Bytes the header implies, by formula: a garbage header must not make us list 2^31 layers."""
        d, h, hd = self.dim, self.hidden_dim, self.head_dim
        kv = self.n_kv_heads * hd
        per_layer = 2 * d + 2 * d * d + 2 * kv * d + 3 * h * d
        classifiers = 1 if self.shared_classifier else 2
        floats = (
            classifiers * self.vocab_size * d
            + self.n_layers * per_layer
            + d
            + 2 * self.max_seq_len * (hd // 2)
        )
        return _HEADER.size + _FLOAT_BYTES * floats


def read_llama2c_header(path: str | Path) -> Llama2cHeader:
    """Parse and check the header; the file size must be exactly what the header implies."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"llama2.c checkpoint {path} does not exist")
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        raise CheckpointError(f"{path} is {size} bytes, too short for a llama2.c header (7 int32)")
    if struct.unpack_from("<I", raw)[0] == _VERSIONED_MAGIC:
        raise CheckpointError(
            f"{path} is a llama2.c version 1/2 export (magic 'ak42'); only the legacy "
            f"version 0 format is supported (export.py --version 0)"
        )
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab, max_seq_len = _HEADER.unpack(raw)
    values = dict(
        dim=dim,
        hidden_dim=hidden_dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=abs(vocab),
        max_seq_len=max_seq_len,
    )
    shown = ", ".join(f"{k}={v}" for k, v in values.items())
    bad = [k for k, v in values.items() if v <= 0]
    if bad or dim % n_heads or n_heads % n_kv_heads or (dim // n_heads) % 2:
        why = (
            f"{', '.join(bad)} not positive"
            if bad
            else "dim must be a multiple of n_heads, n_heads of n_kv_heads, and the head size even"
        )
        raise CheckpointError(f"{path} has a bad llama2.c header ({shown}): {why}")
    header = Llama2cHeader(shared_classifier=vocab > 0, **values)
    expected = header.file_size()
    if size != expected:
        what = "truncated" if size < expected else "longer than its header implies"
        raise CheckpointError(
            f"{path} is {what}: {size} bytes, but the header ({shown}, "
            f"{'shared' if header.shared_classifier else 'separate'} classifier) "
            f"implies {expected}"
        )
    return header


def interleaved_to_rotate_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder a q/k projection's output rows, per head, from pairs (2i, 2i+1) to halves (i, i+d/2)."""
    out_features, in_features = weight.shape
    head_dim = out_features // n_heads
    return (
        weight.reshape(n_heads, head_dim // 2, 2, in_features)
        .transpose(1, 2)
        .reshape(out_features, in_features)
    )


def read_llama2c(path: str | Path) -> tuple[Llama2cHeader, dict[str, torch.Tensor]]:
    """Every tensor of a v0 file under its HF name, q/k already in the rotate-half layout."""
    path = Path(path)
    header = read_llama2c_header(path)
    floats = np.memmap(path, dtype="<f4", mode="r", offset=_HEADER.size)
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in header.tensors():
        count = math.prod(shape)
        tensors[name] = torch.from_numpy(
            np.array(floats[offset : offset + count], dtype=np.float32)
        ).reshape(shape)
        offset += count
    _check_rope_tables(path, header, tensors.pop("rope.cos"), tensors.pop("rope.sin"))
    for i in range(header.n_layers):
        q = f"model.layers.{i}.self_attn.q_proj.weight"
        k = f"model.layers.{i}.self_attn.k_proj.weight"
        tensors[q] = interleaved_to_rotate_half(tensors[q], header.n_heads)
        tensors[k] = interleaved_to_rotate_half(tensors[k], header.n_kv_heads)
    return header, tensors


def _check_rope_tables(
    path: Path, header: Llama2cHeader, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """The stored tables must be cos/sin(pos * theta^(-2i/d)) for theta 10000.

    This catches a file whose header is wrong in a way that keeps its size (tensors then
    start at the wrong offsets) and an export made with another rope base, which the
    legacy format cannot express.
    """
    rows = min(header.max_seq_len, 8)
    freqs = 1.0 / LLAMA2C_ROPE_THETA ** (
        torch.arange(0, header.head_dim, 2, dtype=torch.float64) / header.head_dim
    )
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * freqs[None, :]
    err = max(
        (cos[:rows].double() - angles.cos()).abs().max().item(),
        (sin[:rows].double() - angles.sin()).abs().max().item(),
    )
    if not err < 1e-4:
        raise CheckpointError(
            f"{path}: its rotary tables are not those of rope theta {LLAMA2C_ROPE_THETA:g} "
            f"(max error {err:.3g}); the header does not describe this file"
        )


def _tokenizer_ids(tokenizer: Path, vocab_size: int) -> tuple[int, int]:
    if not tokenizer.is_file():
        raise CheckpointError(f"tokenizer {tokenizer} does not exist")
    try:
        sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    except (RuntimeError, OSError) as err:
        raise CheckpointError(
            f"{tokenizer} is not a SentencePiece model ({str(err).splitlines()[0]})"
        ) from None
    if sp.vocab_size() != vocab_size:
        raise CheckpointError(
            f"{tokenizer} has {sp.vocab_size()} pieces but the checkpoint's vocab_size "
            f"is {vocab_size}: wrong tokenizer for this model"
        )
    return sp.bos_id(), sp.eos_id()


def load_llama2c(path: str | Path, bos_id: int = 1, eos_id: int = 2) -> Llama:
    """A :class:`model.Llama` (float32, CPU) holding a llama2.c v0 checkpoint."""
    header, tensors = read_llama2c(path)
    try:
        config = ModelConfig(
            vocab_size=header.vocab_size,
            dim=header.dim,
            n_layers=header.n_layers,
            n_heads=header.n_heads,
            n_kv_heads=header.n_kv_heads,
            hidden_dim=header.hidden_dim,
            norm_eps=LLAMA2C_NORM_EPS,
            rope_theta=LLAMA2C_ROPE_THETA,
            max_seq_len=header.max_seq_len,
            tie_word_embeddings=header.shared_classifier,
            bos_id=bos_id,
            eos_id=eos_id,
        )
    except ConfigError as err:
        raise CheckpointError(f"{path}: {err}") from None
    return build_model(config, tensors)


def convert_llama2c(
    checkpoint: str | Path, out: str | Path, tokenizer: str | Path | None = None
) -> Path:
    """Write ``checkpoint`` (llama2.c v0) to ``out`` as config.json + model.safetensors (+ tokenizer.model).

    The tokenizer is checked against the checkpoint's vocabulary size and supplies the
    BOS/EOS ids; without one, llama2.c's fixed ids 1 and 2 are used.
    """
    checkpoint = Path(checkpoint)
    out = Path(out)
    header = read_llama2c_header(checkpoint)
    bos_id, eos_id = 1, 2
    if tokenizer is not None:
        tokenizer = Path(tokenizer)
        bos_id, eos_id = _tokenizer_ids(tokenizer, header.vocab_size)
    model = load_llama2c(checkpoint, bos_id=bos_id, eos_id=eos_id)
    save_model(model, out)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.model")
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (one ``error: ...`` line: 1 for a bad llama2.c input, 2 for a GGUF)."""
    parser = argparse.ArgumentParser(
        prog="python -m weights.convert", description=__doc__.split("\n\n")[0]
    )
    formats = parser.add_subparsers(dest="format", required=True)
    l2c = formats.add_parser("llama2c", help="a llama2.c legacy (version 0) .bin export")
    l2c.add_argument("--checkpoint", required=True, type=Path, help="the llama2.c .bin file")
    l2c.add_argument(
        "--tokenizer", required=True, type=Path, help="its SentencePiece tokenizer.model"
    )
    l2c.add_argument("--out", required=True, type=Path, help="output folder (HF layout)")
    gguf = formats.add_parser(
        "gguf", help="a llama.cpp GGUF file of a Llama model (any quantization)"
    )
    gguf.add_argument("--gguf", required=True, type=Path, help="the .gguf file")
    gguf.add_argument("--out", required=True, type=Path, help="output folder (HF layout)")
    gguf.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="weights' dtype in the folder (default: the file's own; float32 when quantized)",
    )
    args = parser.parse_args(argv)
    if args.format == "gguf":
        return _main_gguf(args)
    try:
        out = convert_llama2c(args.checkpoint, args.out, args.tokenizer)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _main_gguf(args: argparse.Namespace) -> int:
    """A bad GGUF file exits 2, like a bad argument: one ``error: ...`` line, no traceback."""
    try:
        out = convert_gguf(args.gguf, args.out, args.dtype)
    except GGUFError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    written = sorted(p.name for p in out.iterdir() if p.name in _GGUF_OUTPUTS)
    print(f"wrote {out}: {', '.join(written)}")
    return 0


_GGUF_OUTPUTS = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
}


if __name__ == "__main__":
    sys.exit(main())
