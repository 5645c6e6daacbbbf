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
* ``model(tokens, ..., return_hidden=True)``: ``(logits, hidden)``, where hidden [B, T, dim]
  is what the output head reads (the final norm's output), from the same forward.
* ``model(tokens, start_pos=p, positions=pos, mask=m)``: the same writes to slots p..p+T-1,
  but token i is rotated as position pos[i] and sees new token j only where m[i, j] (every
  token still sees all slots < p). ``model.keep_cache(slots, dst)`` copies chosen slots'
  keys and values to dst, dst+1, ... These say nothing of what the caller builds with them.
* ``model(tokens, start_pos=[p_0, .., p_{B-1}])``: each batch row at its own position: row b
  writes slots p_b..p_b+T-1 of its cache row and attends to its slots < p_b+i+1, so rows of
  different lengths share one call. Rows with fewer new tokens are padded at the end; the
  padding's outputs mean nothing, its writes land in slots the row has not filled yet, and
  writes past the cache's end are dropped. ``model.keep_cache_rows(rows)`` makes cache rows
  0..n-1 the old rows ``rows`` (a batch that lost or reordered rows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


def rope_tables(config: ModelConfig, length: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [length, head_dim] for positions 0..length-1, in ``dtype``."""
    inv_freq = rope_inverse_frequencies(config).to(device)
    cos, sin = rope_cos_sin(inv_freq, torch.arange(length, device=device))
    return cos.to(dtype), sin.to(dtype)


def causal_mask(seq: int, start_pos: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The additive mask of a cached call of ``seq`` queries at positions start_pos..: query i
    may see keys 0..start_pos+i, so -inf on keys j > start_pos+i and 0 elsewhere. Built once
    for every layer (attention would turn a boolean mask into this one in each layer). A
    single query sees the whole prefix and needs no mask at all (None)."""
    if seq == 1:
        return None
    return torch.full((seq, start_pos + seq), float("-inf"), dtype=dtype, device=device).triu_(start_pos + 1)


def explicit_rope(rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                  seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the rotary tables for explicit positions [seq], in any order, repeats allowed:
    a token's rotation depends on the position it is given, not on the cache slot it goes to.
    A list of ints is checked on the host; a tensor costs one device -> host read for its range."""
    on_host = not isinstance(positions, torch.Tensor) and all(isinstance(p, int) for p in positions)
    listed = positions
    positions = torch.as_tensor(positions, device=rope[0].device)
    if positions.shape != (seq,) or positions.dtype != torch.long:
        raise ValueError(f"positions must be a LongTensor of shape ({seq},), one per new token; "
                         f"got {positions.dtype} of shape {tuple(positions.shape)}")
    low, high = (min(listed), max(listed)) if on_host else (int(v) for v in torch.aminmax(positions))
    if low < 0 or high >= rope[0].shape[0]:
        raise ValueError(f"positions {low}..{high} fall outside the rotary table (0..{rope[0].shape[0] - 1})")
    return rope[0][positions], rope[1][positions]


def explicit_mask(mask: torch.Tensor, start_pos: int, seq: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """The additive mask [seq, start_pos+seq] of a cached call whose new tokens see each other as
    the boolean ``mask`` [seq, seq] says (True: query i may attend new token j) and all see every
    cached slot < start_pos. A row with no True is allowed, since the token still sees the
    cache, unless start_pos is 0: then it would see nothing and softmax would give NaN."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (seq, seq):
        got = f"{mask.dtype} of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a BoolTensor of shape ({seq}, {seq}) over the new tokens; got {got}")
    mask = mask.to(device)
    if start_pos == 0 and not bool(mask.any(dim=1).all()):
        raise ValueError("with start_pos 0 every row of the mask needs a True: a token that sees no "
                         "new token and no cached slot has nothing to attend")
    full = torch.zeros((seq, start_pos + seq), dtype=dtype, device=device)
    full[:, start_pos:].masked_fill_(~mask, float("-inf"))
    return full


def cached_call_inputs(rope: tuple[torch.Tensor, torch.Tensor], start_pos: int, seq: int,
                       positions: torch.Tensor | None, mask: torch.Tensor | None, dtype: torch.dtype,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """cos, sin and the additive mask every layer of a cached call of ``seq`` tokens at
    start_pos reads, built once: the table rows of the chain's positions and the causal mask
    by default, or those of explicit ``positions`` and a boolean ``mask`` over the new tokens."""
    if positions is None:
        cos, sin = rope[0][start_pos:start_pos + seq], rope[1][start_pos:start_pos + seq]
    else:
        cos, sin = explicit_rope(rope, positions, seq)
    if mask is None:
        return cos, sin, causal_mask(seq, start_pos, dtype, device)
    return cos, sin, explicit_mask(mask, start_pos, seq, dtype, device)


@dataclass(frozen=True)
class RowSlots:
    """Where a per-row cached call writes: new token ``cols[n]`` of batch row ``rows[n]`` goes to
    cache slot ``slots[n]`` (LongTensors [N]); every row then reads its slots < ``end``."""

    rows: torch.Tensor
    cols: torch.Tensor
    slots: torch.Tensor
    end: int


@dataclass(frozen=True)
class StaticSlots:
    """Where a static-shape call writes (model/compile.py): token i of row b goes to slot
    positions[b, i] of cache row b (``rows`` is arange(B)[:, None]); every row then reads its
    whole cache row, masked, so that no shape depends on a position."""

    positions: torch.Tensor
    rows: torch.Tensor


def row_call_inputs(rope: tuple[torch.Tensor, torch.Tensor], starts: Sequence[int], seq: int, cache_len: int,
                    dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RowSlots]:
    """cos, sin [B, 1, T, D], the additive mask [B, 1, T, S] and the writes of a cached call
    whose row b puts its T new tokens at slots starts[b].. (a ragged batch, padded at the end).

    Token i of row b is at position starts[b] + i and sees that row's slots up to it. A
    padding token past the cache's end is not written and is rotated as the last slot; it
    sees the whole row, so its (meaningless) output is finite. Built once per call, on the
    host where it is cheap (B * T indices), so nothing waits for the device."""
    starts = [int(s) for s in starts]
    if any(s < 0 or s >= cache_len for s in starts):
        raise ValueError(f"row start positions {min(starts)}..{max(starts)} fall outside the KV cache ({cache_len})")
    end = min(max(starts) + seq, cache_len)
    position = [[min(s + i, cache_len - 1) for i in range(seq)] for s in starts]
    writes = [(b, i, s + i) for b, s in enumerate(starts) for i in range(seq) if s + i < cache_len]
    rows, cols, slots = torch.tensor(writes, dtype=torch.long).T.to(device)
    pos = torch.tensor(position, dtype=torch.long, device=device)  # [B, T]
    cos, sin, mask = positions_inputs(rope, pos, end, dtype)
    return cos, sin, mask, RowSlots(rows, cols, slots, end)


def positions_inputs(rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, slots: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, D] for token positions [B, T], and the additive mask [B, 1, T, slots]
    that lets each token see its row's slots up to its own position (-inf on the later ones)."""
    cos, sin = rope[0][positions].unsqueeze(1), rope[1][positions].unsqueeze(1)
    later = torch.arange(slots, device=positions.device) > positions.unsqueeze(-1)  # [B, T, S]
    mask = torch.zeros(later.shape, dtype=dtype, device=positions.device).masked_fill(later, float("-inf"))
    return cos, sin, mask.unsqueeze(1)


def static_call_inputs(rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, slots: torch.Tensor | None,
                       visible: torch.Tensor | None, width: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StaticSlots]:
    """cos, sin, the mask over a static cache of ``width`` slots and the writes of a
    static-shape call (Llama.static_step): token i of row b rotated as positions[b, i] and
    written at slots[b, i] (default: its position). It sees its row's slots up to its own
    position, or, with ``visible`` (BoolTensor [B, T, T], a tree's mask among the new tokens),
    every slot before the call's first and of the new tokens those visible says."""
    cos, sin, mask = positions_inputs(rope, positions, width, dtype)
    if visible is not None:
        index = torch.arange(width, device=positions.device)
        new = (slots.unsqueeze(-1) == index).to(dtype)  # [B, T, S]: new token j sits at slot s
        seen = (index < slots[:, :1].unsqueeze(-1)) | (visible.to(dtype) @ new > 0)  # [B, T, S]
        mask = torch.zeros(seen.shape, dtype=dtype, device=positions.device).masked_fill(~seen, float("-inf"))
        mask = mask.unsqueeze(1)
    rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
    return cos, sin, mask, StaticSlots(positions if slots is None else slots, rows)


def keep_static_cache(model: Any, max_batch_size: int, max_seq_len: int) -> bool:
    """For setup_cache: True when ``model`` is compiled and keeps its static cache (compiled
    steps must see the same buffers; stale entries are never visible, see docs/kv_cache.md);
    ValueError when the request does not fit in it."""
    if getattr(model, "compiled", None) is None:
        return False
    if not model.compiled.fits(max_batch_size, max_seq_len):
        raise ValueError(f"this model was compiled for at most {max(model.compiled.rows)} rows and "
                         f"{model.compiled.cache_len} positions; {max_batch_size} x {max_seq_len} do not fit")
    model.cache_len, model.cache_batch = max_seq_len, max_batch_size
    return True


def one_start(start_pos: int | Sequence[int] | None, batch: int, seq: int, cache_len: int,
              positions: torch.Tensor | None, mask: torch.Tensor | None) -> int | list[int] | None:
    """start_pos as given, or per-row positions as a list of ints; one row that fits is the
    plain int (so a batch of one runs exactly the single-sequence path)."""
    if start_pos is None or isinstance(start_pos, int):
        return start_pos
    starts = [int(s) for s in start_pos]
    if len(starts) != batch:
        raise ValueError(f"start_pos has {len(starts)} row positions for a batch of {batch}")
    if positions is not None or mask is not None:
        raise ValueError("positions and mask take one start_pos for all rows, not one per row")
    if batch == 1 and starts[0] + seq <= cache_len:
        return starts[0]
    return starts


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

    def write_rows(self, where: RowSlots, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's new keys and values at its own slots (a per-row call) and return
        every row's slots < where.end."""
        batch = k.shape[0]
        self.k[where.rows, :, where.slots] = k.transpose(1, 2)[where.rows, where.cols]
        self.v[where.rows, :, where.slots] = v.transpose(1, 2)[where.rows, where.cols]
        return self.k[:batch, :, :where.end], self.v[:batch, :, :where.end]

    def write_static(self, where: StaticSlots, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write at explicit slots and return the rows' whole caches (static shapes)."""
        batch = k.shape[0]
        self.k[where.rows, :, where.positions] = k.transpose(1, 2)
        self.v[where.rows, :, where.positions] = v.transpose(1, 2)
        return self.k[:batch], self.v[:batch]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Rows 0..n-1 become the old rows ``rows`` (gathered first, so any order works)."""
        n = rows.shape[0]
        self.k[:n] = self.k.index_select(0, rows)
        self.v[:n] = self.v.index_select(0, rows)

    def keep(self, slots: torch.Tensor, dst_start: int) -> None:
        """Copy the entries of ``slots`` (in order) into slots dst_start, dst_start+1, ... of every
        batch row. index_select gathers them into a new tensor before anything is written, so
        sources and destinations may overlap. Keys are moved as they are, not re-rotated."""
        end = dst_start + slots.shape[0]
        self.k[:, :, dst_start:end] = self.k.index_select(2, slots)
        self.v[:, :, dst_start:end] = self.v.index_select(2, slots)


def slots_to_keep(slots: torch.Tensor | list[int], dst_start: int, cache_len: int,
                  device: torch.device) -> torch.Tensor:
    """``slots`` as a LongTensor on ``device``, after checking that they and their destinations
    dst_start.. lie inside a cache of ``cache_len`` slots (for :meth:`KVCache.keep`)."""
    listed = None if isinstance(slots, torch.Tensor) else list(slots)
    if listed is not None:  # checked on the host: no device read
        slots = torch.tensor(listed, dtype=torch.long)
    if slots.dim() != 1 or slots.dtype != torch.long:
        raise ValueError(f"slots to keep must be a LongTensor [n] or a list of ints; "
                         f"got {slots.dtype} of shape {tuple(slots.shape)}")
    slots = slots.to(device)
    if dst_start < 0 or dst_start + len(slots) > cache_len:
        raise ValueError(f"keeping {len(slots)} slots at {dst_start}.. falls outside the KV cache ({cache_len})")
    if len(slots):
        low, high = (min(listed), max(listed)) if listed is not None else (int(v) for v in torch.aminmax(slots))
        if low < 0 or high >= cache_len:
            raise ValueError(f"slots {low}..{high} fall outside the KV cache ({cache_len})")
    return slots


def rows_to_keep(rows: torch.Tensor | list[int], cache_batch: int, device: torch.device) -> torch.Tensor:
    """``rows`` as a LongTensor on ``device``, after checking that they are rows of the cache."""
    rows = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows, dtype=torch.long)
    if rows.dim() != 1 or any(r < 0 or r >= cache_batch for r in rows.tolist()):
        raise ValueError(f"rows to keep must be a list of cache rows 0..{cache_batch - 1}, got {rows.tolist()}")
    return rows.to(device)


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
                start_pos: int | RowSlots | StaticSlots | None, mask: torch.Tensor | None) -> torch.Tensor:
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
        if isinstance(start_pos, RowSlots):  # each row at its own slots
            k, v = self.cache.write_rows(start_pos, k, v)
        elif isinstance(start_pos, StaticSlots):  # a compiled call: the whole cache, masked
            k, v = self.cache.write_static(start_pos, k, v)
        elif start_pos is not None:
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
                start_pos: int | RowSlots | StaticSlots | None, mask: torch.Tensor | None) -> torch.Tensor:
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
        # Set by model/compile.py: compiled static-shape steps that forward() hands cached calls
        # to when one fits (None: every call runs eagerly).
        self.compiled: Any = None

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate (or reallocate) a zeroed KV cache for every layer, and the rotary table for it.
        A compiled model keeps its static cache when the request fits in it (compiled steps must
        see the same buffers; stale entries are never visible, see docs/kv_cache.md)."""
        if max_seq_len > self.config.max_seq_len:
            raise ValueError(f"cache length {max_seq_len} exceeds the model's max_seq_len {self.config.max_seq_len}")
        if keep_static_cache(self, max_batch_size, max_seq_len):
            return
        kv_heads = self.layers[0].self_attn.local_kv_heads
        for layer in self.layers:
            layer.self_attn.cache = KVCache(max_batch_size, kv_heads, max_seq_len,
                                            self.config.head_dim, self.dtype, self.device)
        self._rope = rope_tables(self.config, max_seq_len, self.device, self.dtype)
        self.cache_len, self.cache_batch = max_seq_len, max_batch_size

    def keep_cache(self, src_slots: torch.Tensor | list[int], dst_start: int) -> None:
        """In every layer, copy the keys and values of ``src_slots`` (in that order) into slots
        dst_start, dst_start+1, ...; overlapping sources and destinations are fine. Slots after
        the copied ones are left as they are (the next call's start_pos decides what counts)."""
        if self._rope is None:
            raise RuntimeError("model.keep_cache(...) needs model.setup_cache(...) first")
        slots = slots_to_keep(src_slots, dst_start, self.cache_len, self.device)
        for layer in self.layers:
            layer.self_attn.cache.keep(slots, dst_start)

    def keep_cache_rows(self, rows: torch.Tensor | list[int]) -> None:
        """In every layer, cache rows 0..n-1 become the old rows ``rows`` (for a batch whose rows
        finished or were reordered; rows after n keep stale entries nobody reads)."""
        if self._rope is None:
            raise RuntimeError("model.keep_cache_rows(...) needs model.setup_cache(...) first")
        rows = rows_to_keep(rows, self.cache_batch, self.device)
        for layer in self.layers:
            layer.self_attn.cache.keep_rows(rows)

    def forward(self, tokens: torch.Tensor, start_pos: int | Sequence[int] | None = None, return_hidden: bool = False,
                positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, vocab] for ``tokens`` [B, T] placed at positions start_pos.. (0 if no cache).

        With return_hidden, also the hidden states [B, T, dim] the output head read: the final
        norm's output, in the model's dtype (a drafter that reads the target's features wants
        them, and a second forward to get them would cost a whole step).

        A cached call may also say how the new tokens relate, the same for every batch row:
        ``positions`` (LongTensor [T]) are the absolute positions that rotate them (default
        start_pos..start_pos+T-1), and ``mask`` (BoolTensor [T, T], True where new token i may
        attend new token j; default causal) which new tokens each one sees. The tokens still go
        to slots start_pos..start_pos+T-1, and each sees all slots < start_pos whatever the mask
        says (so a row of False sees only those; at start_pos 0 that is nothing: a ValueError).

        ``start_pos`` may instead be a list of one position per batch row (a ragged batch; see
        the module docstring and :func:`row_call_inputs`); positions and mask are then not taken."""
        batch, seq = tokens.shape
        if self.compiled is not None and start_pos is not None:
            out = self.compiled(self, (tokens,), start_pos, return_hidden, positions, mask)
            if out is not None:  # None: no compiled shape fits this call, which runs eagerly
                return out
        start_pos = one_start(start_pos, batch, seq, self.cache_len, positions, mask)
        if isinstance(start_pos, list):
            if self._rope is None:
                raise RuntimeError("model(tokens, start_pos=...) needs model.setup_cache(...) first")
            if batch > self.cache_batch:
                raise ValueError(f"batch {batch} exceeds the cache's max_batch_size")
            cos, sin, mask, start_pos = row_call_inputs(self._rope, start_pos, seq, self.cache_len, self.dtype,
                                                        self.device)
        elif start_pos is None:
            if positions is not None or mask is not None:
                raise ValueError("positions and mask are for a cached call: pass start_pos too")
            if seq > self.config.max_seq_len:
                raise ValueError(f"{seq} tokens exceed the model's max_seq_len {self.config.max_seq_len}")
            (cos, sin), mask = rope_tables(self.config, seq, self.device, self.dtype), None
        else:
            if self._rope is None:
                raise RuntimeError("model(tokens, start_pos=...) needs model.setup_cache(...) first")
            end = start_pos + seq
            if start_pos < 0 or end > self.cache_len:
                raise ValueError(f"positions {start_pos}..{end - 1} fall outside the KV cache "
                                 f"(max_seq_len {self.cache_len})")
            if batch > self.cache_batch:
                raise ValueError(f"batch {batch} exceeds the cache's max_batch_size")
            # From here on `mask` is the additive float mask every layer reads, built once.
            cos, sin, mask = cached_call_inputs(self._rope, start_pos, seq, positions, mask, self.dtype, self.device)
        return self.decode(tokens, cos, sin, start_pos, mask, return_hidden)

    def decode(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: Any,
               mask: torch.Tensor | None, return_hidden: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The layers, given the rotary rows, the mask and where the cache writes go."""
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, start_pos, mask)
        hidden = self.norm(x)
        logits = self.lm_head(hidden)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        return (logits, hidden) if return_hidden else logits

    def static_step(self, tokens: torch.Tensor, positions: torch.Tensor, return_hidden: bool = False,
                    slots: torch.Tensor | None = None, visible: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A cached call whose shapes depend only on tokens' shape [B, T] (what torch.compile
        and CUDA graphs need): token i of row b is rotated as positions[b, i], written at slot
        slots[b, i] (default: its position) and reads its row's whole cache with a mask. By
        default it sees the slots up to its own position. With ``visible`` (BoolTensor
        [B, T, T], a tree's mask among the new tokens) it sees every slot before the call's
        first slot, and of the new tokens those visible says. model/compile.py compiles this
        once per shape."""
        cos, sin, mask, where = static_call_inputs(self._rope, positions, slots, visible,
                                                   self.layers[0].self_attn.cache.k.shape[2], self.dtype)
        return self.decode(tokens, cos, sin, where, mask, return_hidden)

    def static_inputs(self, batch: int, width: int) -> tuple[torch.Tensor, ...]:
        """Inputs of static_step's shape [batch, width], for compiling it (model/compile.py)."""
        return (torch.zeros(batch, width, dtype=torch.long, device=self.device),)
