"""Tiny Hugging Face Llama configs, random weights large enough to matter, and transformers as
the oracle.

The configs are every dimension small and nothing else unusual; :func:`randomize_` gives a
model weights large enough that attention is far from uniform, so that rotary/scaling mistakes
show up in logits. transformers is imported only when a model is built (it is a test-only
dependency and slow to import).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

# A Llama-2-shaped model in miniature: every dimension small, nothing else unusual.
BASE_HF_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# The configs every parity test runs over. Sequence lengths in the tests stay under 64,
# which is why the scaled configs use original_max_position_embeddings 64: with head_dim 16
# and theta 500000 the llama3 rule then leaves one frequency alone, smooths one and divides
# the rest, so all three of its branches are exercised.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama2": {},
    "gqa": {"num_attention_heads": 8, "num_key_value_heads": 2},
    "llama3.1": {
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "max_position_embeddings": 1024,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "linear-rope": {
        "max_position_embeddings": 512,
        "rope_scaling": {"type": "linear", "factor": 4.0},
    },
    "tied": {"tie_word_embeddings": True},
    "head-dim": {
        "head_dim": 32
    },  # head_dim * heads != hidden_size, as some Llama-family configs have
}


def hf_config(name: str = "llama2", **overrides: Any) -> dict[str, Any]:
    """A fresh config.json dict of one of the named tiny configs.

    Deep-copied because transformers' ``LlamaConfig`` writes into a rope_scaling dict it is given.
    """
    return copy.deepcopy({**BASE_HF_CONFIG, **HF_CONFIGS[name], **overrides})


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.15) -> torch.nn.Module:
    """Re-draw every parameter in place: matrices N(0, std), norm weights 1 + N(0, 0.1).

    Default inits (std 0.02 and norm weights of exactly 1) make attention almost uniform
    and hide a norm weight that was never loaded; these values make both visible.
    """
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for param in model.parameters():  # parameters() yields tied weights once
        if id(param) in seen:
            continue
        seen.add(id(param))
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
        value = 1 + 0.1 * noise if param.ndim == 1 else std * noise
        param.copy_(value.to(param.dtype))
    return model


def hf_model(config: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A randomly initialised transformers ``LlamaForCausalLM`` for ``config``."""
    # the reference oracle: heavy, only for these tests
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
    )

    model = LlamaForCausalLM(LlamaConfig(**config))
    return randomize_(model, seed).to(dtype).eval()


def hf_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


def random_tokens(batch: int, seq: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
