"""The one cached call of a model (model/model.py): where each new token's keys and values
go in the KV cache, the position that rotates it, and the slots it sees, as data, and the
three shapes of call that every loop makes:

* :func:`chain`: T tokens at slots start.. of every row (a prompt, a draft step, a
  verification), each seeing its row up to itself;
* :func:`ragged`: each row at its own start (a batch whose rows accepted different numbers
  of tokens), padded at the end;
* :func:`tree`: a few chain tokens, then a token tree's nodes after them, each node rotated
  by its depth and seeing the chain and its own ancestors -- the tree attention rule,
  written here once.

A call is checked twice, both times on the host: its own shapes here, and its bounds against
the cache by the model, from ``top`` and ``window``, which whoever builds it knows without
reading the device (the three shapes build them from host ints and lists). The host lists of
the cache's one move (``move_cache``) are checked here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CacheCall:
    """Where the T new tokens of each of B rows go, how each is rotated, and what each sees:
    slots and positions [B, T], visible [B, T, window] (None: every slot < window). ``top``, the
    largest slot or position, is known on the host, so that the model checks the cache's
    bounds without waiting for the device: the builder vouches for it (:func:`chain`,
    :func:`ragged` and :func:`tree` from host lists, :meth:`of` by reading)."""

    slots: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor | None
    window: int
    top: int

    def __post_init__(self) -> None:
        if not is_tensor(self.slots, torch.long) or self.slots.dim() != 2:
            raise ValueError(f"slots must be a LongTensor [B, T], got {described(self.slots)}")
        shape = tuple(self.slots.shape)
        if not is_tensor(self.positions, torch.long) or tuple(self.positions.shape) != shape:
            raise ValueError(
                f"positions must be a LongTensor of the slots' shape {shape}, got "
                f"{described(self.positions)}"
            )
        if not 1 <= self.window or self.top < 0:
            raise ValueError(
                f"a call reads at least one slot and writes none below 0 (window {self.window}, "
                f"top {self.top})"
            )
        if self.visible is not None and (
            not is_tensor(self.visible, torch.bool)
            or tuple(self.visible.shape) != (*shape, self.window)
        ):
            raise ValueError(
                f"visible must be a BoolTensor {(*shape, self.window)} (rows, tokens, window), got "
                f"{described(self.visible)}"
            )

    @classmethod
    def of(
        cls,
        slots: torch.Tensor,
        positions: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
    ) -> CacheCall:
        """A call from tensors, its bounds read from them. By default each token is rotated as its
        slot and sees its row's slots up to its own (causal)."""
        positions = slots if positions is None else positions
        low = min(int(slots.min()), int(positions.min()))
        top = max(int(slots.max()), int(positions.max()))
        if low < 0:
            raise ValueError(f"slots and positions must be >= 0, got {low}")
        if visible is None:
            visible = torch.arange(top + 1, device=slots.device) <= slots.unsqueeze(-1)
        elif is_tensor(visible, torch.bool) and visible.numel() and not bool(visible.any(-1).all()):
            # softmax over nothing is NaN: a token must see at least one slot (its own, usually)
            raise ValueError(
                "every token must see at least one slot: a row of visible is all False"
            )
        return cls(
            slots,
            positions,
            visible,
            visible.shape[-1] if isinstance(visible, torch.Tensor) else 0,
            top,
        )


Slots = Sequence[Sequence[int]]


def checked_move(
    rows: Sequence[int],
    src: Slots | None,
    dst: Slots | None,
    batch: int,
    cache_len: int,
    device: torch.device,
) -> tuple[list, torch.Tensor | None, torch.Tensor | None]:
    """The host lists of a move_cache, checked: rows in 0..batch-1, and src and dst both None or
    one list of slots (in 0..cache_len-1) per row, all of one length (returned as LongTensors)."""
    rows = host_ints(rows, "rows to keep", batch)
    if src is None and dst is None:
        return rows, None, None
    if (
        src is None
        or dst is None
        or not len(src) == len(dst) == len(rows)
        or not all(isinstance(s, Sequence) for s in (*src, *dst))
        or len({len(s) for s in (*src, *dst)}) > 1
    ):
        raise ValueError(
            "src and dst go together: for each kept row, two lists of slots, all of one length"
        )
    return rows, *(
        torch.tensor(host_ints(x, "slots to move", cache_len), dtype=torch.long, device=device)
        for x in (src, dst)
    )


def host_ints(values: Sequence[Any], name: str, limit: int) -> list:
    """Host ints (or equal-length lists of them), checked to lie in 0..limit-1."""
    nested = bool(values) and isinstance(values[0], Sequence)
    flat = [v for row in values for v in row] if nested else list(values)
    if (
        not all(type(v) is int for v in flat)
        or any(v < 0 or v >= limit for v in flat)
        or len(values) > limit
    ):
        raise ValueError(f"{name} must be ints in 0..{limit - 1}, got {list(values)}")
    return [list(v) for v in values] if nested else list(values)


def is_tensor(x: object, dtype: torch.dtype) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == dtype


def described(x: object) -> str:
    return (
        f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
    )


# ----------------------------------------------------------------------------- the three shapes
_COUNTS: dict[torch.device, torch.Tensor] = {}


def counting(stop: int, device: torch.device | str) -> torch.Tensor:
    """0..stop-1 as a view of one kept tensor per device: a draft step builds a call for every
    token, and slicing costs a third of a fresh arange."""
    device = torch.device(device)
    counts = _COUNTS.get(device)
    if counts is None or counts.shape[0] < stop:
        # a normal tensor: one made in inference mode would refuse autograd later
        with torch.inference_mode(False):
            counts = _COUNTS[device] = torch.arange(max(stop, 4096), device=device)
    return counts[:stop]


def causal(slots: torch.Tensor, window: int) -> torch.Tensor:
    """visible [B, T, window]: each token sees its row's slots up to its own."""
    return counting(window, slots.device) <= slots.unsqueeze(-1)


def chain(start: int, length: int, device: torch.device | str, rows: int = 1) -> CacheCall:
    """``length`` tokens at slots (and positions) start..start+length-1 of each of ``rows`` rows.
    A single token sees every slot up to its own, so its call needs no mask."""
    if start < 0 or length < 1:
        raise ValueError(
            f"a chain starts at a slot >= 0 and has a token at least, got {start} and {length}"
        )
    slots = counting(start + length, device)[start:].expand(rows, length)
    visible = None if length == 1 else causal(slots, start + length)
    return CacheCall(slots, slots, visible, start + length, start + length - 1)


def ragged(
    starts: Sequence[int], length: int, cache_len: int, device: torch.device | str
) -> CacheCall:
    """Row b's ``length`` tokens at slots starts[b].. (rows of different lengths share a call,
    padded at the end). A padding token's writes land in slots its row has not filled yet
    (overwritten before they are read), or past the cache's end in its scratch slot cache_len;
    it sees its row up to itself, so its (meaningless) output is finite. Rows that all start
    at one slot make a chain: a batch of one is the single-sequence call."""
    starts = [int(s) for s in starts]
    if any(s < 0 or s >= cache_len for s in starts):
        raise ValueError(
            f"row start positions {min(starts)}..{max(starts)} fall outside the KV cache ({cache_len})"
        )
    if len(set(starts)) == 1 and starts[0] + length <= cache_len:
        return chain(starts[0], length, device, rows=len(starts))
    slots = torch.tensor(
        [[min(s + i, cache_len) for i in range(length)] for s in starts], device=device
    )
    positions = slots.clamp(max=cache_len - 1)
    window = min(max(starts) + length, cache_len)
    return CacheCall(
        slots, positions, causal(slots, window), window, min(max(starts) + length - 1, cache_len)
    )


def tree(start: int, prefix: int, nodes: Any, device: torch.device | str) -> CacheCall:
    """One row: ``prefix`` chain tokens at slots start.. (the last of them is the tree's root;
    with prefix 0 the root is already at slot start - 1), then the tree's N nodes at the next
    slots. Node j is rotated as the root's position + its depth, and sees every slot before
    the nodes and, among the nodes, itself and its ancestors: what it would see if its branch
    were the sequence. ``nodes``: a token tree (speculative.verify.token_tree.TokenTree: num_nodes,
    depths(), ancestor_mask())."""
    n = nodes.num_nodes
    first = start + prefix  # the nodes. first slot; the root sits at the one before
    if start < 0 or (prefix == 0 and start == 0):
        raise ValueError(f"a tree needs its root before it: start {start}, {prefix} chain tokens")
    slots = torch.arange(start, first + n, device=device).unsqueeze(0)
    positions = list(range(start, first)) + [first - 1 + d for d in nodes.depths()]
    visible = causal(slots, first + n)
    visible[0, prefix:, first:] = nodes.ancestor_mask().to(device)
    return CacheCall(
        slots, torch.tensor([positions], device=device), visible, first + n, first + n - 1
    )
