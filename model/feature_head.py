"""A one-layer network that predicts a LLaMA's next hidden state from its current one and
the next token (the architecture of EAGLE, Li et al. 2024, section 4).

Input at position j: the model's feature f_j (the final norm's output, which its output
head reads to predict token j+1) and the embedding of token j+1. One linear layer maps
[f_j; e(x_{j+1})] (2 dim) to dim, and one LLaMA decoder block with its own KV cache turns
the sequence of these into predictions of f_{j+1}. The model's own output head, applied
to a predicted feature, gives a distribution for token j+2. The embedding and the output
head are the model's and are not stored here: the head is the block and the linear layer.

This module is a network and nothing else; speculative/eagle.py drafts with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from model.config import ModelConfig
from model.model import (
    Block,
    KVCache,
    cached_call_inputs,
    keep_static_cache,
    one_start,
    rope_tables,
    row_call_inputs,
    rows_to_keep,
    slots_to_keep,
    static_call_inputs,
)


class FeatureHead(nn.Module):
    """fc([feature; embedding]) -> one decoder block -> the predicted next feature."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
        self.layers = nn.ModuleList([Block(config)])  # a list, so that names read like a LLaMA's
        self.cache_len = 0
        self.cache_batch = 0
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.compiled: Any = None  # set by model/compile.py, as for Llama

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        """A zeroed KV cache for the block, and the rotary table for it (a compiled head keeps
        its static cache, as Llama.setup_cache)."""
        if keep_static_cache(self, max_batch_size, max_seq_len):
            return
        attn = self.layers[0].self_attn
        attn.cache = KVCache(max_batch_size, attn.local_kv_heads, max_seq_len, self.config.head_dim,
                             self.dtype, self.device)
        self._rope = rope_tables(self.config, max_seq_len, self.device, self.dtype)
        self.cache_len, self.cache_batch = max_seq_len, max_batch_size

    def keep_cache(self, src_slots: torch.Tensor | list[int], dst_start: int) -> None:
        """Copy the block's keys and values of ``src_slots`` into slots dst_start.. (as Llama.keep_cache)."""
        if self._rope is None:
            raise RuntimeError("head.keep_cache(...) needs head.setup_cache(...) first")
        slots = slots_to_keep(src_slots, dst_start, self.cache_len, self.device)
        self.layers[0].self_attn.cache.keep(slots, dst_start)

    def keep_cache_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Cache rows 0..n-1 become the old rows ``rows`` (as Llama.keep_cache_rows)."""
        if self._rope is None:
            raise RuntimeError("head.keep_cache_rows(...) needs head.setup_cache(...) first")
        self.layers[0].self_attn.cache.keep_rows(rows_to_keep(rows, self.cache_batch, self.device))

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor, start_pos: int | Sequence[int] | None = None,
                positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted next features [B, T, dim] for features and next-token embeddings [B, T, dim]
        at positions start_pos.. (through the KV cache), or 0.. without a cache (training).
        ``positions``, ``mask`` and a list of per-row ``start_pos`` mean what they mean for
        Llama.forward, in a cached call."""
        batch, seq = features.shape[:2]
        if self.compiled is not None and start_pos is not None:
            out = self.compiled(self, (features, embeddings), start_pos, False, positions, mask)
            if out is not None:  # None: no compiled shape fits this call, which runs eagerly
                return out
        start_pos = one_start(start_pos, batch, seq, self.cache_len, positions, mask)
        if start_pos is None and (positions is not None or mask is not None):
            raise ValueError("positions and mask are for a cached call: pass start_pos too")
        x = self.fc(torch.cat([features, embeddings], dim=-1))
        if start_pos is None:
            cos, sin = rope_tables(self.config, seq, self.device, self.dtype)
            return self.layers[0](x, cos, sin, None, None)
        if self._rope is None:
            raise RuntimeError("head(features, embeddings, start_pos=...) needs head.setup_cache(...) first")
        if isinstance(start_pos, list):
            if batch > self.cache_batch:
                raise ValueError(f"batch {batch} exceeds the head cache's max_batch_size")
            cos, sin, mask, where = row_call_inputs(self._rope, start_pos, seq, self.cache_len, self.dtype,
                                                    self.device)
            return self.layers[0](x, cos, sin, where, mask)
        end = start_pos + seq
        if start_pos < 0 or end > self.cache_len:
            raise ValueError(f"positions {start_pos}..{end - 1} fall outside the head's KV cache ({self.cache_len})")
        cos, sin, mask = cached_call_inputs(self._rope, start_pos, seq, positions, mask, self.dtype, self.device)
        return self.layers[0](x, cos, sin, start_pos, mask)


    def static_step(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
                    return_hidden: bool = False, slots: torch.Tensor | None = None,
                    visible: torch.Tensor | None = None) -> torch.Tensor:
        """A cached call of static shapes, as Llama.static_step (model/compile.py compiles it);
        ``return_hidden`` is there for the common signature: the output is the features."""
        x = self.fc(torch.cat([features, embeddings], dim=-1))
        cos, sin, mask, where = static_call_inputs(self._rope, positions, slots, visible,
                                                   self.layers[0].self_attn.cache.k.shape[2], self.dtype)
        return self.layers[0](x, cos, sin, where, mask)

    def static_inputs(self, batch: int, width: int) -> tuple[torch.Tensor, ...]:
        """Inputs of static_step's shape [batch, width], for compiling it."""
        shape = (batch, width, self.config.dim)  # two tensors: the graph must not assume one object
        return tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))


def fingerprint(model: nn.Module) -> list[float]:
    """A few of a model's own weights, to tell which model a head was trained for: two heads
    of one shape fit two models of one shape equally well, so the shape is not enough.

    The first 8 weights of the final norm and the first 4 of the first 2 embedding rows,
    as floats; they survive a change of dtype to within bfloat16's rounding, which is how
    :func:`same_fingerprint` compares them."""
    values = torch.cat([model.norm.weight.detach()[:8].flatten(), model.embed_tokens.weight.detach()[:2, :4].flatten()])
    return [float(v) for v in values.float().cpu()]


def same_fingerprint(a: list[float], b: list[float]) -> bool:
    """Equal up to bfloat16 rounding (relative 1e-2, absolute 1e-3)."""
    return len(a) == len(b) and all(abs(x - y) <= 1e-3 + 1e-2 * abs(y) for x, y in zip(a, b))
