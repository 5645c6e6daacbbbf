"""The cached calls the loops make: where each new token goes in a model's KV cache, how it is
rotated, and what it sees (a model.model.CacheCall). Three shapes cover every use:

* :func:`chain`: T tokens at slots start.. of every row (a prompt, a draft step, a
  verification), each seeing its row up to itself;
* :func:`ragged`: each row at its own start (a batch whose rows accepted different numbers
  of tokens), padded at the end;
* :func:`tree`: a few chain tokens, then a token tree's nodes after them, each node rotated
  by its depth and seeing the chain and its own ancestors -- the tree attention rule,
  written here once.

Each is built from host ints and lists, whose bounds are known without reading the device:
the model checks them against its cache on the host, and no call waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.call import CacheCall
from speculative.tree import TokenTree

_COUNTS: dict[torch.device, torch.Tensor] = {}


def counting(stop: int, device: torch.device | str) -> torch.Tensor:
    """0..stop-1 as a view of one kept tensor per device: a draft step builds a call for every
    token, and slicing costs a third of a fresh arange."""
    device = torch.device(device)
    counts = _COUNTS.get(device)
    if counts is None or counts.shape[0] < stop:
        with torch.inference_mode(False):  # a normal tensor: one made in inference mode would refuse autograd later
            counts = _COUNTS[device] = torch.arange(max(stop, 4096), device=device)
    return counts[:stop]


def causal(slots: torch.Tensor, window: int) -> torch.Tensor:
    """visible [B, T, window]: each token sees its row's slots up to its own."""
    return counting(window, slots.device) <= slots.unsqueeze(-1)


def chain(start: int, length: int, device: torch.device | str, rows: int = 1) -> CacheCall:
    """``length`` tokens at slots (and positions) start..start+length-1 of each of ``rows`` rows.
    A single token sees every slot up to its own, so its call needs no mask."""
    if start < 0 or length < 1:
        raise ValueError(f"a chain starts at a slot >= 0 and has a token at least, got {start} and {length}")
    slots = counting(start + length, device)[start:].expand(rows, length)
    visible = None if length == 1 else causal(slots, start + length)
    return CacheCall(slots, slots, visible, start + length, start + length - 1)


def ragged(starts: Sequence[int], length: int, cache_len: int, device: torch.device | str) -> CacheCall:
    """Row b's ``length`` tokens at slots starts[b].. (rows of different lengths share a call,
    padded at the end). A padding token's writes land in slots its row has not filled yet
    (overwritten before they are read), or past the cache's end in its scratch slot cache_len;
    it sees its row up to itself, so its (meaningless) output is finite. Rows that all start
    at one slot make a chain: a batch of one is the single-sequence call."""
    starts = [int(s) for s in starts]
    if any(s < 0 or s >= cache_len for s in starts):
        raise ValueError(f"row start positions {min(starts)}..{max(starts)} fall outside the KV cache ({cache_len})")
    if len(set(starts)) == 1 and starts[0] + length <= cache_len:
        return chain(starts[0], length, device, rows=len(starts))
    slots = torch.tensor([[min(s + i, cache_len) for i in range(length)] for s in starts], device=device)
    positions = slots.clamp(max=cache_len - 1)
    window = min(max(starts) + length, cache_len)
    return CacheCall(slots, positions, causal(slots, window), window, min(max(starts) + length - 1, cache_len))


def tree(start: int, prefix: int, nodes: TokenTree, device: torch.device | str) -> CacheCall:
    """One row: ``prefix`` chain tokens at slots start.. (the last of them is the tree's root;
    with prefix 0 the root is already at slot start - 1), then the tree's N nodes at the next
    slots. Node j is rotated as the root's position + its depth, and sees every slot before
    the nodes and, among the nodes, itself and its ancestors: what it would see if its branch
    were the sequence."""
    n, first = nodes.num_nodes, start + prefix
    if start < 0 or (prefix == 0 and start == 0):
        raise ValueError(f"a tree needs its root before it: start {start}, {prefix} chain tokens")
    slots = torch.arange(start, first + n, device=device).unsqueeze(0)
    positions = list(range(start, first)) + [first - 1 + d for d in nodes.depths()]
    visible = causal(slots, first + n)
    visible[0, prefix:, first:] = nodes.ancestor_mask().to(device)
    return CacheCall(slots, torch.tensor([positions], device=device), visible, first + n, first + n - 1)
