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
ragged batch), and anything else -- a prompt longer than the widest shape, a tree's
explicit positions and mask -- runs eagerly on the same buffer. No shape met during
generation is new, so nothing recompiles (tests/test_compile.py makes any recompilation an
error over whole runs).

The model knows nothing of what calls it; the widths to compile are the caller's choice
(generate.py: 1, 2 and gamma + 1, or every width up to the largest gamma under "auto").
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.model import KVCache, rope_tables

_SHAPES = 0  # shapes compiled so far in this process, over all models


class CompileError(ValueError):
    """A model or a combination that compile_for_decoding cannot compile."""


@dataclass
class CompiledSteps:
    """The compiled static-shape steps of one model, and what they were compiled for."""

    fn: Any  # torch.compile(model.static_step)
    rows: tuple[int, ...]  # batch sizes compiled
    widths: tuple[int, ...]  # tokens per call compiled, ascending
    hidden: bool  # compiled to return the hidden states too
    cache_len: int  # the longest cache a run may ask for
    compile_s: float  # wall time of compiling every shape

    def fits(self, batch: int, length: int) -> bool:
        return batch <= max(self.rows) and length <= self.cache_len

    def width_for(self, seq: int) -> int | None:
        return next((w for w in self.widths if w >= seq), None)

    def __call__(self, model: Any, tokens: torch.Tensor, start_pos: int | Sequence[int],
                 return_hidden: bool) -> Any:
        """The call through a compiled shape, or None when none fits (the caller runs eagerly)."""
        batch, seq = tokens.shape
        width = self.width_for(seq)
        if batch not in self.rows or width is None or return_hidden != self.hidden:
            return None
        starts = [start_pos] * batch if isinstance(start_pos, int) else [int(s) for s in start_pos]
        if len(starts) != batch or any(s < 0 or s + seq > model.cache_len for s in starts):
            return None  # the eager path raises the error that explains it
        positions = torch.tensor([[s + i for i in range(width)] for s in starts], device=tokens.device)
        # a fresh tensor with standard strides (a [1, T] slice of a longer row has stride L in
        # its batch dimension, and the compiled step is specialised to strides too)
        tokens = F.pad(tokens, (0, width - seq)) if width > seq else tokens.clone(memory_format=torch.contiguous_format)
        out = self.fn(tokens, positions, return_hidden)
        if width == seq:
            return out
        if return_hidden:
            return out[0][:, :seq], out[1][:, :seq]
        return out[:, :seq]


def compile_for_decoding(model: nn.Module, widths: Sequence[int], rows: Sequence[int] = (1,),
                         cache_len: int | None = None, hidden: bool = False, mode: str | None = None) -> CompiledSteps:
    """Compile ``model``'s cached forward for every batch size in ``rows`` and every call
    width in ``widths``, with a static KV cache of ``cache_len`` positions (default: the
    model's max_seq_len) for max(rows) rows. ``hidden``: the steps also return the hidden
    states (the target of a feature drafter). ``mode``: torch.compile's, default Inductor's
    default on a CPU and "reduce-overhead" (CUDA graphs) on a GPU. Returns what was compiled,
    with the compile time; the model's later cached calls use it where a shape fits.

    Refused (CompileError): prepacked weights (model/prepack.py: Inductor packs weights
    itself) and tensor-parallel shards (their collectives are not captured)."""
    from model.prepack import PrepackedLinear
    from model.tensor_parallel import ParallelAttention

    modules = list(model.modules())
    if any(isinstance(m, PrepackedLinear) for m in modules):
        raise CompileError("a prepacked model cannot be compiled: compile the plain (or stacked) model; "
                           "Inductor lays out the weights itself")
    if any(isinstance(m, ParallelAttention) for m in modules):
        raise CompileError("tensor-parallel models are not compiled: their all-reduces would run outside the graph")
    widths = tuple(sorted(set(int(w) for w in widths)))
    rows = tuple(sorted(set(int(r) for r in rows)))
    if not widths or widths[0] < 1 or not rows or rows[0] < 1:
        raise CompileError(f"widths and rows must be integers >= 1, got {widths} and {rows}")
    cache_len = cache_len or model.config.max_seq_len
    if cache_len > model.config.max_seq_len:
        raise CompileError(f"cache length {cache_len} exceeds the model's max_seq_len {model.config.max_seq_len}")
    # One static buffer for every call: the cache length, plus room for the padding of the widest call.
    slots = cache_len + widths[-1]
    kv_heads = model.layers[0].self_attn.local_kv_heads
    for layer in model.layers:
        layer.self_attn.cache = KVCache(rows[-1], kv_heads, slots, model.config.head_dim, model.dtype, model.device)
    model._rope = rope_tables(model.config, slots, model.device, model.dtype)
    model.cache_len, model.cache_batch = cache_len, rows[-1]
    if mode is None and model.device.type == "cuda":
        mode = "reduce-overhead"
    # Every model's steps are entries of one code object (Llama.static_step), and dynamo caps
    # the entries of a code object: raise the cap by what this model adds.
    global _SHAPES
    _SHAPES += len(widths) * len(rows)
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, _SHAPES + 8)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * (_SHAPES + 8))
    fn = torch.compile(model.static_step, dynamic=False, fullgraph=True, mode=mode)
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in rows:
            for width in widths:
                tokens = torch.zeros(batch, width, dtype=torch.long, device=model.device)
                positions = torch.arange(width, device=model.device).expand(batch, width).contiguous()
                for _ in range(2 if mode == "reduce-overhead" else 1):  # CUDA graphs record on a later call
                    fn(tokens, positions, hidden)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    steps = CompiledSteps(fn, rows, widths, hidden, cache_len, time.perf_counter() - start)
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


# ----------------------------------------------------------------------------- eager or compiled?
@dataclass
class SetupChoice:
    """What compile_if_faster measured and chose for one model."""

    chosen: str  # "compiled", or the eager set-up's name
    eager: str  # "prepacked" (a stacked copy with oneDNN-packed weights) or "stacked"
    compiled_ms: float  # one step at each compiled width, summed (milliseconds)
    eager_ms: float
    compile_s: float
    widths: int  # how many widths were timed (the sums' terms)

    def line(self, name: str) -> str:
        return (f"{name}: compiled {self.compiled_ms:.2f} ms against {self.eager} {self.eager_ms:.2f} ms per step at "
                f"each decode width (compiled in {self.compile_s:.1f}s) -> {self.chosen}")


@torch.inference_mode()
def step_ms(model: nn.Module, widths: Sequence[int], hidden: bool, calls: int = 15) -> float:
    """One cached call at each width after a 32-token prefix, median of ``calls``, summed (ms),
    in the cache the model has (a compiled model's static one stays in place)."""
    prefix = min(32, model.cache_len - max(widths) - 1)
    model(torch.zeros(1, prefix, dtype=torch.long, device=model.device), start_pos=0)
    total = 0.0
    for width in widths:
        tokens = torch.ones(1, width, dtype=torch.long, device=model.device)
        times = []
        for _ in range(calls + 2):
            start = time.perf_counter()
            model(tokens, start_pos=prefix, return_hidden=hidden)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            times.append(time.perf_counter() - start)
        total += sorted(times[2:])[len(times[2:]) // 2]
    return 1e3 * total


def compile_if_faster(model: nn.Module, widths: Sequence[int], cache_len: int | None = None, hidden: bool = False,
                      prepack: bool = True, force: bool = False) -> tuple[nn.Module, SetupChoice]:
    """Compile ``model`` (stacked, not prepacked) for ``widths`` and time a step of each width
    compiled and eager; keep whichever is faster on this machine (``force``: keep the compiled
    one). The eager set-up is the prepacked one where prepacking applies (a CPU, float32) and
    the model is small enough to hold a second copy for the measurement (under 1 GB), else
    the same stacked model run eagerly. Returns the model to decode with and the choice."""
    from model.prepack import prepack_linears, prepack_supported

    eager = None
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if (prepack and model.device.type == "cpu" and model.dtype == torch.float32 and prepack_supported()
            and weight_bytes < 2 ** 30):
        eager = copy.deepcopy(model)
        if not prepack_linears(eager):
            eager = None
    steps = compile_for_decoding(model, widths, cache_len=cache_len, hidden=hidden)
    compiled_ms = step_ms(model, widths, hidden)
    if eager is not None:
        eager.setup_cache(1, steps.cache_len)
        eager_ms, eager_name = step_ms(eager, widths, hidden), "prepacked"
    else:  # the same module and its static buffers, with the compiled steps set aside
        model.compiled = None
        eager_ms, eager_name = step_ms(model, widths, hidden), "stacked"
        model.compiled = steps
    keep_compiled = force or compiled_ms < eager_ms
    choice = SetupChoice("compiled" if keep_compiled else eager_name, eager_name, compiled_ms, eager_ms,
                         steps.compile_s, len(steps.widths))
    if keep_compiled:
        return model, choice
    if eager is None:
        model.compiled = None  # eager from now on; the next setup_cache allocates a plain cache
        return model, choice
    return eager, choice
