"""Compiled decoding: a model's cached forward at a few static shapes, compiled once each.

Why: a decode step of a small model costs about as much as the operators it runs -- some
microseconds of dispatch each on a CPU, a kernel launch each on a GPU -- not its arithmetic.
torch.compile turns the step into one graph: Inductor fuses the elementwise work (norms,
rotary, SwiGLU, masks) into a few generated kernels on a CPU, and on a GPU
``mode="reduce-overhead"`` replays the whole step as one CUDA graph.

How: ``Llama.static_step(tokens [B, T], positions [B, T])`` has shapes that depend on (B, T)
alone: the KV cache is one static buffer written in place at the given positions and read
whole, with a mask (gpt-fast's design). :func:`compile_for_decoding` allocates that buffer
(the cache length plus room for padding), compiles static_step once for every (rows, width)
it is given by running it, and installs :class:`CompiledSteps` as ``model.compiled``:
a cached call of B rows and T tokens then runs the smallest compiled width >= T for B rows,
padded at the end (the padding's writes land in slots the row has not filled, as for a
ragged batch), B rows run in the smallest compiled row count >= B, a token tree's call
(explicit positions and mask) in a compiled tree width, and anything else -- a prompt longer
than the widest shape -- runs eagerly on the same buffer. No shape met during
generation is new, so nothing recompiles (tests/test_compile.py makes any recompilation an
error over whole runs).

The model knows nothing of what calls it; the widths to compile are the caller's choice
(generate.py: 1, 2 and gamma + 1, or every width up to the largest gamma under "auto").
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

from model.model import KVCache, rope_tables

_SHAPES = 0  # shapes compiled so far in this process, over all models

# What compile_for_decoding's ``mode`` names: torch.compile's own modes, or Inductor options.
# "autotune" (the CPU default): Inductor's C++ GEMM kernels, chosen by timing them against
# the ATen product once per shape (max_autotune), over weights it lays out once as constants
# of the graph (freezing): on the shipped target, 2.1 ms a step against 4.2 ms eager and
# 6 ms for "default", which calls MKL's sgemm and repacks the weights at every call (see
# docs/compiled.md). Its costs: about a minute of compiling per model on 2 cores, a second
# copy of the weights, and weights fixed at compile time (change them and compile again).
# Each mode: (torch.compile's mode, whether Inductor freezes the weights). Freezing is set on
# Inductor's config while the shapes compile (compile_for_decoding compiles them all up
# front): passed in torch.compile's options it is not seen, and the C++ template is not used.
MODES: dict[str, tuple[str, bool]] = {
    "autotune": ("max-autotune-no-cudagraphs", True),
    "default": ("default", False),
    "reduce-overhead": ("reduce-overhead", False),
    "max-autotune": ("max-autotune", False),
}


class CompileError(ValueError):
    """A model or a combination that compile_for_decoding cannot compile."""


@dataclass
class CompiledSteps:
    """The compiled static-shape steps of one model, and what they were compiled for."""

    fn: Any  # torch.compile(model.static_step)
    rows: tuple[int, ...]  # batch sizes compiled, ascending
    widths: tuple[int, ...]  # tokens per call compiled, ascending
    hidden: bool  # compiled to return the hidden states too
    cache_len: int  # the longest cache a run may ask for
    compile_s: float  # wall time of compiling every shape
    tree_widths: tuple[int, ...] = ()  # tokens per call compiled for calls with a tree's positions and mask

    def fits(self, batch: int, length: int) -> bool:
        return batch <= max(self.rows) and length <= self.cache_len

    def width_for(self, seq: int, tree: bool = False) -> int | None:
        return next((w for w in (self.tree_widths if tree else self.widths) if w >= seq), None)

    def rows_for(self, batch: int) -> int | None:
        return next((r for r in self.rows if r >= batch), None)

    def __call__(self, model: Any, inputs: tuple[torch.Tensor, ...], start_pos: int | Sequence[int],
                 return_hidden: bool, positions: Any = None, mask: torch.Tensor | None = None) -> Any:
        """The call through a compiled shape, or None when none fits (the caller runs eagerly).

        B rows run in the smallest compiled row count >= B: the extra rows are padding that
        writes the first slots of cache rows B.. (rows a call of B rows does not own) and is
        cut off. T tokens run in the smallest compiled width >= T, padded at the end (their
        writes land in slots the row has not filled). A tree's call (explicit positions, a
        host list, and a mask, one row) runs in a compiled tree width the same way. ``inputs``:
        the step's first arguments, each [B, T, ...] (a Llama's tokens; a feature head's
        features and embeddings)."""
        batch, seq = inputs[0].shape[:2]
        tree = positions is not None or mask is not None
        width, padded_rows = self.width_for(seq, tree), self.rows_for(batch)
        if width is None or padded_rows is None or return_hidden != self.hidden:
            return None
        starts = [start_pos] * batch if isinstance(start_pos, int) else [int(s) for s in start_pos]
        if len(starts) != batch or any(s < 0 or s + seq > model.cache_len for s in starts):
            return None  # the eager path raises the error that explains it
        device = inputs[0].device
        extra = {}
        if tree:
            if padded_rows != 1 or not self.tree_inputs_fit(model, batch, starts[0], seq, positions, mask):
                return None  # the eager path checks them and says what is wrong
            slots = torch.arange(starts[0], starts[0] + width, device=device).unsqueeze(0)
            visible = torch.eye(width, dtype=torch.bool, device=device)  # padding sees itself only
            visible[:seq, :seq] = mask.to(device)
            rotate = list(positions) + [starts[0]] * (width - seq)
            positions = torch.tensor([rotate], device=device)
            extra = {"slots": slots, "visible": visible.unsqueeze(0)}
        else:
            positions = torch.tensor([[s + i for i in range(width)] for s in starts]
                                     + [list(range(width))] * (padded_rows - batch), device=device)
        # fresh tensors with standard strides (a [1, T] slice of a longer row has stride L in
        # its batch dimension, and the compiled step is specialised to strides too)
        if (width, padded_rows) != (seq, batch):
            inputs = tuple(F.pad(x, (0, 0) * (x.dim() - 2) + (0, width - seq, 0, padded_rows - batch)) for x in inputs)
        else:
            inputs = tuple(x.clone(memory_format=torch.contiguous_format) for x in inputs)
        out = self.fn(*inputs, positions, return_hidden, **extra)
        if (width, padded_rows) == (seq, batch):
            return out
        if return_hidden:
            return out[0][:batch, :seq], out[1][:batch, :seq]
        return out[:batch, :seq]

    @staticmethod
    def tree_inputs_fit(model: Any, batch: int, start: int, seq: int, positions: Any, mask: Any) -> bool:
        """A tree call the compiled step can take as it is: one row after a cached prefix, the
        positions a host list within the rotary table, the mask a BoolTensor [T, T]."""
        if batch != 1 or start == 0 or not isinstance(positions, list | tuple) or len(positions) != seq:
            return False
        if not all(isinstance(p, int) and 0 <= p < model._rope[0].shape[0] for p in positions):
            return False
        return isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape == (seq, seq)


def compile_for_decoding(model: nn.Module, widths: Sequence[int], rows: Sequence[int] = (1,),
                         cache_len: int | None = None, hidden: bool = False, mode: str | None = None,
                         tree_widths: Sequence[int] = ()) -> CompiledSteps:
    """Compile ``model``'s cached forward for every batch size in ``rows`` and every call
    width in ``widths``, with a static KV cache of ``cache_len`` positions (default: the
    model's max_seq_len) for max(rows) rows; ``tree_widths``: widths of one-row calls with a
    token tree's positions and mask. ``hidden``: the steps also return the hidden
    states (the target of a feature drafter). ``mode``: a key of MODES, default "autotune" on
    a CPU and "reduce-overhead" (CUDA graphs) on a GPU. Returns what was compiled,
    with the compile time; the model's later cached calls use it where a shape fits.

    Prepacked layers (model/prepack.py) stay oneDNN products inside the graph. Refused
    (CompileError): tensor-parallel shards (their collectives are not captured)."""
    from model.tensor_parallel import ParallelAttention

    if any(isinstance(m, ParallelAttention) for m in model.modules()):
        raise CompileError("tensor-parallel models are not compiled: their all-reduces would run outside the graph")
    widths = tuple(sorted(set(int(w) for w in widths)))
    rows = tuple(sorted(set(int(r) for r in rows)))
    tree_widths = tuple(sorted(set(int(w) for w in tree_widths)))
    if not widths or widths[0] < 1 or not rows or rows[0] < 1 or (tree_widths and tree_widths[0] < 1):
        raise CompileError(f"widths and rows must be integers >= 1, got {widths} and {rows}")
    cache_len = cache_len or model.config.max_seq_len
    if cache_len > model.config.max_seq_len:
        raise CompileError(f"cache length {cache_len} exceeds the model's max_seq_len {model.config.max_seq_len}")
    # One static buffer for every call: the cache length, plus room for the padding of the widest call.
    slots = cache_len + max(widths + tree_widths)
    kv_heads = model.layers[0].self_attn.local_kv_heads
    for layer in model.layers:
        layer.self_attn.cache = KVCache(rows[-1], kv_heads, slots, model.config.head_dim, model.dtype, model.device)
    model._rope = rope_tables(model.config, slots, model.device, model.dtype)
    model.cache_len, model.cache_batch = cache_len, rows[-1]
    if mode is None:
        mode = "reduce-overhead" if model.device.type == "cuda" else "autotune"
    if mode not in MODES:
        raise CompileError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    # Every model's steps are entries of one code object (Llama.static_step), and dynamo caps
    # the entries of a code object: raise the cap by what this model adds.
    global _SHAPES
    _SHAPES += len(widths) * len(rows) + len(tree_widths)
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, _SHAPES + 8)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * (_SHAPES + 8))
    compile_mode, freezing = MODES[mode]
    fn = torch.compile(model.static_step, dynamic=False, fullgraph=True, mode=compile_mode)
    start = time.perf_counter()
    # Quiet: autotuning prints a table per product to stderr, and the compile line says enough.
    quiet = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
    with torch.inference_mode(), torch._inductor.config.patch(freezing=freezing, **quiet), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        for batch in rows:
            for width in widths:
                inputs = model.static_inputs(batch, width)
                positions = torch.arange(width, device=model.device).expand(batch, width).contiguous()
                for _ in range(2 if mode == "reduce-overhead" else 1):  # CUDA graphs record on a later call
                    fn(*inputs, positions, hidden)
        for width in tree_widths:
            inputs = model.static_inputs(1, width)
            positions = torch.arange(1, width + 1, device=model.device).unsqueeze(0)
            visible = torch.ones(1, width, width, dtype=torch.bool, device=model.device).tril_()
            for _ in range(2 if mode == "reduce-overhead" else 1):
                fn(*inputs, positions, hidden, slots=positions.clone(), visible=visible)  # two tensors, as in a run
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    steps = CompiledSteps(fn, rows, widths, hidden, cache_len, time.perf_counter() - start, tree_widths)
    model.compiled = steps
    return steps


def decode_widths(gamma: int | str, gamma_max: int) -> tuple[int, ...]:
    """The call widths a speculative run needs: 1 (plain steps, a draft's step), 2 (a draft
    catching up on two tokens after a fully accepted block) and gamma + 1 (a verification).
    When gamma changes between iterations ("auto"), 1, 2, 3, then 2^k + 1 up to gamma_max + 1:
    a call of another width is padded to the next one (a few wasted rows of arithmetic, against
    a compile of tens of seconds per width on a CPU)."""
    if gamma == "auto":
        widths, k = {1, 2, 3}, 2
        while 2 ** (k - 1) < gamma_max:
            widths.add(min(2 ** k + 1, gamma_max + 1))
            k += 1
        return tuple(sorted(w for w in widths if w <= gamma_max + 1))
    return tuple(sorted({1, 2, int(gamma) + 1}))
