"""The shape of a LLaMA model, read from (and written to) a Hugging Face ``config.json``.

Every field a config.json may carry is sorted into one of two kinds (:data:`FIELDS`):

* **metadata**: names, ids and training settings that leave the logits alone (``torch_dtype``,
  ``pad_token_id``, nanotron's ``is_llama_config``...). Accepted and kept for saving.
* **forward**: changes what the network computes. Implemented (the shapes, rope, tied
  embeddings), or implemented at one value only and refused at any other (``attention_bias``
  true, ``hidden_act`` other than silu, ``rope_interleaved`` true), or not implemented at all
  and refused whatever its value (``qk_layernorm``). A refusal is a :class:`ConfigError` of one
  line: never an approximation.

A field nobody has sorted yet is neither: refusing it would stop every checkpoint a newer tool
writes, accepting it silently would hide one that does change the forward. It is recorded in
:attr:`ModelConfig.unclassified` so that the command line can name it on a ``note:`` line, and
the run goes on. docs/checkpoint_fields.md is the table of these kinds for real checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    """A config.json asks for something this model does not implement."""


@dataclass(frozen=True)
class FieldRule:
    """How one config.json field is treated: its kind, and the value it must have, if any."""

    kind: Literal["metadata", "forward"]
    handling: str  # what this project does with it, one phrase (docs/checkpoint_fields.md shows it)
    only: tuple[Any, ...] | None = (
        None  # forward fields implemented at these values only (None: any value)
    )
    refused: bool = False  # a forward field not implemented at any value


def _metadata(handling: str = "accepted") -> FieldRule:
    return FieldRule("metadata", handling)


def _forward(handling: str = "implemented", only: tuple[Any, ...] | None = None) -> FieldRule:
    return FieldRule("forward", handling, only)


def _refused(what: str) -> FieldRule:
    return FieldRule("forward", f"refused ({what})", refused=True)


# Every classified field. The claims about transformers are about transformers' modeling_llama.py
# and configuration_llama.py (read at 4.4x and 5.x); docs/checkpoint_fields.md gives each one.
FIELDS: dict[str, FieldRule] = {
    # --- metadata: never read by the forward pass
    "_name_or_path": _metadata(),
    "architectures": _metadata(),
    "transformers_version": _metadata(),
    "torch_dtype": _metadata("accepted (the storage dtype; the caller picks the compute dtype)"),
    "dtype": _metadata("accepted (transformers 5's name for torch_dtype)"),
    "use_cache": _metadata("accepted (whether transformers keeps a KV cache; ours always does)"),
    "initializer_range": _metadata("accepted (the std of the random init used before training)"),
    "attention_dropout": _metadata(
        "accepted (training only: transformers passes dropout 0.0 in eval)"
    ),
    # transformers 4.x cut each projection into pretraining_tp slices and summed the partial products,
    # which is the same product in another order; transformers 5 stores the field and reads it nowhere.
    "pretraining_tp": _metadata("accepted (splits the matmuls, not their result)"),
    "bos_token_id": _metadata("accepted (kept as bos_id)"),
    "eos_token_id": _metadata("accepted (kept as eos_id and eos_ids)"),
    "pad_token_id": _metadata("accepted (kept for saving)"),
    "unk_token_id": _metadata(),
    "tokenizer_class": _metadata(),
    "output_attentions": _metadata(),
    "output_hidden_states": _metadata(),
    "return_dict": _metadata(),
    "max_length": _metadata("accepted (a generation default)"),
    "is_llama_config": _metadata("accepted (nanotron's marker of its Llama config class)"),
    "transformers.js_config": _metadata(
        "accepted (transformers.js's ONNX dtype and KV cache hints)"
    ),
    "pard_token": _metadata(
        "accepted (a parallel draft's mask id: an input id, not a change to the forward)"
    ),
    # --- forward: implemented
    "model_type": _forward("implemented only at 'llama'"),  # checked first, with its own sentence
    "vocab_size": _forward(),
    "hidden_size": _forward(),
    "intermediate_size": _forward(),
    "num_hidden_layers": _forward(),
    "num_attention_heads": _forward(),
    "num_key_value_heads": _forward("implemented (grouped-query attention)"),
    "head_dim": _forward(),
    "rms_norm_eps": _forward(),
    "max_position_embeddings": _forward(
        "implemented (the longest sequence: rope tables and cache)"
    ),
    "tie_word_embeddings": _forward(),
    "rope_theta": _forward(),
    "rope_scaling": _forward("implemented for null, linear and llama3; other types refused"),
    "rope_parameters": _forward("implemented for default, linear and llama3; other types refused"),
    # --- forward: implemented at one value only
    "hidden_act": _forward("implemented only at 'silu'", only=("silu",)),
    "attention_bias": _forward("implemented only at false", only=(False, None)),
    "mlp_bias": _forward("implemented only at false", only=(False, None)),
    "sliding_window": _forward("implemented only at null", only=(None,)),
    "use_sliding_window": _forward("implemented only at false", only=(False, None)),
    # nanotron's rotary layout flag. False pairs dimension i with i + head_dim/2 (rotate-half), the layout
    # transformers' Llama and model/model.py compute; true pairs neighbours 2i, 2i+1 (GPT-J). transformers
    # reads the field nowhere, so a true there would be silently computed as false.
    "rope_interleaved": _forward("implemented only at false (rotate-half pairs)", only=(False,)),
    # --- forward: not implemented at any value
    "qk_layernorm": _refused("a norm on queries and keys"),
    "use_qk_norm": _refused("a norm on queries and keys"),
    "qk_norm": _refused("a norm on queries and keys"),
    "clip_qkv": _refused("clips the q/k/v projections"),
    "partial_rotary_factor": _refused("rotary on part of each head"),
    "layer_types": _refused("per-layer attention kinds"),
    "attn_logit_softcapping": _refused("caps the attention scores"),
    "final_logit_softcapping": _refused("caps the logits"),
    "logits_scaling": _refused("scales the logits"),
    "embedding_multiplier": _refused("scales the embeddings"),
    "residual_multiplier": _refused("scales the residual branches"),
    "attention_multiplier": _refused("replaces the attention scale"),
}
_ROPE_TYPES = {"default", "linear", "llama3"}
# Metadata written back by to_hf; the rest of `extra` is kept for callers but not needed to reload.
_SAVED_METADATA = ("torch_dtype", "pad_token_id", "pard_token")


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
    eos_id: int | None = (
        2  # the first end-of-sequence id (Llama-3 configs list several); kept for old callers
    )
    # Every end-of-sequence id, in the config's order: Llama-3.1 Instruct ends a turn on <|eot_id|>, the
    # third of three, so a generator that stops on eos_id alone would run past the end of the reply.
    eos_ids: tuple[int, ...] = ()
    # Metadata, kept for saving. Not compared: two configs of the same network are equal whatever their
    # transformers_version or initializer_range says.
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # Fields of the config.json that nobody has classified: accepted, and named to the user once.
    unclassified: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(
                    f"hidden_size {self.dim} is not divisible by num_attention_heads {self.n_heads}"
                )
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"num_attention_heads {self.n_heads} is not a multiple of num_key_value_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "hidden_dim",
            "max_seq_len",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        # eos_id and eos_ids describe one thing: a config built by hand gives either, from_hf both.
        self.eos_ids = tuple(self.eos_ids)
        if not self.eos_ids and self.eos_id is not None:
            self.eos_ids = (self.eos_id,)
        elif self.eos_ids and self.eos_id is None:
            self.eos_id = self.eos_ids[0]
        elif self.eos_ids and self.eos_id != self.eos_ids[0]:
            raise ConfigError(
                f"eos_id {self.eos_id} is not the first of eos_ids {list(self.eos_ids)}"
            )

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build a config from the parsed JSON of a Hugging Face Llama ``config.json``.

        Refuses (ConfigError) what would compute something else; accepts metadata; records the
        fields it does not know in ``unclassified`` rather than refusing them."""
        model_type = hf.get("model_type", "llama")
        if model_type != "llama":
            raise ConfigError(
                f"model_type is {model_type!r}; only 'llama' checkpoints are supported"
            )
        refused = sorted(k for k in hf if k in FIELDS and FIELDS[k].refused)
        if refused:
            raise ConfigError(
                f"config.json has fields this model does not implement: {', '.join(refused)}"
            )
        for key, rule in FIELDS.items():
            if rule.only is not None and key in hf and not _one_of(hf[key], rule.only):
                raise ConfigError(
                    f"config.json sets {key}={hf[key]!r}; only {rule.only[0]!r} is implemented"
                )
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in hf
        ]
        if missing:
            raise ConfigError(f"config.json is missing required fields: {', '.join(missing)}")

        rope_theta, rope_scaling = _parse_rope(hf)
        eos_ids = _token_ids("eos_token_id", hf.get("eos_token_id"))
        n_heads = int(hf["num_attention_heads"])
        extra = {k: hf[k] for k in hf if k in FIELDS and FIELDS[k].kind == "metadata"}
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
            eos_id=eos_ids[0] if eos_ids else None,
            eos_ids=eos_ids,
            extra=extra,
            unclassified=tuple(sorted(k for k in hf if k not in FIELDS)),
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
            # Several ids go back as the list they came as; one as the int Llama-2 configs write.
            "eos_token_id": list(self.eos_ids) if len(self.eos_ids) > 1 else self.eos_id,
        }
        for key in _SAVED_METADATA:
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


def _one_of(value: Any, allowed: tuple[Any, ...]) -> bool:
    # By identity for null and booleans: in Python 0 == False, and "attention_bias": 0 is not what was implemented.
    return any(
        value is a if a is None or isinstance(a, bool) else type(value) is type(a) and value == a
        for a in allowed
    )


def _token_ids(key: str, value: Any) -> tuple[int, ...]:
    """A token id field as a tuple: an int, a list of ints, or null/absent (empty)."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    for token in ids:
        # bool is an int in Python; a config that says `true` for a token id is broken, not id 1.
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConfigError(
                f"{key} must be a non-negative integer or a list of them, got {value!r}"
            )
    return tuple(ids)


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
        raise ConfigError(
            f"rope scaling type {rope_type!r} is not implemented (only linear and llama3)"
        )
    if rope_type == "default":
        if merged:
            raise ConfigError(
                f"rope parameters {sorted(merged)} are not implemented without a scaling type"
            )
        return theta, None
    needed = {
        "linear": {"factor"},
        "llama3": {
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        },
    }[rope_type]
    if set(merged) != needed:
        raise ConfigError(
            f"rope scaling {rope_type!r} expects exactly {sorted(needed)}, got {sorted(merged)}"
        )
    for key, value in merged.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"rope scaling {key} must be a positive number, got {value!r}")
    return theta, {"rope_type": rope_type, **merged}
