"""Compiled decoding: a model's cached forward at a few static shapes, compiled once each.

Why: a decode step of a small model costs about as much as the operators it runs -- some
microseconds of dispatch each on a CPU, a kernel launch each on a GPU -- not its arithmetic.
torch.compile turns the step into one graph: Inductor fuses the elementwise work (norms,
rotary, SwiGLU, masks) into a few generated kernels on a CPU, and on a GPU
``mode="reduce-overhead"`` replays the whole step as one CUDA graph.

How: a cached call (``model(tokens, call)``, model/model.py) whose window is the whole KV
cache has shapes that depend on (B, T) alone: the cache is one static buffer written in
place at the call's slots and read whole, with the call's mask (gpt-fast's design).
:func:`compile_for_decoding` allocates that buffer, compiles the model's one cached step
(``Llama.step``, the function an eager call runs too) once for every (rows, width) it is
given by running it, and installs :class:`CompiledSteps` from outside (:func:`install`): a cached
call of B rows and T tokens then runs the smallest compiled shape that holds it, padded,
and anything else -- a prompt longer than the widest shape -- runs eagerly on the same
buffer. No shape met during generation is new, so nothing recompiles
(tests/model/fast/test_compile.py makes any recompilation an error over whole runs).

The model knows nothing of what calls it; the widths to compile are the caller's choice
(generate.py: 1, 2 and gamma + 1, or every width up to the largest gamma under "auto").

Kept on disk: given a ``store`` (weights/step_cache.py), a CPU model's shapes are compiled ahead
of time into packages (model/fast/aot.py) that the store keeps, and a later process loads them in
seconds instead of compiling again; each is checked against the eager step on a probe
call when it is loaded. A package's cache length and window are dynamic: one build serves
every run length up to the model's context, and a call attends over its own window only.
A compile that cannot happen (no working C++ compiler, an Inductor error) is a CompileError
of one line.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._inductor.config
from torch import nn

from model.call import CacheCall
from model.fast import aot
from model.fast.fuse import in_front
from model.fast.prepack import PrepackedLinear
from model.host import setting

_SHAPES = 0  # shapes compiled so far in this process, over all models

# What compile_for_decoding's ``mode`` names: torch.compile's own modes, or Inductor options.
# "autotune" (the CPU default): Inductor's C++ GEMM kernels, chosen by timing them against
# the ATen product once per shape (max_autotune), over weights it lays out once as constants
# of the graph (freezing); "default" calls MKL's sgemm, which repacks the weights at every
# call (docs/compiled.md has the step times of each). Its costs: minutes of compiling per
# model, a second copy of the weights, and weights fixed at compile time (change them and
# compile again).
# Each mode: (torch.compile's mode, whether Inductor freezes the weights). Freezing is set on
# Inductor's config while the shapes compile (compile_for_decoding compiles them all up
# front): passed in torch.compile's options it is not seen, and the C++ template is not used.
# $SPECULATIVE_COMPILE_MODE replaces "autotune" as the CPU default: "default" compiles in a
# fraction of the time (no GEMM is timed), for steps about as fast as eager ones.
MODE_ENV = "SPECULATIVE_COMPILE_MODE"
# "shared" (the CPU default for a model of SHARED_BYTES or more): packages without frozen weights,
# handed the model's own tensors when they are loaded (model/fast/aot.py): one copy of the weights
# for the eager model and every compiled shape, where "autotune" keeps a frozen copy per shape.
SHARED_BYTES = 1 << 30
# "frozen" (the CPU default for a model with int4 layers): frozen weights, no GEMM timed. Autotuning
# adds Inductor's own int4 template as a choice for every int4 product, and rendering it made each
# shape's build half as long again for a step a few percent faster (docs/quantized.md).
MODES: dict[str, tuple[str, bool]] = {
    "autotune": ("max-autotune-no-cudagraphs", True),
    "frozen": ("default", True),
    "default": ("default", False),
    "shared": ("default", False),
    "reduce-overhead": ("reduce-overhead", False),
    "max-autotune": ("max-autotune", False),
}


CompileError = aot.CompileError
NotCachedError = aot.NotCachedError


@dataclass
class CompiledSteps:
    """The compiled step of one model, the shapes it was compiled for, and the padding that
    takes a cached call to one of them."""

    fn: Any  # torch.compile(model.step)
    rows: tuple[int, ...]  # batch sizes compiled, ascending
    widths: tuple[int, ...]  # tokens per call compiled, ascending
    hidden: bool  # compiled to return the hidden states too
    cache_len: int  # the longest cache a run may ask for
    compile_s: float  # wall time of compiling every shape
    tree_widths: tuple[int, ...] = ()  # widths compiled for one row only (a token tree's calls)
    loaded: int = 0  # shapes loaded from a store
    built: int = 0  # shapes compiled into a store
    notes: list[str] = field(default_factory=list)  # entries refused, waits for another builder
    dynamic: bool = False  # packages (model/fast/aot.py): any cache length; a call's window, not the whole cache

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, width) compiled: each row count at each width, and one row at each tree width."""
        shapes = [(r, w) for r in self.rows for w in self.widths]
        return shapes + [(1, w) for w in self.tree_widths if (1, w) not in shapes]

    def __post_init__(self) -> None:
        self._fitting: dict[
            tuple[int, int], tuple[int, int] | None
        ] = {}  # shape_for's answers, per (B, T)

    def fits(self, batch: int, length: int) -> bool:
        return batch <= max(self.rows) and length <= self.cache_len

    def shape_for(self, batch: int, seq: int) -> tuple[int, int] | None:
        """The smallest compiled (rows, width) that holds ``batch`` rows of ``seq`` tokens (looked
        up once per (batch, seq): the dispatcher asks on every call)."""
        if (batch, seq) not in self._fitting:
            fits = [(r * w, r, w) for r, w in self.shapes if r >= batch and w >= seq]
            self._fitting[batch, seq] = min(fits)[1:] if fits else None
        return self._fitting[batch, seq]

    def __call__(
        self, model: Any, inputs: tuple[torch.Tensor, ...], call: CacheCall, return_hidden: bool
    ) -> Any:
        """The call through a compiled shape, or None when none fits (the caller runs eagerly).

        The same call, padded: B rows to the smallest compiled row count >= B, T tokens to the
        smallest compiled width >= T, and for a torch.compile'd step the window to the whole
        static cache (what makes the shapes static). A padding token is written at the last
        slot, the scratch slot, which no real token sees (a call's window stops at the cache
        length), and sees slot 0 alone; padding rows write rows the call does not own.
        ``inputs``: the step's first arguments, each [B, T, ...] (a Llama's tokens; a feature
        head's features and embeddings). Every argument is a fresh tensor of standard strides:
        the compiled step is specialised to strides, and to which of its arguments are one tensor."""
        batch, seq = inputs[0].shape[:2]
        shape = self.shape_for(batch, seq)
        # A plain call takes steps compiled with the features too and drops them (a feature head's
        # target runs alone at its compiled speed, as --compare's baseline does); a call asking for
        # other features than those compiled runs eagerly.
        if shape is None or (return_hidden and return_hidden != self.hidden):
            return None
        rows, width = shape
        slots = model.layers[0].self_attn.cache.k.shape[2]
        # The window: the call's own for packages (their window is dynamic; at least 2 slots, a size
        # export does not specialise on), the whole cache for a torch.compile'd step (static shapes).
        window = min(slots, max(2, call.window)) if self.dynamic else slots
        device = call.slots.device
        padded = []
        for x in inputs:
            padded.append(x.new_zeros((rows, width, *x.shape[2:])))
            padded[-1][:batch, :seq] = x
        where = torch.full((rows, width), slots - 1, dtype=torch.long, device=device)
        where[:batch, :seq] = call.slots
        positions = torch.zeros((rows, width), dtype=torch.long, device=device)
        positions[:batch, :seq] = call.positions
        visible = torch.zeros((rows, width, window), dtype=torch.bool, device=device)
        visible[:batch, :seq, : call.window] = True if call.visible is None else call.visible
        visible[batch:, :, 0] = (
            True  # padding sees slot 0 (any slot would do: its output is cut off)
        )
        visible[:, seq:, 0] = True
        extra = () if self.dynamic else (slots,)
        out = self.fn(*padded, where, positions, visible, *extra, self.hidden)
        if not self.hidden:
            return out[:batch, :seq]
        return (
            (out[0][:batch, :seq], out[1][:batch, :seq]) if return_hidden else out[0][:batch, :seq]
        )


class Compiled:
    """Put in front of a model's class when its steps are compiled (:func:`install`): a cached
    call runs through ``compiled`` (a :class:`CompiledSteps`) where a shape fits, eagerly
    otherwise, and the static cache is kept where a request fits (its slots past the request's
    length are scratch). ``compiled`` None: the model as it was."""

    compiled: CompiledSteps | None = None

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        steps = self.compiled
        if steps is None:
            return super().setup_cache(max_batch_size, max_seq_len)
        if max_seq_len > self.config.max_seq_len:
            raise ValueError(
                f"cache length {max_seq_len} exceeds the model's max_seq_len {self.config.max_seq_len}"
            )
        if not steps.fits(max_batch_size, max_seq_len):
            raise ValueError(
                f"this model was compiled for at most {max(steps.rows)} rows and "
                f"{steps.cache_len} positions; {max_batch_size} x {max_seq_len} do not fit"
            )
        if steps.dynamic and self.layers[0].self_attn.cache.k.shape[2] <= max_seq_len:
            # Packages take a cache of any length: a longer one now, with every compiled row (padding writes them).
            super().setup_cache(max(steps.rows), max_seq_len)
            steps.fn.new_cache(self)
        self.cache_len = max_seq_len
        self.cache_batch = max_batch_size

    def run(self, inputs: tuple[torch.Tensor, ...], call: CacheCall, return_hidden: bool) -> Any:
        out = None if self.compiled is None else self.compiled(self, inputs, call, return_hidden)
        return out if out is not None else super().run(inputs, call, return_hidden)


def install(model: nn.Module, steps: CompiledSteps | None) -> None:
    """Route ``model``'s cached calls through ``steps`` (None: eagerly again, with a fresh cache
    at the next setup_cache)."""
    if not isinstance(model, Compiled):
        in_front(model, Compiled, "Compiled")
    model.compiled = steps


def compile_for_decoding(
    model: nn.Module,
    widths: Sequence[int],
    rows: Sequence[int] = (1,),
    cache_len: int | None = None,
    hidden: bool = False,
    mode: str | None = None,
    tree_widths: Sequence[int] = (),
    store: Any = None,
    build: bool = True,
    note: Callable[[str], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> CompiledSteps:
    """Compile ``model``'s cached forward for every batch size in ``rows`` and every call
    width in ``widths``, with a static KV cache of ``cache_len`` positions (default: the
    model's max_seq_len) for max(rows) rows; ``tree_widths``: widths of one-row calls with a
    token tree's positions and mask. ``hidden``: the steps also return the hidden
    states (the target of a feature drafter). ``mode``: a key of MODES, default "autotune" on
    a CPU and "reduce-overhead" (CUDA graphs) on a GPU. Returns what was compiled,
    with the compile time; the model's later cached calls use it where a shape fits.

    ``store`` (a weights.step_cache.StepCache; a CPU model in the "autotune" or "default" mode):
    every shape is loaded from it, and the missing ones compiled into it first (model/fast/aot.py);
    with ``build=False`` nothing is compiled, and a shape it lacks is a NotCachedError error before the
    model is touched. ``note`` gets one line per entry refused or waited for, ``progress`` the
    lines that say what is being built (model/fast/progress.py), as they happen.

    Prepacked layers (model/fast/prepack.py) stay oneDNN products inside the graph. Refused
    (CompileError): tensor-parallel shards (their collectives are not captured)."""
    if all_reduces(model):
        raise CompileError(
            "tensor-parallel models are not compiled: their all-reduces would run outside the graph"
        )
    widths = tuple(sorted(set(int(w) for w in widths)))
    rows = tuple(sorted(set(int(r) for r in rows)))
    tree_widths = tuple(sorted(set(int(w) for w in tree_widths)))
    if (
        not widths
        or widths[0] < 1
        or not rows
        or rows[0] < 1
        or (tree_widths and tree_widths[0] < 1)
    ):
        raise CompileError(f"widths and rows must be integers >= 1, got {widths} and {rows}")
    cache_len = cache_len or model.config.max_seq_len
    if cache_len > model.config.max_seq_len:
        raise CompileError(
            f"cache length {cache_len} exceeds the model's max_seq_len {model.config.max_seq_len}"
        )
    mode = mode or default_mode(model)
    if mode not in MODES:
        raise CompileError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    # a package cannot call a prepacked layer's Python operator
    packaged = (
        store is not None
        and model.device.type == "cpu"
        and mode in aot.PACKAGE_OPTIONS
        and not any(isinstance(m, PrepackedLinear) for m in model.modules())
    )
    # A package serves any cache length up to the context; the buffer set up now holds the widest call.
    steps = CompiledSteps(
        None,
        rows,
        widths,
        hidden,
        model.config.max_seq_len if packaged else cache_len,
        0.0,
        tree_widths,
        dynamic=packaged,
    )
    if packaged:
        cache_len = min(
            model.config.max_seq_len, max(cache_len, max(w for _, w in steps.shapes) + 1)
        )
    slots = cache_len + 1  # the cache length, plus the scratch slot padding writes
    start = time.perf_counter()
    if packaged:
        paths = aot.find_packages(
            model, steps.shapes, hidden, mode, store, note or steps.notes.append, build
        )
    elif not build:
        raise NotCachedError(
            "compiled steps are kept on disk for a CPU model in the "
            f"{' or '.join(aot.PACKAGE_OPTIONS)} mode only"
        )
    # One static buffer for every call.
    install(model, None)
    model.setup_cache(rows[-1], cache_len)
    if packaged:
        steps.fn, steps.loaded, steps.built = aot.load_packages(
            model,
            paths,
            hidden,
            mode,
            store,
            note or steps.notes.append,
            build,
            lambda: check_compiler(model.device),
            progress,
        )
    else:
        steps.fn = compile_steps(model, steps.shapes, slots, hidden, mode)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    steps.compile_s = time.perf_counter() - start
    install(model, steps)
    return steps


def default_mode(model: nn.Module) -> str:
    """The mode compile_for_decoding uses when given none: CUDA graphs on a GPU; else $MODE_ENV, or
    "shared" for a model of SHARED_BYTES or more (one copy of its weights), "frozen" for one with
    int4 layers, else "autotune"."""
    if model.device.type == "cuda":
        return "reduce-overhead"
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if setting(MODE_ENV):
        return setting(MODE_ENV)
    if size >= SHARED_BYTES:
        return "shared"
    # int4 layers (model/scale/quantize.py) keep their packed codes as uint8
    if any(b.dtype == torch.uint8 for b in model.buffers()):
        return "frozen"
    return "autotune"


def all_reduces(model: nn.Module) -> bool:
    """Whether a layer of ``model`` all-reduces its output over ranks (a tensor-parallel shard).
    Such a layer says so itself (``all_reduces = True``, model/scale/tensor_parallel.py). It is
    known by that mark, not by its class, so that the fast paths need not import the scale layer:
    both are applied to the network from outside, and neither imports the other (docs/layout.md)."""
    return any(getattr(m, "all_reduces", False) for m in model.modules())


def compile_steps(
    model: nn.Module, shapes: Sequence[tuple[int, int]], slots: int, hidden: bool, mode: str
) -> Any:
    """torch.compile of ``model.step``, run once at every shape so that all are compiled now."""
    check_compiler(model.device)
    # Every model's steps are entries of one code object (Llama.step), and dynamo caps
    # the entries of a code object: raise the cap by what this model adds.
    global _SHAPES
    _SHAPES += len(shapes)
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, _SHAPES + 8)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * (_SHAPES + 8))
    compile_mode, freezing = MODES[mode]
    fn = torch.compile(model.step, dynamic=False, fullgraph=True, mode=compile_mode)
    # Quiet: autotuning prints a table per product to stderr, and the compile line says enough.
    quiet = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
    with (
        torch.inference_mode(),
        torch._inductor.config.patch(freezing=freezing, **quiet),
        warnings.catch_warnings(),
        aot.quiet_inductor(),
    ):
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        for batch, width in shapes:
            # the call CompiledSteps.__call__ makes: distinct tensors of standard strides
            where = torch.arange(width, device=model.device).expand(batch, width).contiguous()
            visible = torch.ones(batch, width, slots, dtype=torch.bool, device=model.device)
            try:
                calls = 2 if mode == "reduce-overhead" else 1  # CUDA graphs record on a later call
                for _ in range(calls):
                    fn(
                        *model.example_inputs(batch, width),
                        where,
                        where.clone(),
                        visible,
                        slots,
                        hidden,
                    )
            except (
                Exception
            ) as err:  # an Inductor or compiler failure: one line, never its traceback
                torch._dynamo.reset()
                raise CompileError(f"compiling the step failed ({failure(err)})") from None
    return fn


def failure(err: BaseException) -> str:
    """An exception of the compiler stack in a few words: its type and the first line that says something."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


@functools.cache
def compiler_problem(compiler: str) -> str | None:
    """Why ``compiler`` cannot build Inductor's C++ (None when it builds a tiny library)."""
    path = shutil.which(compiler)
    if path is None:
        return f"no C++ compiler: {compiler!r} is not on the PATH (install g++, or set CXX)"
    try:
        proc = subprocess.run(
            [path, "-x", "c++", "-shared", "-fPIC", "-o", os.devnull, "-"],
            input='extern "C" int f() { return 0; }\n',
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as err:
        return f"the C++ compiler {compiler} cannot run ({type(err).__name__})"
    if proc.returncode != 0:
        said = next((line for line in proc.stderr.splitlines() if line.strip()), "no message")
        return f"the C++ compiler {compiler} fails (exit status {proc.returncode}: {said[:160]})"
    return None


def check_compiler(device: torch.device) -> None:
    """Raise CompileError when Inductor's C++ compiler (CXX, else g++) cannot build on this CPU."""
    if device.type != "cpu":
        return
    # deferred: importing Inductor takes seconds, and most runs never compile
    from torch._inductor import cpp_builder

    try:
        # the first of $CXX (else g++) that runs --version
        compiler = cpp_builder.get_cpp_compiler()
    except Exception:
        named = torch._inductor.config.cpp.cxx[-1]  # what Inductor tried
        raise CompileError(
            f"no working C++ compiler: {named} does not run (install g++, or set CXX)"
        ) from None
    problem = compiler_problem(compiler)
    if problem:
        raise CompileError(problem)


def decode_widths(gamma: int | str, gamma_max: int) -> tuple[int, ...]:
    """The call widths a speculative run needs: 1 (plain steps, a draft's step), 2 (a draft
    catching up on two tokens after a fully accepted block) and gamma + 1 (a verification).
    When gamma changes between iterations ("auto"), 1, 2, 3, then 2^k + 1 up to gamma_max + 1:
    a call of another width is padded to the next one (a few wasted rows of arithmetic, against
    a compile of tens of seconds per width on a CPU)."""
    if gamma == "auto":
        widths = {1, 2, 3}
        k = 2  # widths up to 2^k + 1 are in
        while 2 ** (k - 1) < gamma_max:
            widths.add(min(2**k + 1, gamma_max + 1))
            k += 1
        return tuple(sorted(w for w in widths if w <= gamma_max + 1))
    return tuple(sorted({1, 2, int(gamma) + 1}))
