"""A LLaMA decoder written out by hand, with its own preallocated KV cache.

Read top to bottom: RMSNorm, the rotary embedding, the KV cache and its one call, attention
(grouped-query), the SwiGLU MLP, one transformer block, and the model. Parameter names
follow the Hugging Face layout (``layers.0.self_attn.q_proj``...) so that a checkpoint's
tensor names map one to one onto this code; the rotary embedding is HF's "rotate-half".

The calling convention, gpt-fast's "positions as data" with write slots and rotary
positions apart, as token trees need (docs/kv_cache.md):

* ``model(tokens)``: a plain causal forward over ``tokens`` [B, T], no cache (training).
* ``model.setup_cache(max_batch_size, max_seq_len)``, then ``model(tokens, call)`` with a
  :class:`CacheCall`: token i of row b has its keys and values written at slot
  ``slots[b, i]`` of cache row b, is rotated as position ``positions[b, i]``, and attends to
  the slots s < ``window`` of its row where ``visible[b, i, s]``. Nothing else is read or
  written: rolling back is writing at an earlier slot, and a stale entry is harmless as
  long as nothing sees it. ``return_hidden=True`` also returns the final norm's output.
* ``model.move_cache(rows, src, dst, upto)``: the one way to keep or move entries (whole rows:
  their first ``upto`` slots, where the caller knows no row holds more).

What a call is for (a chain, ragged rows, a tree) is the caller's business: the builders
are in model/call.py. A compiled model (model/fast/compile.py) runs the same ``step``, applied from outside."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.call import CacheCall, checked_move
from model.config import ModelConfig

# What a call returns besides the logits: nothing (False), the final norm's output (True), or
# the inputs of the layers a tuple names, concatenated (EAGLE-3 reads three of them).
Hidden = bool | tuple[int, ...]


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
        # no cast: a small draft's step pays for every operator call
        return self.weight * self._normalise(x)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


# ----------------------------------------------------------------------------- rotary embedding
def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, adjusted by the config's rope scaling (float32)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":  # position interpolation: positions divided by `factor`
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


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [T, head_dim] for the given absolute positions (float32).

    Rotate-half layout: dimensions i and i + d/2 form a pair and share a frequency. The
    sin table carries the rotation's sign, -sin on the first half and +sin on the second,
    which is what lets :func:`apply_rope` do without a negation and a concatenation."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    sin = angles.sin()
    return torch.cat((angles, angles), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)


def rope_tables(
    config: ModelConfig, length: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [length, head_dim] for positions 0..length-1, in ``dtype``."""
    inv_freq = rope_inverse_frequencies(config).to(device)
    cos, sin = rope_cos_sin(inv_freq, torch.arange(length, device=device))
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) by the position's angle. x: [B, H, T, D].

    The HF form is x * cos + cat(-x_2, x_1) * sin with x = cat(x_1, x_2); rolling x by
    half a head gives cat(x_2, x_1), and the signed sin table supplies the minus: the same
    products, bit for bit, with one roll in place of two slices, a negation and a concatenation
    (a one-token step of a small draft is bound by the operators it runs, not by arithmetic)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# ----------------------------------------------------------------------------- KV cache
class KVCache(nn.Module):
    """Keys and values of one layer, preallocated for [max_batch, kv_heads, slots, head_dim]."""

    def __init__(
        self,
        max_batch: int,
        n_kv_heads: int,
        slots: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        shape = (max_batch, n_kv_heads, slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(
        self, slots: torch.Tensor, window: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write token i of row b at slot slots[b, i] (slots: [B, 1, T, 1]); return the slots < window.
        One row copies whole head vectors (index_copy); rows with their own slots scatter, which
        reads an index per element (an index_put costs about twice either). A 16-bit cache is
        scattered as its bits (int16): on a CPU a bfloat16 or float16 scatter_ copies the whole
        cache at every call, where the int16 scatter writes only the new slots (CHANGELOG)."""
        batch = k.shape[0]
        if batch == 1:
            self.k[:1].index_copy_(2, slots.view(-1), k)
            self.v[:1].index_copy_(2, slots.view(-1), v)
        else:
            index = slots.expand_as(k)
            for cache, new in ((self.k, k), (self.v, v)):
                if cache.element_size() == 2:
                    cache, new = cache.view(torch.int16), new.view(torch.int16)
                cache[:batch].scatter_(2, index, new)
        return self.k[:batch, :, :window], self.v[:batch, :, :window]

    def move(
        self,
        rows: Sequence[int] | torch.Tensor,
        src: torch.Tensor | None,
        dst: torch.Tensor | None,
        upto: int | None = None,
    ) -> None:
        """Row b takes old row rows[b]: whole (src None; rows a LongTensor; only its first ``upto`` slots
        if given), or its entries at slots src[b] at slots dst[b] ([n, m]), gathered first (sources
        may overlap destinations); keys are moved, not re-rotated. A row at a time: a tree's path is
        one row, and two indices cost twice one."""
        for cache in (self.k, self.v):
            if src is None:
                cache[: len(rows), :, :upto] = cache[:, :, :upto].index_select(0, rows)
            else:
                for b, row in enumerate(rows):
                    cache[b].index_copy_(1, dst[b], cache[row].index_select(1, src[b]))


# ----------------------------------------------------------------------------- layers
class Attention(nn.Module):
    """Multi-head attention with grouped-query heads: each KV head serves n_heads/n_kv_heads queries."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.cache: KVCache | None = None

    @property
    def local_kv_heads(self) -> int:
        """KV heads this module holds: all of them, or a tensor-parallel shard's share."""
        return self.k_proj.out_features // self.head_dim

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """q, k and v [B, H, T, D], q and k rotated. The head counts are read from the weights,
        so that a tensor-parallel shard runs the same code."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write: tuple | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``write``: (slots [B, 1, T, 1], window) of a cached call, or None (no cache, causal)."""
        batch, seq, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if write is not None:
            k, v = self.cache.write(*write, k, v)
        causal = write is None and seq > 1  # no cache: plain causal attention
        out = attend(q, k, v, mask, causal)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k, v [B, KV, S, D], H a multiple of KV (grouped-query
    attention: query head h reads KV head h // (H / KV)); mask [B, 1, T, S] or None.

    On a CPU in bfloat16 or float16, PyTorch's kernel for grouped heads costs several times its
    float32 time, and more the longer the cache (docs/quantized.md). There, the query heads
    that share a KV head are folded into the query rows instead, [B, KV, group * T, D], which is
    the same attention: each folded row still sees its own token's mask row."""
    batch, heads, tokens, dim = q.shape
    group = heads // k.shape[1]
    folded = q.device.type == "cpu" and q.element_size() == 2 and group > 1 and not causal
    if not folded:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=group > 1
        )
    rows = q.reshape(batch, k.shape[1], group * tokens, dim)
    if mask is not None:
        mask = mask.unsqueeze(2).expand(batch, 1, group, tokens, mask.shape[-1])
        mask = mask.reshape(batch, 1, group * tokens, -1)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask)
    return out.view(batch, heads, tokens, dim)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.down_proj = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write: tuple | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, write, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------- the model
class CachedStack(nn.Module):
    """Blocks with a KV cache and the one cached call: what Llama and the feature head share.
    A subclass has ``config``, ``layers``, ``device``, ``dtype`` and ``step``."""

    def init_cache_state(self) -> None:
        self.cache_len = 0  # usable slots per row (max_seq_len); 0: no cache yet
        self.cache_batch = 0  # rows (max_batch_size)
        self._rope: torch.Tensor | None = (
            None  # [slots, 2, head_dim]: cos and sin of every position
        )

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        """A zeroed KV cache of max_seq_len slots per row plus a scratch slot (written by padding, never
        visible), and the rotary table."""
        if max_seq_len > self.config.max_seq_len:
            raise ValueError(
                f"cache length {max_seq_len} exceeds the model's max_seq_len {self.config.max_seq_len}"
            )
        kv_heads = self.layers[0].self_attn.local_kv_heads
        for layer in self.layers:
            layer.self_attn.cache = KVCache(
                max_batch_size,
                kv_heads,
                max_seq_len + 1,
                self.config.head_dim,
                self.dtype,
                self.device,
            )
        self._rope = torch.stack(
            rope_tables(self.config, max_seq_len + 1, self.device, self.dtype), 1
        )
        self.cache_len = max_seq_len
        self.cache_batch = max_batch_size

    def move_cache(
        self,
        rows: Sequence[int],
        src: Sequence[Sequence[int]] | None = None,
        dst: Sequence[Sequence[int]] | None = None,
        upto: int | None = None,
    ) -> None:
        """In every layer, row b takes old row rows[b]'s entries at slots src[b], at its slots dst[b]
        (a tree's path); without them, the whole old row (a batch's rows), or its first ``upto``
        slots where the caller knows no row holds more: a server's context is long and its rows
        short, and copying every slot of every row stalled the batch. Host lists, checked there."""
        if self._rope is None:
            raise RuntimeError("move_cache(...) needs setup_cache(...) first")
        if upto is not None and (src is not None or not 0 < upto <= self.cache_len):
            raise ValueError(f"upto moves whole rows' first 1..{self.cache_len} slots, got {upto}")
        rows, src, dst = checked_move(rows, src, dst, self.cache_batch, self.cache_len, self.device)
        if src is None:  # whole rows: one index for every layer, not one per layer and buffer
            rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self.layers:
            layer.self_attn.cache.move(rows, src, dst, upto)

    def cached(self, inputs: tuple[torch.Tensor, ...], call: CacheCall, return_hidden: bool) -> Any:
        """Check ``call`` against the cache on the host, then run it (:meth:`run`)."""
        if self._rope is None:
            raise RuntimeError("a cached call needs setup_cache(...) first")
        if not isinstance(call, CacheCall):
            raise TypeError(
                f"a cached call takes a CacheCall (see model/call.py), got {type(call).__name__}"
            )
        batch, seq = inputs[0].shape[:2]
        if tuple(call.slots.shape) != (batch, seq):
            raise ValueError(
                f"the call places {tuple(call.slots.shape)} tokens, the input has {(batch, seq)}"
            )
        if batch > self.cache_batch:
            raise ValueError(f"batch {batch} exceeds the cache's max_batch_size {self.cache_batch}")
        if call.top > self.cache_len or call.window > self.cache_len:
            raise ValueError(
                f"slots or positions up to {max(call.top, call.window - 1)} fall outside the KV cache "
                f"(max_seq_len {self.cache_len})"
            )
        return self.run(inputs, call, return_hidden)

    def run(self, inputs: tuple[torch.Tensor, ...], call: CacheCall, return_hidden: bool) -> Any:
        """A checked call: the step, on the call's tensors."""
        return self.step(
            *inputs, call.slots, call.positions, call.visible, call.window, return_hidden
        )

    def attention_inputs(
        self,
        positions: torch.Tensor,
        slots: torch.Tensor,
        visible: torch.Tensor | None,
        window: int,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple, torch.Tensor | None]:
        """What every layer of a cached call reads, built once: cos, sin, the writes, the mask."""
        cos, sin = self._rope[positions].unsqueeze(1).unbind(3)  # one gather for both tables
        mask = (
            None
            if visible is None
            else torch.where(visible.unsqueeze(1), 0.0, float("-inf")).to(self.dtype)
        )
        return cos, sin, (slots[:, None, :, None], window), mask


class Llama(CachedStack):
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
        self.init_cache_state()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self, tokens: torch.Tensor, call: CacheCall | None = None, return_hidden: Hidden = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, vocab] (float32, or float64 for a float64 model) for ``tokens`` [B, T],
        through the KV cache as ``call`` places them, or causal without a cache. With
        return_hidden True, also the final norm's output [B, T, dim]; with a tuple of layer
        ids, the inputs of those layers, concatenated [B, T, len(ids) * dim] (a drafter that
        reads the target's features wants them, and a second forward would cost a whole step)."""
        if call is not None:
            return self.cached((tokens,), call, return_hidden)
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"{tokens.shape[1]} tokens exceed the model's max_seq_len {self.config.max_seq_len}"
            )
        cos, sin = rope_tables(self.config, tokens.shape[1], self.device, self.dtype)
        return self.decode(self.embed_tokens(tokens), cos, sin, None, None, return_hidden)

    def step(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor | None,
        window: int,
        return_hidden: Hidden,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A cached call's computation, from tensors alone (what model/fast/compile.py compiles)."""
        return self.decode(
            self.embed_tokens(tokens),
            *self.attention_inputs(positions, slots, visible, window),
            return_hidden,
        )

    def decode(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write: tuple | None,
        mask: torch.Tensor | None,
        return_hidden: Hidden,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The blocks, the final norm and the output head; the hidden states ``return_hidden`` asks for."""
        taps = return_hidden if isinstance(return_hidden, tuple) else ()
        tapped = {}
        for i, layer in enumerate(self.layers):
            if i in taps:
                tapped[i] = x
            x = layer(x, cos, sin, write, mask)
        hidden = self.norm(x)
        logits = self.lm_head(hidden)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if taps:
            hidden = torch.cat([tapped[i] for i in taps], dim=-1)
        return (logits, hidden) if return_hidden else logits

    def example_inputs(
        self, batch: int, width: int
    ) -> tuple[torch.Tensor, ...]:  # for compiling the step
        return (torch.zeros(batch, width, dtype=torch.long, device=self.device),)
