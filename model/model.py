"""A LLaMA decoder written out by hand, with its own preallocated KV cache.

Read top to bottom: RMSNorm, rotary embeddings, attention (grouped-query), the
SwiGLU MLP, one transformer block, and the model. Parameter names follow the
Hugging Face layout (``layers.0.self_attn.q_proj``...) so that a checkpoint's
tensor names map one to one onto this code, and the rotary embedding uses the
HF "rotate-half" convention for the same reason.

Calling convention (the contract the rest of the project relies on):

* ``model(tokens)``: plain causal forward over ``tokens`` [B, T], no cache.
* ``model.setup_cache(max_batch_size, max_seq_len)``: allocate the KV cache.
* ``model(tokens, start_pos=p)``: write keys/values for positions p..p+T-1 into
  the cache and attend to positions < p+T. Rolling back is calling again with a
  smaller ``start_pos``: entries past it are simply overwritten later.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight. Half-precision inputs are normalised in float32, as in the reference
    implementation; float64 stays float64 so that exactness proofs are not limited by this step."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float16, torch.bfloat16):
            return self.weight * self._normalise(x.float()).to(x.dtype)
        return self.weight * self._normalise(x)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


# ----------------------------------------------------------------------------- rotary
def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, adjusted by the config's rope scaling (float32)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        # Position interpolation: positions are divided by `factor`.
        return inv_freq / factor
    # Llama 3.1: leave high frequencies alone, divide low frequencies by `factor`,
    # and interpolate smoothly between the two bands.
    old_len = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [T, head_dim] for the given absolute positions (float32).

    Rotate-half layout: dimensions i and i + d/2 form a pair and share a frequency. The
    sin table carries the rotation's sign, -sin on the first half and +sin on the second,
    which is what lets :func:`apply_rope` do without a negation and a concatenation."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    sin = angles.sin()
    return torch.cat((angles, angles), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) by the position's angle. x: [B, H, T, D].

    The HF form is x * cos + cat(-x_2, x_1) * sin with x = cat(x_1, x_2); rolling x by
    half a head gives cat(x_2, x_1), and the signed sin table supplies the minus: the same
    products, bit for bit, with one roll in place of two slices, a negation and a
    concatenation (a one-token decode step of a small draft is bound by the number of
    operators it runs, not by arithmetic)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# ----------------------------------------------------------------------------- cache
class KVCache(nn.Module):
    """Keys and values of one layer, preallocated for [max_batch, kv_heads, max_seq_len, head_dim]."""

    def __init__(self, max_batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (max_batch, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v at positions start_pos.. and return everything up to the last one written."""
        batch, end = k.shape[0], start_pos + k.shape[2]
        self.k[:batch, :, start_pos:end] = k
        self.v[:batch, :, start_pos:end] = v
        return self.k[:batch, :, :end], self.v[:batch, :, :end]


# ----------------------------------------------------------------------------- layers
class Attention(nn.Module):
    """Multi-head attention with grouped-query heads: each KV head serves n_heads/n_kv_heads queries."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        # Set by model/fuse.py for decoding: q, k and v stacked into one layer, and the
        # number of query and KV heads it holds; q_proj, k_proj and v_proj are then None.
        self.qkv_proj: nn.Module | None = None
        self.qkv_heads = (0, 0)
        self.cache: KVCache | None = None

    @property
    def local_kv_heads(self) -> int:
        """KV heads this module holds: all of them, or a tensor-parallel shard's share."""
        if self.qkv_proj is not None:
            return self.qkv_heads[1]
        return self.k_proj.out_features // self.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                start_pos: int | None, mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]; the head count is read from the weights so that a
        # tensor-parallel shard (which holds only some heads) runs the same code.
        if self.qkv_proj is None:
            q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # the same, with one product, and one rotation for the query and key heads together
            n_q, n_kv = self.qkv_heads
            qkv = self.qkv_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            qk = apply_rope(qkv[:, :n_q + n_kv], cos, sin)
            q, k, v = qk[:, :n_q], qk[:, n_q:], qkv[:, n_q + n_kv:]
        if start_pos is not None:
            k, v = self.cache.update(start_pos, k, v)
        gqa = q.shape[1] != k.shape[1]
        if mask is None:  # no cache: plain causal attention (or a single query, which sees all)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=seq > 1, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.down_proj = nn.Linear(config.hidden_dim, config.dim, bias=False)
        # Set by model/fuse.py for decoding: gate and up stacked into one layer (gate_proj
        # and up_proj are then None).
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                start_pos: int | None, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """The decoder: embeddings, n_layers blocks, a final norm and the output head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.cache_len = 0  # max_seq_len of the allocated cache; 0 means none
        self.cache_batch = 0  # and its max_batch_size
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos/sin for every cache position

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate (or reallocate) a zeroed KV cache for every layer, and the rotary table for it."""
        if max_seq_len > self.config.max_seq_len:
            raise ValueError(f"cache length {max_seq_len} exceeds the model's max_seq_len {self.config.max_seq_len}")
        kv_heads = self.layers[0].self_attn.local_kv_heads
        for layer in self.layers:
            layer.self_attn.cache = KVCache(max_batch_size, kv_heads, max_seq_len,
                                            self.config.head_dim, self.dtype, self.device)
        inv_freq = rope_inverse_frequencies(self.config).to(self.device)
        cos, sin = rope_cos_sin(inv_freq, torch.arange(max_seq_len, device=self.device))
        self._rope = (cos.to(self.dtype), sin.to(self.dtype))
        self.cache_len, self.cache_batch = max_seq_len, max_batch_size

    def forward(self, tokens: torch.Tensor, start_pos: int | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] for ``tokens`` [B, T] placed at positions start_pos.. (0 if no cache)."""
        batch, seq = tokens.shape
        if start_pos is None:
            if seq > self.config.max_seq_len:
                raise ValueError(f"{seq} tokens exceed the model's max_seq_len {self.config.max_seq_len}")
            inv_freq = rope_inverse_frequencies(self.config).to(self.device)
            cos, sin = rope_cos_sin(inv_freq, torch.arange(seq, device=self.device))
            cos, sin, mask = cos.to(self.dtype), sin.to(self.dtype), None
        else:
            if self._rope is None:
                raise RuntimeError("model(tokens, start_pos=...) needs model.setup_cache(...) first")
            end = start_pos + seq
            if start_pos < 0 or end > self.cache_len:
                raise ValueError(f"positions {start_pos}..{end - 1} fall outside the KV cache "
                                 f"(max_seq_len {self.cache_len})")
            if batch > self.cache_batch:
                raise ValueError(f"batch {batch} exceeds the cache's max_batch_size")
            cos, sin = self._rope[0][start_pos:end], self._rope[1][start_pos:end]
            # Query i sits at position start_pos+i and may see keys 0..start_pos+i: an additive
            # mask, -inf on keys j > start_pos+i and 0 elsewhere, built once for every layer
            # (attention would turn a boolean mask into this one in each layer).
            # A single query sees the whole prefix, so it needs no mask at all.
            mask = None
            if seq > 1:
                mask = torch.full((seq, end), float("-inf"), dtype=self.dtype, device=self.device)
                mask = mask.triu_(start_pos + 1)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, start_pos, mask)
        logits = self.lm_head(self.norm(x))
        return logits if logits.dtype == torch.float64 else logits.float()
