"""The shape of a LLaMA model, read from (and written to) a Hugging Face ``config.json``.

We accept exactly what :mod:`model.model` implements. Any field that would make a
Hugging Face model compute something different (attention bias, a sliding window,
an unknown rope scaling, another activation) is an error, never an approximation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config.json asks for something this model does not implement."""


# Fields that describe the checkpoint or training, not the forward pass.
_METADATA_FIELDS = {
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id",
    "model_type", "attention_dropout", "pretraining_tp", "tokenizer_class",
    "output_attentions", "output_hidden_states", "return_dict", "max_length",
    "rope_scaling", "rope_parameters", "rope_theta",
    "pard_token",  # a parallel draft's mask id (PARD; vLLM reads it): an input id, not a change to the forward
}
# Fields we implement only at one value: anything else is refused.
_FIXED_FIELDS = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": None,  # handled below, listed so it is not "unknown"
}
_SHAPE_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings",
}
_ROPE_TYPES = {"default", "linear", "llama3"}


@dataclass
class ModelConfig:
    """Hyperparameters of a LLaMA decoder (names follow Meta's reference code)."""

    vocab_size: int
    dim: int  # hidden size (d_model)
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads; fewer than n_heads means grouped-query attention
    hidden_dim: int  # SwiGLU inner size (HF intermediate_size)
    head_dim: int | None = None  # defaults to dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or {"rope_type": "linear", "factor": f}
    # or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    #     "original_max_position_embeddings"}
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 2048  # HF max_position_embeddings
    tie_word_embeddings: bool = False
    bos_id: int | None = 1
    eos_id: int | None = 2
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # metadata, kept for saving

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(f"hidden_size {self.dim} is not divisible by num_attention_heads {self.n_heads}")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"num_attention_heads {self.n_heads} is not a multiple of num_key_value_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build a config from the parsed JSON of a Hugging Face Llama ``config.json``."""
        model_type = hf.get("model_type", "llama")
        if model_type != "llama":
            raise ConfigError(f"model_type is {model_type!r}; only 'llama' checkpoints are supported")
        unknown = sorted(k for k in hf if k not in _METADATA_FIELDS | set(_FIXED_FIELDS) | _SHAPE_FIELDS)
        if unknown:
            raise ConfigError(f"config.json has fields this model does not implement: {', '.join(unknown)}")
        for key, wanted in _FIXED_FIELDS.items():
            if key == "tie_word_embeddings" or key not in hf:
                continue
            if hf[key] != wanted and not (wanted is False and hf[key] is None):
                raise ConfigError(f"config.json sets {key}={hf[key]!r}; only {wanted!r} is implemented")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ConfigError(f"config.json is missing required fields: {', '.join(missing)}")

        rope_theta, rope_scaling = _parse_rope(hf)
        n_heads = int(hf["num_attention_heads"])
        extra = {k: hf[k] for k in hf if k in _METADATA_FIELDS and not k.startswith("rope")}
        return cls(
            vocab_size=int(hf["vocab_size"]),
            dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            hidden_dim=int(hf["intermediate_size"]),
            head_dim=int(hf["head_dim"]) if hf.get("head_dim") else None,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_id=hf.get("bos_token_id", 1),
            eos_id=_first(hf.get("eos_token_id", 2)),
            extra=extra,
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` that transformers' ``LlamaConfig`` reads back to the same model."""
        rope_scaling = dict(self.rope_scaling) if self.rope_scaling else None
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
        }
        for key in ("torch_dtype", "pad_token_id", "pard_token"):
            if key in self.extra:
                out[key] = self.extra[key]
        return out

    def num_parameters(self) -> int:
        """Parameter count computed from the shape alone (no tensors needed)."""
        q = self.dim * self.n_heads * self.head_dim
        kv = 2 * self.dim * self.n_kv_heads * self.head_dim
        o = self.n_heads * self.head_dim * self.dim
        mlp = 3 * self.dim * self.hidden_dim
        norms = 2 * self.dim
        per_layer = q + kv + o + mlp + norms
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_layer + embed + head + self.dim


def _first(value: Any) -> Any:
    # Llama-3 configs list several end-of-sequence ids; the first is the primary one.
    return value[0] if isinstance(value, list) and value else value


def _parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Read rope_theta and rope scaling from either the transformers<5 fields
    (``rope_theta`` + ``rope_scaling``) or the transformers>=5 ``rope_parameters``."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"rope scaling type {rope_type!r} is not implemented (only linear and llama3)")
    if rope_type == "default":
        if merged:
            raise ConfigError(f"rope parameters {sorted(merged)} are not implemented without a scaling type")
        return theta, None
    needed = {
        "linear": {"factor"},
        "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    }[rope_type]
    if set(merged) != needed:
        raise ConfigError(f"rope scaling {rope_type!r} expects exactly {sorted(needed)}, got {sorted(merged)}")
    for key, value in merged.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"rope scaling {key} must be a positive number, got {value!r}")
    return theta, {"rope_type": rope_type, **merged}
