"""Compiled steps that outlive the process: each static shape of a model's step compiled ahead
of time into one package (AOTInductor), which a later process loads in well under a second.

Why not torch.compile's own caches: the CPU step is fast because Inductor freezes the weights
and lays them out once for its C++ GEMM template (model/fast/compile.py), and freezing turns the
weights into oneDNN tensors, which Inductor's graph cache cannot pickle ("mkldnn tensors
unpickleable": counter ``fxgraph_cache_bypass``), and AOTAutograd's cache skips frozen graphs.
So every process traced, froze, lowered and generated the whole graph again; only the
autotuning results and the C++ compiles were served from the cache (docs/compiled.md says where a
second process spent its time). A package holds what that work produced -- the generated
kernels built into one shared library and the frozen, packed weights -- so loading it is
opening a library and reading the constants.

How: :class:`StepProgram` is the model's ``step`` at one (rows, width) with the KV cache passed
in (one key and one value buffer per layer), written in place: torch.export traces it,
``aoti_compile_and_package`` builds it, and :class:`PackagedSteps` calls the loaded packages,
one per shape, all on the model's one cache, with the arguments model/fast/compile.py's
dispatcher gives a compiled step.

One package serves every length: the cache's length and the call's window (the last dimension
of its visibility mask) are dynamic in the exported program, while the rows and tokens of the
call, which fix the shapes of every weight product, are static; a package is handed the
cache's first rows, as many as its call has (a view: its writes land in the one cache). A
dynamic row count cost a quarter of a step here: the in-place write into a slice of a cache
of unknown rows became a copy of the whole cache. So a package
built once serves a prompt of any length and any ``--max-new-tokens`` up to the model's
context, and its attention reads the slots the call can see, not a whole static buffer
(docs/compiled.md has the measurement behind this choice). The rotary table frozen into the
package covers the model's whole context. Which shapes, where they are kept and whether an
entry is still good are the callers' business (model/fast/compile.py, weights/step_cache.py);
:func:`entry_key` lists everything an entry depends on.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.fast.progress import BuildProgress
from model.host import describe_cpu
from model.model import KVCache, rope_tables

# Inductor's options per model/fast/compile.py mode, for a package (the modes that a package can hold).
PACKAGE_OPTIONS: dict[str, dict[str, Any]] = {
    "autotune": {
        "freezing": True,
        "max_autotune": True,
        "max_autotune_gemm_backends": "CPP,ATEN",
        "autotune_num_choices_displayed": 0,
        "max_autotune_report_choices_stats": False,
    },
    "frozen": {"freezing": True},
    "default": {},
    "shared": {
        "aot_inductor.package_constants_in_so": False
    },  # the weights handed over at load: shared_constants
}
SOURCES = (
    "model.py",
    "call.py",
    "fast/compile.py",
    "fast/aot.py",
    "feature_head.py",
    "eagle3_head.py",
    "fast/fuse.py",
    "config.py",
)


class CompileError(ValueError):
    """A model or a combination that compile_for_decoding cannot compile, or a compile that failed."""


class NotCachedError(CompileError):
    """compile_for_decoding(build=False): a shape the store does not hold (or holds broken)."""


class _Buffers(nn.Module):
    """A layer's KV cache as inputs of the program: KVCache's write on tensors it does not own."""

    write = KVCache.write

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__()
        object.__setattr__(self, "k", k)  # plain attributes: inputs of the program, not its state
        object.__setattr__(self, "v", v)


class StepProgram(nn.Module):
    """``model.step`` at one shape: ``forward(*inputs, slots, positions, visible, *caches)``
    with the window ``visible``'s last dimension and ``caches`` every layer's key and value
    buffers, written in place."""

    def __init__(self, model: nn.Module, hidden: bool) -> None:
        super().__init__()
        self.model = model
        self.hidden = hidden
        self.n_inputs = len(model.example_inputs(1, 1))

    def forward(self, *args: torch.Tensor) -> Any:
        inputs = args[: self.n_inputs]
        slots, positions, visible = args[self.n_inputs : self.n_inputs + 3]
        caches = args[self.n_inputs + 3 :]
        layers = self.model.layers
        for layer, k, v in zip(layers, caches[0::2], caches[1::2]):
            layer.self_attn.cache = _Buffers(k, v)
        return self.model.step(*inputs, slots, positions, visible, visible.shape[-1], self.hidden)


def cache_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's KV cache as a package takes it: every layer's key, then value buffer."""
    return [t for layer in model.layers for t in (layer.self_attn.cache.k, layer.self_attn.cache.v)]


def example_call(model: nn.Module, rows: int, width: int, window: int) -> tuple[torch.Tensor, ...]:
    """The arguments of a call at one shape, as model/fast/compile.py's dispatcher makes them (the
    caches excluded): fresh tensors of standard strides, causal visibility from slot 0."""
    device = model.device
    where = torch.arange(width, device=device).expand(rows, width).contiguous()
    visible = (torch.arange(window, device=device) <= where.unsqueeze(-1)).contiguous()
    return (*model.example_inputs(rows, width), where, where.clone(), visible)


# The example sizes export traces the dynamic dimensions at: distinct, and none 0 or 1 (which export
# would specialise on). A package checks at each call that a size lies in the range export found.
EXAMPLE_SLOTS = 67
EXAMPLE_WINDOW = 37


def build_package(
    model: nn.Module, rows: int, width: int, hidden: bool, mode: str, path: str | os.PathLike
) -> None:
    """Export ``model.step`` at (rows, width), the cache's length and the call's window dynamic,
    and compile it into an AOTInductor package at ``path``."""
    program = StepProgram(model, hidden)
    layer = model.layers[0].self_attn
    cache_shape = (rows, layer.local_kv_heads, max(EXAMPLE_SLOTS, width + 2), model.config.head_dim)
    caches = [
        torch.zeros(cache_shape, dtype=model.dtype, device=model.device)
        for _ in range(2 * len(model.layers))
    ]
    window = min(EXAMPLE_WINDOW, cache_shape[2] - 1) if width < EXAMPLE_WINDOW else width + 1
    args = (*example_call(model, rows, width, window), *caches)
    any_size = torch.export.Dim.AUTO(min=1)
    inputs = len(args) - len(caches)
    # forward(*args)
    shapes = ((*[None] * (inputs - 1), {2: any_size}, *[{2: any_size}] * len(caches)),)
    saved = model._rope
    cached = [layer.self_attn.cache for layer in model.layers]
    model._rope = torch.stack(
        rope_tables(model.config, model.config.max_seq_len + 1, model.device, model.dtype), 1
    )
    with torch.inference_mode(False), torch.no_grad(), quiet_inductor():
        grads = [p.requires_grad for p in model.parameters()]
        try:
            for p in model.parameters():
                p.requires_grad_(False)
            for (
                layer
            ) in model.layers:  # out of the model meanwhile: export must not lift them as its state
                layer.self_attn.cache = None
            exported = torch.export.export(program, args, dynamic_shapes=shapes, strict=False)
        finally:
            model._rope = saved
            for layer, cache in zip(model.layers, cached):
                layer.self_attn.cache = cache
            for p, grad in zip(model.parameters(), grads):
                p.requires_grad_(grad)
        torch._inductor.aoti_compile_and_package(
            exported, package_path=os.fspath(path), inductor_configs=dict(PACKAGE_OPTIONS[mode])
        )


def load_package(path: str | os.PathLike) -> Any:
    """The runner of a package (AOTInductor's loader): ``runner.boxed_run(list_of_tensors)``."""
    with quiet_inductor():
        return torch._inductor.aoti_load_package(os.fspath(path)).loader


@contextlib.contextmanager
def quiet_inductor() -> Iterator[None]:
    """Inductor's and export's log lines and warnings (an outdated-package warning before a load
    error, the autotuning tables, export's note on the cache tensors it is handed) kept off
    stderr: a failure is reported by the caller in one line."""
    loggers = [
        logging.getLogger(name)
        for name in (
            "torch._inductor",
            "torch.export",
            "torch._export",
            "torch._dynamo",
            "torch.fx.experimental.symbolic_shapes",
        )
    ]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class PackagedSteps:
    """The loaded packages of one model, called as model/fast/compile.py calls a torch.compile'd
    step, less the window: ``fn(*inputs, slots, positions, visible, return_hidden)``, the shape read from
    the first input. Every package reads and writes the model's one cache."""

    def __init__(self, model: nn.Module, runners: dict[tuple[int, int], Any]) -> None:
        self.runners = runners
        self.new_cache(model)

    def new_cache(self, model: nn.Module) -> None:
        """Call the model's cache from now on (after its setup_cache allocated another): for each
        compiled row count, views of that many first rows of every buffer."""
        caches = cache_tensors(model)
        self.caches = {rows: [t[:rows] for t in caches] for rows in {r for r, _ in self.runners}}

    def __call__(self, *args: Any) -> Any:
        *tensors, _hidden = args
        rows, width = tensors[0].shape[:2]
        out = self.runners[rows, width].boxed_run([*tensors, *self.caches[rows]])
        return out[0] if len(out) == 1 else tuple(out)


# ----------------------------------------------------------------------------- the store's entries
def describe(key: dict[str, Any]) -> str:
    """An entry in a few words: 'Llama float32 step, 1 x 5 tokens'."""
    return f"{key['kind']} {key['dtype']} step, {key['rows']} x {key['width']} tokens"


def find_packages(
    model: nn.Module,
    shapes: Sequence[tuple[int, int]],
    hidden: bool,
    mode: str,
    store: Any,
    note: Callable[[str], None],
    build: bool,
) -> dict[tuple[int, int], tuple[dict, Any]]:
    """Each shape's key and the store's file for it (None: not there, or refused with a note and
    discarded). Without ``build``, a missing shape is NotCachedError."""
    fingerprint = model_fingerprint(model)
    found = {}
    for rows, width in shapes:
        key = entry_key(model, rows, width, hidden, mode, fingerprint)
        try:
            found[rows, width] = (key, store.find(key))
        except Exception as err:  # the store's EntryError, or a file it could not read
            note(
                f"compiled-step cache: the entry for the {describe(key)} is refused ({err}); "
                f"{'compiling it again' if build else 'decoding eagerly'}"
            )
            store.discard(key)
            found[rows, width] = (key, None)
    missing = [shape for shape, (_, path) in found.items() if path is None]
    if missing and not build:
        raise NotCachedError(
            f"{len(missing)} of the {len(found)} compiled shapes of this {type(model).__name__} "
            "are not in the cache"
        )
    return found


def load_packages(
    model: nn.Module,
    found: dict[tuple[int, int], tuple[dict, Any]],
    hidden: bool,
    mode: str,
    store: Any,
    note: Callable[[str], None],
    build: bool,
    check: Callable[[], None],
    progress: Callable[[str], None] | None = None,
) -> tuple[PackagedSteps, int, int]:
    """Build what is missing (``check()`` first: it raises when no compiler can), load every
    shape and probe it against the eager step; an entry that fails to load or to agree is
    discarded and, with ``build``, compiled once again. ``progress`` gets the lines of
    model/fast/progress.py while steps are built. Returns the steps, how many shapes were
    loaded as found and how many were built."""
    missing = sum(path is None for _, path in found.values())
    building = BuildProgress(missing, progress or (lambda line: None))
    runners = {}
    loaded = 0  # shapes found in the cache and loaded
    built = 0  # shapes compiled by this call
    for shape, (key, path) in found.items():
        fresh = False
        for attempt in range(2):
            if path is None:
                if not build:
                    raise NotCachedError(f"the {describe(key)} is not in the cache")
                check()
                if len(building.done) >= building.total:  # a refused entry built again
                    building.total += 1
                try:
                    with building.building(describe(key)):
                        path = store.build(
                            key,
                            lambda p, s=shape: build_package(model, *s, hidden, mode, p),
                            wait=lambda k=key: note(
                                f"compiled-step cache: another process is building "
                                f"the {describe(k)}; waiting for it"
                            ),
                        )
                except OSError as err:
                    raise CompileError(
                        f"the compiled-step cache cannot be written ({err.strerror or err}: "
                        f"{err.filename or store.root})"
                    ) from None
                except CompileError:
                    raise
                # export, Inductor or the C++ compiler: one line, never a traceback
                except Exception as err:
                    raise CompileError(
                        f"compiling the {describe(key)} failed ({first_line(err)})"
                    ) from None
                built += 1
                fresh = True
            try:
                runner = load_package(path)
                if mode == "shared":
                    # user-managed
                    runner.load_constants(shared_constants(model, runner), False, True, True)
                error = probe(model, runner, *shape, hidden)
                problem = None
                if not error <= tolerance(model.dtype):  # NaN included
                    problem = (
                        f"its probe call differs from the eager step by {error:.1e} (relative)"
                    )
            except Exception as err:  # a library that does not load or run here
                problem = f"it does not load ({first_line(err)})"
            if problem is None:
                runners[shape] = runner
                loaded += not fresh
                break
            again = build and attempt == 0
            note(
                f"compiled-step cache: the entry for the {describe(key)} is refused ({problem}); "
                f"{'compiling it again' if again else 'decoding eagerly'}"
            )
            store.discard(key)
            path = None
            if not again and not build:
                raise NotCachedError(f"the {describe(key)} failed its check")
            if not again:
                raise CompileError(
                    f"the compiled {describe(key)} failed its check twice ({problem})"
                )
    return PackagedSteps(model, runners), loaded, built


def shared_constants(model: nn.Module, runner: Any) -> dict[str, torch.Tensor]:
    """What a package built without its weights ("shared") is handed at load: the model's own
    tensors by name (no copy: the runner reads them where they are), and the rotary table of the
    whole context, the one constant that is not the model's."""
    state = {
        f"model.{n}": t
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if ".cache." not in n
    }
    names = runner.get_constant_fqns()
    other = [n for n in names if n not in state]
    if len(other) > 1:
        raise CompileError(
            f"the package asks for constants the model does not have: {', '.join(other[:3])}"
        )
    table = torch.stack(
        rope_tables(model.config, model.config.max_seq_len + 1, model.device, model.dtype), 1
    )
    return {n: state.get(n, table) for n in names}


def first_line(err: BaseException) -> str:
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {text[:120]}" if text else type(err).__name__


def tolerance(dtype: torch.dtype) -> float:
    """The largest relative difference of a probe call from the eager step that passes: float32
    sums in another order, or 16-bit rounding at other places, which is largest at the probe's first
    position, where a real model's activations are at their largest (a wrong package is off by ~1)."""
    return 0.2 if dtype in (torch.float16, torch.bfloat16) else 1e-3


@torch.inference_mode()
def probe(model: nn.Module, runner: Any, rows: int, width: int, hidden: bool) -> float:
    """A package's call against the eager step on a fixed input (written at the first slots of
    the model's cache, which the run's own calls overwrite, with a window of the whole cache):
    the relative difference."""
    window = model.layers[0].self_attn.cache.k.shape[2]
    args = list(example_call(model, rows, width, window))
    generator = torch.Generator().manual_seed(0)
    for i, x in enumerate(args[:-3]):  # token ids or features, not zeros: a wrong weight must show
        args[i] = (
            torch.randint(0, getattr(model.config, "vocab_size", 2), x.shape, generator=generator)
            if x.dtype == torch.long
            else torch.randn(x.shape, generator=generator).to(x.dtype)
        ).to(x.device)
    got = runner.boxed_run([*args, *[t[:rows] for t in cache_tensors(model)]])
    want = model.step(*args, window, hidden)
    want = [want] if isinstance(want, torch.Tensor) else list(want)
    return max(
        float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12))
        for g, w in zip(got, want)
    )


# ----------------------------------------------------------------------------- what an entry depends on
def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model's config, and of the names, dtypes, shapes and bytes of its weights
    as they will be compiled (stacked or not), KV caches excluded. Remembered on the model while
    its tensors are the same objects at the same versions (hashing a 1B model's bytes takes seconds)."""
    state = [
        (n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if ".cache." not in n
    ]
    seen = tuple((name, id(t), t.data_ptr(), t._version) for name, t in state)
    remembered = getattr(model, "_fingerprint", None)
    if remembered is not None and remembered[0] == seen:
        return remembered[1]
    digest = hashlib.blake2b(repr(model.config).encode(), digest_size=16)
    for name, tensor in state:
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(
            tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        )
    object.__setattr__(model, "_fingerprint", (seen, digest.hexdigest()))
    return digest.hexdigest()


def code_fingerprint() -> str:
    """A hash of the source of the model code a package is compiled from (a change to the step
    makes every entry stale)."""
    digest = hashlib.blake2b(digest_size=16)
    for name in SOURCES:
        digest.update((Path(__file__).parents[1] / name).read_bytes())  # paths in model/
    return digest.hexdigest()


def device_name(device: torch.device) -> str:
    """The CPU's model and instruction-set flags, or the GPU's name and compute capability."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    cpu = describe_cpu()
    flags = hashlib.blake2b(
        (" ".join(sorted(cpu.flags)) or platform.machine()).encode(), digest_size=8
    ).hexdigest()
    return f"{cpu.name} {torch.backends.cpu.get_cpu_capability()} flags {flags}"


def entry_key(
    model: nn.Module,
    rows: int,
    width: int,
    hidden: bool | tuple[int, ...],
    mode: str,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """Everything a compiled step depends on: the model (weights and config), its dtype and
    set-up, the call's shape (not the cache's: it is dynamic), the mode, the code, torch, the
    device and the thread count."""
    return {
        "model": fingerprint or model_fingerprint(model),
        "kind": type(model).__name__,
        "dtype": str(model.dtype).removeprefix("torch."),
        "setup": "compiled",
        "mode": mode,
        "rows": rows,
        "width": width,
        "code": code_fingerprint(),
        "hidden": list(hidden) if isinstance(hidden, tuple) else hidden,  # as JSON reads it back
        "torch": torch.__version__,
        "device": device_name(model.device),
        "threads": torch.get_num_threads(),
    }
