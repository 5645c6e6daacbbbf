"""Reading llama.cpp GGUF files as a Hugging Face Llama checkpoint: config, weights, tokenizer.

A GGUF file is one self-describing blob: a header, typed key/value metadata (the model's
hyperparameters under ``llama.*``, the tokenizer under ``tokenizer.ggml.*``, the chat template),
a table of tensors (name, dimensions, ggml type, offset) and the aligned tensor data. The
``gguf`` package (llama.cpp's own Python reader) parses it and dequantizes every block format it
knows; this module only maps what it reads onto the layout :mod:`weights.checkpoint` loads.
What llama.cpp's converter (convert_hf_to_gguf.py) changes on the way in, and so what is undone here:

* Names. ``token_embd`` is the embedding, ``blk.N.attn_q`` ... ``blk.N.ffn_down`` the layers,
  ``output_norm`` the final norm, ``output`` the head; the head is absent when it is the embedding.
* Shapes. ggml lists a tensor's dimensions fastest-varying first (``ne[0]`` is the row length), so
  the stored shape is the reverse of PyTorch's: an HF ``[out, in]`` weight is ``[in, out]`` in the
  table. The bytes are in the same row-major order, so reversing the dimensions is all it takes.
* q_proj and k_proj rows. llama.cpp rotates interleaved pairs (x0, x1), (x2, x3) of a head, HF
  (and :mod:`model.model`) rotates halves (x_i, x_{i+d/2}). To keep the same model the converter
  reorders each head's output rows from halves to pairs; here the rows go back, per head
  (query heads for q, key/value heads for k). Any other order would change the attention scores.
* Llama-3.1 rope scaling. The converter does not store the config's four parameters: it computes
  one divisor per rotary frequency and stores them as the tensor ``rope_freqs.weight``. The llama3
  rule of :func:`model.model.rope_inverse_frequencies` depends on the original context length and
  the two band factors only through two wavelength thresholds, so the parameters are recovered by
  trying the published sets and a small grid (then solving for the band factors) until one
  reproduces every divisor; none means a rule this model does not implement, and the file is refused.
* Tokenizer. ``tokenizer.ggml.model`` is ``gpt2`` (byte-level BPE: tokens spelled in GPT-2's byte
  alphabet, merges as "left right" strings, the pre-tokenizer's split regex named by
  ``tokenizer.ggml.pre``) or ``llama`` (SentencePiece BPE: tokens with scores, no merges; pieces are
  joined best score first, ``<0xNN>`` tokens carry bytes no piece covers). Both become a
  ``tokenizer.json`` for the Hugging Face ``tokenizers`` library; for SentencePiece, each token's
  possible two-piece splits, ordered by its score, are the BPE merges that reproduce that greedy rule.

Quantized tensors come back in float32: a GGUF's blocks have no HF equivalent, so a converted
folder holds the dequantized values (``torch_dtype`` float32), while an F16 or BF16 file keeps its dtype.
Everything wrong with a file (truncated, corrupt, another architecture, a tensor that does not fit
the config) is a :class:`GGUFError` of one line naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weights.gguf_blocks import LAYOUTS, GroupCodes, block_codes

GGUF_SUFFIX = ".gguf"
_GGUF_MISSING = 'reading a GGUF file needs the gguf package: pip install -e ".[gguf]"'

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL = 1
UNKNOWN = 2
CONTROL = 3
USER_DEFINED = 4
UNUSED = 5
BYTE = 6

# Per-layer GGUF leaf name -> HF module name under model.layers.N.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = (
    "rope_freqs.weight"  # llama3 scaling as per-frequency divisors; becomes config, not a weight
)

# Pre-tokenizer split regexes, keyed by tokenizer.ggml.pre (the ones llama.cpp's llama-vocab.cpp uses).
# GPT-2's own pattern, which tokenizers' ByteLevel(use_regex=True) applies by itself:
_GPT2_NAMES = ("default", "gpt-2")
# SmolLM: every digit its own piece first, then GPT-2's pattern (llama.cpp's SMOLLM pre type):
_DIGIT_SPLIT = r"\p{N}"
# Llama 3 (tokenizer.ggml.pre "llama-bpe"): contractions in any case, a letter run with one leading
# non-letter, numbers in groups of up to three, punctuation runs, newlines, spaces.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("default", "gpt-2", "smollm", "llama-bpe")

# Llama-3 rope scaling sets Meta published: (factor, low_freq_factor, high_freq_factor, original context).
_LLAMA3_PUBLISHED = (
    (8.0, 1.0, 4.0, 8192),  # Llama 3.1 (8B, 70B, 405B) and 3.3
    (32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B and 3B
)
# The grid tried next; 8192 first because it is llama.cpp's default original context length.
_ORIGINAL_CONTEXTS = (8192, 4096, 2048, 16384, 32768, 65536, 131072, 1024)
_LOW_FACTORS = (1.0, 0.5, 2.0, 0.25, 4.0)
_HIGH_FACTORS = (4.0, 2.0, 8.0, 16.0, 1.0, 32.0, 64.0)
ROPE_FREQS_RTOL = 1e-6  # float32 storage rounds at ~6e-8; a wrong parameter set is off by far more


class GGUFError(ValueError):
    """A GGUF file that is unreadable or describes something other than a dense Llama model."""


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix, so a missing one still gets GGUF's message)."""
    path = Path(path)
    return path.name.lower().endswith(GGUF_SUFFIX) and not path.is_dir()


def _gguf_package() -> Any:
    # gguf is an optional extra (pip install -e ".[gguf]"): only GGUF users need it, so it is
    # imported on first use rather than with this module.
    try:
        import gguf
    except ImportError:
        raise GGUFError(_GGUF_MISSING) from None
    return gguf


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _is_kind(value: Any, kind: type) -> bool:
    """Whether a metadata value is of ``kind``: a bool is no number, and an int is whole."""
    if kind is list:
        return isinstance(value, list)
    if kind in (int, float):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        return kind is float or float(value).is_integer()
    return isinstance(value, kind)


# What GGUFReader (numpy memmap, struct-like parsing, enum lookups, utf-8 decoding) raises on a bad file.
_READ_ERRORS = (
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    OverflowError,
    struct.error,
    OSError,
    EOFError,
)


class GGUFFile:
    """An opened, validated GGUF file of a dense Llama model (metadata and tensor table only).

    Opening reads the header, the metadata and the tensor table (the data is memory-mapped, not read),
    and checks that they describe a model this project implements; tensors are dequantized on demand.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"GGUF file {self.path} does not exist")
        gguf = _gguf_package()
        try:
            self._reader = gguf.GGUFReader(self.path)
            self._tensors = {t.name: t for t in self._reader.tensors}
        except _READ_ERRORS as err:
            raise GGUFError(
                f"{self.path} is not a readable GGUF file (truncated or corrupt: "
                f"{_first_line(err)})"
            ) from None
        self._meta: dict[str, Any] = {}
        self._float32 = gguf.GGUFValueType.FLOAT32
        self._value_types = (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)
        arch = self._get("general.architecture", str)
        if arch is None:
            raise GGUFError(f"{self.path} has no general.architecture: not a model GGUF file")
        if arch != "llama":
            raise GGUFError(f"{self.path}: architecture {arch!r} is not supported (only 'llama')")
        self._read_hyperparameters()
        self._expected = self._expected_tensors()
        self._check_tensors()
        self.rope_scaling = self._rope_scaling()

    # ------------------------------------------------------------------ metadata
    def _get(self, key: str, kind: type, default: Any = None) -> Any:
        """The value of metadata ``key`` as ``kind`` (int, float, str, bool or list), or ``default``."""
        if key in self._meta:
            return self._meta[key]
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            value = self._field_value(field)
        except _READ_ERRORS as err:
            raise GGUFError(
                f"{self.path}: metadata {key} is unreadable ({_first_line(err)})"
            ) from None
        if not _is_kind(value, kind):
            raise GGUFError(f"{self.path}: metadata {key} is {value!r}, expected {kind.__name__}")
        if kind is float and field.types == [self._float32]:
            # The shortest decimal that is this float32 (1e-05, not 9.999999747378752e-06): the config's own value.
            value = float(str(np.float32(value)))
        self._meta[key] = kind(value) if kind in (int, float) else value
        return self._meta[key]

    def _field_value(self, field: Any) -> Any:
        """A metadata value as Python: a scalar, a str, or a list of them (by the reader's parts, which
        every gguf release since 0.10 has; ReaderField.contents() came later)."""
        string, array = self._value_types

        def decode(part: np.ndarray, kind: Any) -> Any:
            return bytes(part).decode("utf-8") if kind == string else part.tolist()

        if not field.types:
            return None
        if field.types[0] == array:
            kind = field.types[-1]
            if kind == string:
                return [decode(field.parts[i], kind) for i in field.data]
            return [v for i in field.data for v in decode(field.parts[i], kind)]
        value = decode(field.parts[field.data[0]], field.types[0])
        return value if field.types[0] == string else value[0]

    def _count(self, key: str, default: int | None = None) -> int:
        value = self._get(key, int, default)
        if value is None:
            raise GGUFError(f"{self.path} is missing metadata {key}")
        if value <= 0:
            raise GGUFError(f"{self.path}: metadata {key} must be positive, got {value}")
        return value

    def _read_hyperparameters(self) -> None:
        experts = self._get("llama.expert_count", int, 0)
        if experts:
            raise GGUFError(
                f"{self.path} is a mixture-of-experts llama ({experts} experts); only dense "
                "Llama models are supported"
            )
        self.n_layers = self._count("llama.block_count")
        self.dim = self._count("llama.embedding_length")
        self.hidden_dim = self._count("llama.feed_forward_length")
        self.n_heads = self._count("llama.attention.head_count")
        kv = self._reader.fields.get("llama.attention.head_count_kv")
        # a per-layer array: only one shared value is implemented
        if kv is not None and len(kv.types) > 1:
            counts = set(self._get("llama.attention.head_count_kv", list))
            if len(counts) != 1:
                raise GGUFError(
                    f"{self.path}: key/value heads differ between layers ({sorted(counts)}); "
                    "not implemented"
                )
            self.n_kv_heads = int(counts.pop())
        else:
            self.n_kv_heads = self._count("llama.attention.head_count_kv", self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise GGUFError(
                f"{self.path}: {self.n_heads} attention heads is not a multiple of "
                f"{self.n_kv_heads} key/value heads"
            )
        default_head_dim = self.dim // self.n_heads if self.dim % self.n_heads == 0 else None
        self.head_dim = self._count("llama.attention.key_length", default_head_dim)
        value_dim = self._count("llama.attention.value_length", self.head_dim)
        rotary = self._count("llama.rope.dimension_count", self.head_dim)
        if value_dim != self.head_dim or rotary != self.head_dim or self.head_dim % 2:
            raise GGUFError(
                f"{self.path}: key length {self.head_dim}, value length {value_dim} and rotary "
                f"dimensions {rotary} must be one even number; not implemented otherwise"
            )
        self.context_length = self._count("llama.context_length")
        self.norm_eps = self._get("llama.attention.layer_norm_rms_epsilon", float)
        if self.norm_eps is None:
            raise GGUFError(
                f"{self.path} is missing metadata llama.attention.layer_norm_rms_epsilon"
            )
        self.rope_theta = self._get("llama.rope.freq_base", float, 10000.0)  # llama.cpp's default
        tokens = self._get("tokenizer.ggml.tokens", list)
        embd = self._tensors.get("token_embd.weight")
        rows = int(embd.shape[-1]) if embd is not None and len(embd.shape) == 2 else None
        self.vocab_size = self._get("llama.vocab_size", int) or (len(tokens) if tokens else rows)
        if not self.vocab_size:
            raise GGUFError(
                f"{self.path}: no vocabulary size (no llama.vocab_size, tokens or token_embd)"
            )
        if tokens is not None and len(tokens) > self.vocab_size:
            raise GGUFError(
                f"{self.path}: {len(tokens)} tokens but the model has {self.vocab_size} embeddings"
            )

    # ------------------------------------------------------------------ tensors
    def _expected_tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """GGUF name -> (HF name, HF shape) for every weight this config implies."""
        d, q, kv = self.dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        layer_shapes = {
            "attn_norm": (d,),
            "attn_q": (q, d),
            "attn_k": (kv, d),
            "attn_v": (kv, d),
            "attn_output": (d, q),
            "ffn_norm": (d,),
            "ffn_gate": (self.hidden_dim, d),
            "ffn_up": (self.hidden_dim, d),
            "ffn_down": (d, self.hidden_dim),
        }
        out = {
            "token_embd.weight": ("model.embed_tokens.weight", (self.vocab_size, d)),
            "output_norm.weight": ("model.norm.weight", (d,)),
        }
        if "output.weight" in self._tensors:
            out["output.weight"] = ("lm_head.weight", (self.vocab_size, d))
        for i in range(self.n_layers):
            for leaf, shape in layer_shapes.items():
                out[f"blk.{i}.{leaf}.weight"] = (
                    f"model.layers.{i}.{_LAYER_TENSORS[leaf]}.weight",
                    shape,
                )
        return out

    def _check_tensors(self) -> None:
        names = set(self._tensors) - {ROPE_FREQS}
        unknown = sorted(names - set(self._expected))
        if unknown:
            raise GGUFError(
                f"{self.path}: tensors not in a dense Llama model: {', '.join(unknown[:5])}"
                + (" ..." if len(unknown) > 5 else "")
            )
        missing = sorted(set(self._expected) - names)
        if missing:
            raise GGUFError(
                f"{self.path}: missing tensors: {', '.join(missing[:5])}"
                + (" ..." if len(missing) > 5 else "")
            )
        gguf = _gguf_package()
        integer = {
            gguf.GGMLQuantizationType.I8,
            gguf.GGMLQuantizationType.I16,
            gguf.GGMLQuantizationType.I32,
            gguf.GGMLQuantizationType.I64,
        }
        for name, (hf, shape) in self._expected.items():
            tensor = self._tensors[name]
            # ggml's ne order is PyTorch's reversed
            stored = tuple(int(n) for n in reversed(tensor.shape))
            if stored != shape:
                raise GGUFError(
                    f"{self.path}: tensor {name} ({hf}) has shape {list(stored)} but the metadata "
                    f"implies {list(shape)}"
                )
            if tensor.tensor_type in integer:
                raise GGUFError(
                    f"{self.path}: tensor {name} is stored as integers ({tensor.tensor_type.name})"
                )

    def _dequantize(self, name: str) -> np.ndarray:
        """One tensor as float32 numpy, in PyTorch's dimension order."""
        gguf = _gguf_package()
        tensor = self._tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        kind = tensor.tensor_type
        try:
            # exact enough; dequantize() has no case for it
            if kind == gguf.GGMLQuantizationType.F64:
                values = np.asarray(tensor.data, dtype=np.float32)
            else:
                values = gguf.quants.dequantize(tensor.data, kind)
        except NotImplementedError:
            raise GGUFError(
                f"{self.path}: tensor {name} is stored as {kind.name}, which the gguf package "
                "cannot dequantize"
            ) from None
        except _READ_ERRORS as err:
            raise GGUFError(
                f"{self.path}: tensor {name} is unreadable ({_first_line(err)})"
            ) from None
        if values.size != math.prod(shape):
            raise GGUFError(
                f"{self.path}: tensor {name} holds {values.size} values, its shape {list(shape)} "
                f"needs {math.prod(shape)}"
            )
        return values.reshape(shape)

    def tensors(
        self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Every weight under its HF name, dequantized, q/k rows back in rotate-half order.

        ``lm_head.weight`` is absent when the head is tied to the embedding (no ``output.weight``).
        """
        return {hf: self.tensor(hf).to(device=device, dtype=dtype) for hf in self.shapes()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's HF name and shape, from the tensor table: nothing is read."""
        return {hf: shape for hf, shape in self._expected.values()}

    def tensor(self, hf_name: str) -> torch.Tensor:
        """One weight by its HF name, dequantized to float32, q/k rows back in rotate-half order.
        One at a time, so that a loader holds one weight in float32 at once, not the whole model."""
        name = self._by_hf()[hf_name]
        values = self._dequantize(name)
        # memory-mapped F32 data is read-only
        if not values.flags.writeable or values.dtype != np.float32:
            values = np.array(values, dtype=np.float32)
        tensor = torch.from_numpy(values)
        if not bool(torch.isfinite(tensor).all()):
            raise GGUFError(
                f"{self.path}: tensor {name} holds NaN or infinite values: the file is damaged"
            )
        if name.endswith(".attn_q.weight"):
            tensor = pairs_to_halves(tensor, self.n_heads)
        elif name.endswith(".attn_k.weight"):
            tensor = pairs_to_halves(tensor, self.n_kv_heads)
        return tensor.contiguous()

    def _by_hf(self) -> dict[str, str]:
        """HF name -> the file's own name."""
        return {hf: name for name, (hf, _shape) in self._expected.items()}

    def codes(self, only: Collection[str] | None = None) -> dict[str, GroupCodes]:
        """The matrices stored in a block kind of weights/gguf_blocks.py, as the file's own codes under
        their HF names (q/k rows back in rotate-half order, as :meth:`tensors` gives them); the others
        (float kinds, K-quants) are absent: read them with :meth:`tensors`. ``only``: those HF names
        alone (the others' blocks are not decoded)."""
        out: dict[str, GroupCodes] = {}
        for name, (hf, shape) in self._expected.items():
            tensor = self._tensors[name]
            if len(shape) != 2 or tensor.tensor_type.name not in LAYOUTS:
                continue
            if only is not None and hf not in only:
                continue
            try:
                codes = block_codes(tensor.data, tensor.tensor_type.name, shape)
            except ValueError as err:
                raise GGUFError(f"{self.path}: tensor {name} is unreadable ({err})") from None
            heads = {".attn_q.weight": self.n_heads, ".attn_k.weight": self.n_kv_heads}
            for suffix, n_heads in heads.items():
                if name.endswith(suffix):
                    order = pairs_to_halves(torch.arange(shape[0]), n_heads)
                    codes = codes.rows(order)
            out[hf] = codes
        return out

    def four_bit_shapes(self) -> dict[str, tuple[int, ...]]:
        """The block matrices stored as 4-bit codes this project reads as they are, by HF name, with
        their shapes: read from the tensor table, no block decoded."""
        return {
            hf: shape
            for name, (hf, shape) in self._expected.items()
            if hf.startswith("model.layers.")
            and LAYOUTS.get(self._tensors[name].tensor_type.name, (0, False, 0))[2] == 4
        }

    @property
    def tied(self) -> bool:
        return "output.weight" not in self._tensors

    def stored_dtype(self) -> torch.dtype:
        """float16 or bfloat16 when every matrix is stored so, else float32 (quantized or float32 files)."""
        gguf = _gguf_package()
        kinds = {
            self._tensors[name].tensor_type
            for name, (_, shape) in self._expected.items()
            if len(shape) == 2
        }
        if kinds == {gguf.GGMLQuantizationType.F16}:
            return torch.float16
        if kinds == {gguf.GGMLQuantizationType.BF16}:
            return torch.bfloat16
        return torch.float32

    # ------------------------------------------------------------------ rope
    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._get("llama.rope.scaling.type", str)
        factor = self._get("llama.rope.scaling.factor", float)
        # the key older llama.cpp wrote for linear scaling
        legacy = self._get("llama.rope.scale_linear", float)
        if kind is None and legacy is not None and legacy != 1.0:
            kind = "linear"
            factor = legacy
        linear = None
        if kind == "linear":
            if factor is None or not factor > 0:
                raise GGUFError(
                    f"{self.path}: linear rope scaling needs a positive llama.rope.scaling.factor, "
                    f"got {factor!r}"
                )
            linear = None if factor == 1.0 else {"rope_type": "linear", "factor": factor}
        elif kind not in (None, "none"):
            raise GGUFError(
                f"{self.path}: rope scaling {kind!r} is not implemented (only linear and llama3)"
            )
        if ROPE_FREQS not in self._tensors:
            return linear
        if linear is not None:
            raise GGUFError(
                f"{self.path}: both linear rope scaling and {ROPE_FREQS}; not implemented together"
            )
        divisors = self._dequantize(ROPE_FREQS).astype(np.float64).reshape(-1)
        if divisors.shape != (self.head_dim // 2,):
            raise GGUFError(
                f"{self.path}: {ROPE_FREQS} has {divisors.size} values, the rotary dimensions "
                f"imply {self.head_dim // 2}"
            )
        scaling = recover_llama3_scaling(divisors, self.rope_theta, self.head_dim)
        if scaling is False:
            raise GGUFError(
                f"{self.path}: {ROPE_FREQS} matches no llama3 rope scaling (factor, low/high "
                f"frequency factors, original context) within {ROPE_FREQS_RTOL:g} relative"
            )
        return scaling

    # ------------------------------------------------------------------ HF files
    def _token_id(self, key: str) -> int | None:
        value = self._get(f"tokenizer.ggml.{key}", int)
        if value is not None and not 0 <= value < self.vocab_size:
            raise GGUFError(
                f"{self.path}: tokenizer.ggml.{key} {value} is outside the vocabulary "
                f"({self.vocab_size})"
            )
        return value

    def hf_config(self) -> dict[str, Any]:
        """What the config.json of the HF LlamaForCausalLM this file came from would hold."""
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
        }
        if self.head_dim * self.n_heads != self.dim:
            config["head_dim"] = self.head_dim
        config.update(
            {
                "hidden_act": "silu",
                "attention_bias": False,
                "mlp_bias": False,
                "rms_norm_eps": self.norm_eps,
                "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling,
                "max_position_embeddings": self.context_length,
                "tie_word_embeddings": self.tied,
                "bos_token_id": self._token_id("bos_token_id"),
                "eos_token_id": self._token_id("eos_token_id"),
                "torch_dtype": str(self.stored_dtype()).removeprefix("torch."),
            }
        )
        pad = self._token_id("padding_token_id")
        if pad is not None:
            config["pad_token_id"] = pad
        return config

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json: every id that ends a turn (eos, then end-of-turn and end-of-message)."""
        ends: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self._token_id(key)
            if value is not None and value not in ends:
                ends.append(value)
        return {"bos_token_id": self._token_id("bos_token_id"), "eos_token_id": ends}

    def _vocabulary(self) -> tuple[list[str], list[int]]:
        tokens = self._get("tokenizer.ggml.tokens", list)
        if not tokens:
            raise GGUFError(f"{self.path} has no tokenizer (tokenizer.ggml.tokens)")
        types = self._get("tokenizer.ggml.token_type", list) or [NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise GGUFError(f"{self.path}: {len(types)} token types for {len(tokens)} tokens")
        return tokens, [int(t) for t in types]

    def _add_bos(self, kind: str) -> bool:
        # Absent flag: llama.cpp adds BOS for SentencePiece vocabularies and for Llama 3's, not for other BPE.
        default = kind == "llama" or self._get("tokenizer.ggml.pre", str) == "llama-bpe"
        return bool(self._get("tokenizer.ggml.add_bos_token", bool, default))

    def tokenizer_json(self) -> str:
        """A ``tokenizers`` tokenizer.json equivalent to the file's tokenizer.ggml.* vocabulary."""
        kind = self._get("tokenizer.ggml.model", str)
        tokens, types = self._vocabulary()
        if kind == "gpt2":
            model, pre_tokenizer, decoder, normalizer = self._byte_level(tokens)
        elif kind == "llama":
            model, pre_tokenizer, decoder, normalizer = self._sentencepiece(tokens, types)
        else:
            raise GGUFError(
                f"{self.path}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported "
                "(only 'gpt2' and 'llama')"
            )
        added = [
            {
                "id": i,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": kind_ != USER_DEFINED,
            }
            for i, (token, kind_) in enumerate(zip(tokens, types))
            if kind_ in (CONTROL, UNKNOWN, USER_DEFINED)
        ]
        template = self._template(tokens, kind)
        post_processor: dict[str, Any] = template
        if kind == "gpt2":  # byte-level offsets, then the special tokens
            post_processor = {
                "type": "Sequence",
                "processors": [
                    {
                        "type": "ByteLevel",
                        "add_prefix_space": False,
                        "trim_offsets": False,
                        "use_regex": True,
                    },
                    template,
                ],
            }
        document = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor,
            "decoder": decoder,
            "model": model,
        }
        return json.dumps(document, ensure_ascii=False)

    def _template(self, tokens: list[str], kind: str) -> dict[str, Any]:
        """TemplateProcessing that adds BOS (and EOS) as tokenizer.ggml.add_bos_token (add_eos_token) say."""
        bos, eos = self._token_id("bos_token_id"), self._token_id("eos_token_id")
        before = [bos] if self._add_bos(kind) and bos is not None else []
        add_eos = self._get("tokenizer.ggml.add_eos_token", bool, False)
        after = [eos] if add_eos and eos is not None else []

        def special(i: int, type_id: int) -> dict[str, Any]:
            return {"SpecialToken": {"id": tokens[i], "type_id": type_id}}

        def sequence(which: str, type_id: int) -> list[dict[str, Any]]:
            return (
                [special(i, type_id) for i in before]
                + [{"Sequence": {"id": which, "type_id": type_id}}]
                + [special(i, type_id) for i in after]
            )

        return {
            "type": "TemplateProcessing",
            "single": sequence("A", 0),
            "pair": sequence("A", 0) + sequence("B", 1),
            "special_tokens": {
                tokens[i]: {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]}
                for i in before + after
            },
        }

    def _byte_level(self, tokens: list[str]) -> tuple[dict, dict, dict, None]:
        pre = self._get("tokenizer.ggml.pre", str, "default")
        byte_level = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        }
        if pre in _GPT2_NAMES:
            pre_tokenizer: dict[str, Any] = byte_level
        elif pre == "smollm":
            pre_tokenizer = _split_then(_DIGIT_SPLIT, byte_level)
        elif pre == "llama-bpe":
            pre_tokenizer = _split_then(_LLAMA3_SPLIT, dict(byte_level, use_regex=False))
        else:
            raise GGUFError(
                f"{self.path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported "
                f"(known: {', '.join(PRE_TOKENIZERS)})"
            )
        merges = self._get("tokenizer.ggml.merges", list)
        if not merges:
            raise GGUFError(f"{self.path}: a gpt2 tokenizer needs tokenizer.ggml.merges")
        pairs = []
        for merge in merges:
            # the left part may itself start with a space, never the separator
            cut = merge.find(" ", 1)
            if cut < 0:
                raise GGUFError(
                    f"{self.path}: merge {merge!r} is not two tokens separated by a space"
                )
            pairs.append([merge[:cut], merge[cut + 1 :]])
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            # Llama 3 takes a pre-token that is itself a token whole, before any merge (llama.cpp does too).
            "ignore_merges": pre == "llama-bpe",
            "vocab": _vocab(tokens),
            "merges": pairs,
        }
        decoder = {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        }
        return model, pre_tokenizer, decoder, None

    def _sentencepiece(self, tokens: list[str], types: list[int]) -> tuple[dict, dict, dict, None]:
        scores = self._get("tokenizer.ggml.scores", list)
        if not scores or len(scores) != len(tokens):
            raise GGUFError(
                f"{self.path}: a llama (SentencePiece) tokenizer needs one score per token"
            )
        unk = self._token_id("unknown_token_id")
        prefix = bool(self._get("tokenizer.ggml.add_space_prefix", bool, True))
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": tokens[unk] if unk is not None else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": _vocab(tokens),
            "merges": sentencepiece_merges(tokens, scores, types),
        }
        # add_space_prefix: a space before the text (the first piece of it, as HF's Llama tokenizers do).
        pre_tokenizer = {
            "type": "Metaspace",
            "replacement": "\u2581",
            "prepend_scheme": "first" if prefix else "never",
            "split": False,
        }
        steps: list[dict[str, Any]] = [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]
        if prefix:
            steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        return model, pre_tokenizer, {"type": "Sequence", "decoders": steps}, None

    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json: the special tokens by text, BOS/EOS flags, chat template, context length."""
        tokens, _ = self._vocabulary()
        kind = self._get("tokenizer.ggml.model", str)
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        ):
            value = self._token_id(key)
            if value is not None:
                config[name] = tokens[value]
        config["add_bos_token"] = self._add_bos(kind or "")
        config["add_eos_token"] = bool(self._get("tokenizer.ggml.add_eos_token", bool, False))
        config["clean_up_tokenization_spaces"] = False
        config["model_max_length"] = self.context_length
        template = self.chat_template()
        if template is not None:
            config["chat_template"] = template
        return config

    def chat_template(self) -> str | None:
        return self._get("tokenizer.chat_template", str)


def _split_then(pattern: str, byte_level: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": pattern},
                "behavior": "Isolated",
                "invert": False,
            },
            byte_level,
        ],
    }


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # a duplicated spelling keeps its first id, as a lookup by text finds it
        vocab.setdefault(token, i)
    return vocab


def sentencepiece_merges(
    tokens: list[str], scores: list[float], types: list[int]
) -> list[list[str]]:
    """BPE merges that encode as SentencePiece's BPE does: every split of a normal token into two
    normal tokens is a merge, and merges producing a better-scored token come first.

    SentencePiece repeatedly joins the adjacent pair whose concatenation is the best-scored piece;
    ranking each pair by its result's score makes a BPE model pick the same pair. Ties (several
    splits of one token) go by the ids of the two parts.
    """
    ids = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind == NORMAL:
            ids.setdefault(token, i)
    candidates = []
    for token, i in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                candidates.append((-float(scores[i]), ids[left], ids[right], left, right))
    candidates.sort(key=lambda c: c[:3])
    return [[left, right] for *_, left, right in candidates]


def pairs_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, output rows (i, i+d/2) were stored as pairs (2i, 2i+1)."""
    out_features = weight.shape[0]
    head_dim = out_features // n_heads
    return (
        weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def llama3_divisors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """What llama3 scaling divides each rotary frequency by, as :func:`model.model.rope_inverse_frequencies`
    applies it (frequencies computed in float32 as there, the rule in float64)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    wavelen = 2 * math.pi / inv_freq.double().numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (original / wavelen - low) / (high - low)
        medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium)
    )


def recover_llama3_scaling(
    divisors: np.ndarray, theta: float, head_dim: int
) -> dict[str, Any] | None | bool:
    """The llama3 rope scaling whose divisors are ``divisors`` (None when all are 1, False when none fits)."""
    if not np.isfinite(divisors).all() or (divisors <= 0).any():
        return False
    if np.allclose(divisors, 1.0, rtol=0, atol=ROPE_FREQS_RTOL):
        return None
    factor = float(np.float32(divisors.max()))

    def fits(low: float, high: float, original: float) -> bool:
        if not (0 < low < high and original > 0):
            return False
        expected = llama3_divisors(theta, head_dim, factor, low, high, original)
        return bool(np.all(np.abs(expected - divisors) <= ROPE_FREQS_RTOL * np.abs(divisors)))

    tries: list[tuple[float, float, float]] = [
        (lo, hi, orig) for f, lo, hi, orig in _LLAMA3_PUBLISHED if f == factor
    ]
    tries += [
        (lo, hi, orig) for orig in _ORIGINAL_CONTEXTS for lo in _LOW_FACTORS for hi in _HIGH_FACTORS
    ]
    tries += _solve_band_factors(divisors, factor, theta, head_dim)
    for low, high, original in tries:
        if fits(low, high, original):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(original),
            }
    return False


def _solve_band_factors(
    divisors: np.ndarray, factor: float, theta: float, head_dim: int
) -> list[tuple[float, float, float]]:
    """(low, high, original) from the frequencies in the smoothed band, for each candidate original context.

    There ``1/divisor = (1 - s)/factor + s`` with ``s = (original/wavelen - low)/(high - low)``, so each
    such frequency gives one linear equation ``s*high + (1 - s)*low = original/wavelen``; two or more
    determine low and high (least squares). Only the ratios matter, so ``original`` is a free choice.
    """
    if factor <= 1.0:
        return []
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    wavelen = 2 * math.pi / inv_freq.double().numpy()
    band = (divisors > 1.0 + 1e-5) & (divisors < factor * (1.0 - 1e-5))
    if band.sum() < 2:
        return []
    s = (1.0 / divisors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    matrix = np.stack([1.0 - s, s], axis=1)
    out = []
    for original in _ORIGINAL_CONTEXTS:
        (low, high), *_ = np.linalg.lstsq(matrix, original / wavelen[band], rcond=None)
        out += [
            (float(low), float(high), original),
            (round(float(low), 6), round(float(high), 6), original),
        ]
    return out


def _dtype_of(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise GGUFError(f"dtype {dtype!r} is not one of {', '.join(names)}")
    return names[dtype]


def convert_gguf(
    path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype | str | None = None
) -> Path:
    """Write ``path`` (a llama GGUF) to ``out_dir`` as an HF-layout folder.

    config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json and,
    when the file has one, chat_template.jinja. ``dtype`` defaults to the file's own (float32 for a
    quantized file: the dequantized values).
    """
    # safetensors is a core dependency; deferred only so that importing this module stays light.
    from safetensors.torch import save_file

    gguf = GGUFFile(path)
    wanted = _dtype_of(dtype) or gguf.stored_dtype()
    # before any file is written: a bad tokenizer leaves no half folder
    tokenizer = gguf.tokenizer_json()
    out = Path(out_dir)
    tensors = gguf.tensors(dtype=wanted)
    config = dict(gguf.hf_config(), torch_dtype=str(wanted).removeprefix("torch."))
    files = {
        "config.json": json.dumps(config, indent=2) + "\n",
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": json.dumps(gguf.tokenizer_config(), indent=2, ensure_ascii=False)
        + "\n",
        "generation_config.json": json.dumps(gguf.generation_config(), indent=2) + "\n",
    }
    template = gguf.chat_template()
    if template is not None:
        files["chat_template.jinja"] = template
    try:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        for name, text in files.items():
            (out / name).write_text(text, encoding="utf-8")
    except OSError as err:
        raise GGUFError(f"cannot write {out} ({_first_line(err)})") from None
    return out
