"""A model's decoding set-up, chosen by timing it on this machine.

The same model can run a decode step four ways, and which is fastest depends on the
machine, not on the model:

* ``plain``: as loaded, PyTorch's default kernels;
* ``stacked``: q/k/v and gate/up stacked into one product each (model/fast/fuse.py): fewer
  operators per step;
* ``prepacked``: stacked, and float32 weights reordered once for oneDNN (model/fast/prepack.py,
  a CPU in float32 only): verifying several tokens costs about one step;
* ``compiled``: stacked, and the static-shape step compiled (model/fast/compile.py).

Which wins differs between CPUs (on one without AVX-512, stacking made the draft step slower,
and prepacking a one-token target step slower while it made a 5-token one faster: the figures
are in docs/compiled.md). So :func:`choose_setups` builds each
candidate on a copy of the model, times one step at each decode width the run will use
(the sum: a speculative run calls both the 1-token and the gamma+1-token step about once per
iteration), and keeps the fastest; the timings are returned to be printed.

The default of generate.py is still a fixed choice (stacked and prepacked) and not a
measurement at every start: the set-ups round float32 sums in different orders, so a
measured choice would let timing noise pick between greedy outputs that differ at a
near-tie, and the default path must start at once. Measuring is one flag away
(``--setup measure``, or ``--compile`` with the compiled set-up among the candidates), and
any set-up can be forced by name.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from model.call import CacheCall
from model.fast.aot import device_name
from model.fast.compile import CompileError, compile_for_decoding, install
from model.fast.fuse import prepare_for_decoding
from model.fast.prepack import prepack_supported
from model.scale.quantize import Int8Linear
from model.scale.tensor_parallel import ParallelAttention

SETUPS = ("plain", "stacked", "prepacked", "compiled")
# Copies of a model are built to time them only below this size; a larger one gets the
# fixed choice (choose_setup says so).
MAX_COPY_BYTES = 1 << 30


@dataclass
class SetupChoice:
    """What choose_setup timed and kept for one model."""

    chosen: str
    times_ms: dict[str, float] = field(default_factory=dict)  # one step at each width, summed
    compile_s: float = 0.0
    widths: int = 1  # how many widths each sum holds
    why: str = ""  # set when nothing was timed
    cache: str = ""  # the compiled steps: "loaded" from a store, "kept" in one (built now), "" no store
    dropped: str = ""  # why the compiled candidate was dropped (it could not compile)

    def line(self, name: str) -> str:
        dropped = f" (compiled dropped: {self.dropped})" if self.dropped else ""
        if not self.times_ms:
            compiled = f"; {self.compiled_how()}" if self.compile_s or self.cache else ""
            return f"{name}: {self.chosen} ({self.why}{compiled}){dropped}"
        timed = ", ".join(f"{setup} {ms:.2f}" for setup, ms in self.times_ms.items())
        compiled = f" ({self.compiled_how()})" if "compiled" in self.times_ms else ""
        return f"{name}: {timed} ms per step at each decode width{compiled} -> {self.chosen}{dropped}"

    def compiled_how(self) -> str:
        if self.cache == "loaded":
            return f"loaded from the compiled-step cache in {self.compile_s:.1f}s"
        return f"compiled in {self.compile_s:.1f}s" + (", kept in the cache" if self.cache == "kept" else "")

    def compile_saving_s(self) -> float:
        """What the compiled set-up, when kept, saves per call against the fastest eager set-up
        timed (seconds, mean over the widths); 0 when it was not kept or nothing was timed."""
        eager = [ms for setup, ms in self.times_ms.items() if setup != "compiled"]
        if self.chosen != "compiled" or "compiled" not in self.times_ms or not eager:
            return 0.0
        return max(0.0, min(eager) - self.times_ms["compiled"]) / self.widths / 1e3


def cache_state(model: nn.Module) -> str:
    """SetupChoice.cache for a model just set up: its compiled steps loaded, kept, or neither."""
    steps = getattr(model, "compiled", None)
    if steps is None or not (steps.loaded or steps.built):
        return ""
    return "kept" if steps.built else "loaded"


def applies(model: nn.Module, setup: str) -> bool:
    """Whether ``setup`` means something for this model: prepacking is for float32 (and bfloat16
    with native bf16) on a CPU."""
    if setup == "prepacked":
        return model.device.type == "cpu" and prepack_supported(model.dtype)
    return setup in SETUPS


def apply_setup(model: nn.Module, setup: str, widths: Sequence[int], cache_len: int, hidden: bool = False,
                mode: str | None = None, rows: Sequence[int] = (1,), tree_widths: Sequence[int] = (),
                **store: Any) -> float:
    """Turn ``model`` into ``setup`` in place (from the plain model as loaded); returns the
    compile time (0 for the eager set-ups). ``widths``, ``cache_len``, ``hidden``, ``mode``,
    ``rows``, ``tree_widths`` and ``store`` (store=, build=, note=) are compile_for_decoding's."""
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {', '.join(SETUPS)}, got {setup!r}")
    prepare_for_decoding(model, stack=setup != "plain", prepack=setup == "prepacked")
    if setup == "compiled":
        return compile_for_decoding(model, widths, rows, cache_len, hidden, mode, tree_widths, **store).compile_s
    return 0.0


@torch.inference_mode()
def step_ms(model: nn.Module, widths: Sequence[int], hidden: bool, calls: int = 15) -> float:
    """One cached call at each width after a 32-token prefix, median of ``calls``, summed (ms),
    in the cache the model has (a compiled model's static one stays in place)."""
    prefix = min(32, model.cache_len - max(widths) - 1)
    prompt = torch.zeros(1, prefix, dtype=torch.long, device=model.device)
    model(prompt, CacheCall.of(torch.arange(prefix, device=model.device).unsqueeze(0)))
    total = 0.0
    for width in widths:
        tokens = torch.ones(1, width, dtype=torch.long, device=model.device)
        call = CacheCall.of(torch.arange(prefix, prefix + width, device=model.device).unsqueeze(0))
        times = []
        for _ in range(calls + 2):
            start = time.perf_counter()
            model(tokens, call, return_hidden=hidden)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            times.append(time.perf_counter() - start)
        total += sorted(times[2:])[len(times[2:]) // 2]
    return 1e3 * total


def choose_setup(model: nn.Module, candidates: Sequence[str], widths: Sequence[int], cache_len: int,
                 hidden: bool = False, mode: str | None = None, rows: Sequence[int] = (1,),
                 tree_widths: Sequence[int] = (), **store: Any) -> tuple[nn.Module, SetupChoice]:
    """The fastest of ``candidates`` (names in SETUPS; those that do not apply are skipped)
    for ``model`` as loaded: each built on a copy and timed by step_ms at ``widths``, one row
    (the compiled one compiled for ``rows`` and ``tree_widths`` as well, through ``store``:
    compile_for_decoding's store=, build=, note=). One candidate is applied without timing; a
    model too large to copy (MAX_COPY_BYTES) gets the last eager candidate (or the compiled one,
    if it is the only one), untimed. A compiled candidate that cannot compile (CompileError) is
    dropped when there are others, and the choice says why. Returns the model to decode with
    and the choice. Ties go to the earlier candidate."""
    usable = [c for c in candidates if applies(model, c)]
    if not usable:
        raise ValueError(f"the {' or '.join(candidates)} set-up does not apply to this model (prepacking is for "
                         "float32, or bfloat16 with native bf16, on a CPU)")
    candidates = usable
    widths = tuple(sorted(set(widths)))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if len(candidates) == 1 or size >= MAX_COPY_BYTES:
        eager = [c for c in candidates if c != "compiled"]
        chosen = eager[-1] if eager else "compiled"
        why = "the only set-up asked for" if len(candidates) == 1 else \
            f"{size / 2 ** 30:.1f} GB: too large to time copies; the fixed choice"
        seconds = apply_setup(model, chosen, widths, cache_len, hidden, mode, rows, tree_widths, **store)
        return model, SetupChoice(chosen, compile_s=seconds, widths=len(widths), why=why, cache=cache_state(model))
    best, times, compile_s, cache, dropped = None, {}, 0.0, "", ""
    for setup in candidates:
        trial = copy.deepcopy(model)
        try:
            compile_s += apply_setup(trial, setup, widths, cache_len, hidden, mode, rows, tree_widths, **store)
        except CompileError as err:
            dropped = str(err)
            continue
        if setup != "compiled":
            trial.setup_cache(1, cache_len + max(widths))
        else:
            cache = cache_state(trial)
        times[setup] = step_ms(trial, widths, hidden)
        if best is None or times[setup] < times[best[0]]:
            best = (setup, trial)
        del trial
    chosen, kept = best
    return kept, SetupChoice(chosen, times, compile_s, len(widths), cache=cache, dropped=dropped)


# ----------------------------------------------------------------------------- a run's models
MEASURED = ("plain", "stacked", "prepacked")  # what --setup measure times (--compile adds compiled)


def candidates(setup: str) -> tuple[str, ...]:
    """The set-ups a request names: "measure" the eager three, "measure-all" all of SETUPS,
    a set-up's name itself alone."""
    return {"measure": MEASURED, "measure-all": SETUPS}.get(setup, (setup,))


def row_buckets(batch: int) -> tuple[int, ...]:
    """The batch sizes to compile for a batch of ``batch`` rows: 1, 2, 4, ... and ``batch`` (a
    batch shrinks as rows finish; a call of B rows runs padded in the next size up)."""
    sizes, size = {batch}, 1
    while size < batch:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


@dataclass
class Setups:
    """What :func:`choose_setups` chose: the models to decode with (each may be a timed copy of
    the one given) and, per model, the choice."""

    target: nn.Module
    draft: nn.Module | None
    choices: list[tuple[str, SetupChoice]]
    notes: list[str] = field(default_factory=list)  # cache entries refused on the way (one line each)
    hint: str | None = None  # the default run's word on what compiling would gain here

    def record(self, store: Any, target: nn.Module) -> None:
        """Keep in ``store`` what compiling gave on this machine (build time, step times), for
        the hint of a later default run."""
        built = [choice for _, choice in self.choices if choice.cache == "kept"]
        if not built:
            return
        models = {}
        for name, choice in self.choices:
            eager = [ms / choice.widths for setup, ms in choice.times_ms.items() if setup != "compiled"]
            models[name] = {"eager_ms": min(eager), "compiled_ms": choice.times_ms["compiled"] / choice.widths} \
                if eager and "compiled" in choice.times_ms else {}
        store.record(machine(target.device), {"build_s": sum(c.compile_s for c in built), "models": models,
                                              "date": time.strftime("%Y-%m-%d")})

    @property
    def lines(self) -> list[str]:
        """One line per model: what was timed and kept (SetupChoice.line)."""
        return [choice.line(name) for name, choice in self.choices]

    def compile_note(self, new_tokens: int) -> str | None:
        """A note when compiling cannot pay for itself in a run of ``new_tokens`` tokens: at most
        one call of each model per token, each saving the mean difference of a step against the
        fastest eager set-up timed."""
        spent = sum(choice.compile_s for _, choice in self.choices if choice.cache != "loaded")
        saved = sum(choice.compile_saving_s() for _, choice in self.choices) * new_tokens
        if spent <= 0 or saved >= spent:
            return None
        kept = any(choice.cache == "kept" for _, choice in self.choices)
        return (f"compiling took {spent:.1f}s and saves at most {saved:.1f}s over {new_tokens} tokens: this run does "
                "not pay for its compile time" + ("; the steps are kept in the cache, and later runs load them in "
                                                 "seconds" if kept else " (a longer run, or a process that serves "
                                                 "many, would)"))


def tree_sizes(branching: Sequence[int]) -> list[int]:
    """The nodes of a static token tree (``branching[d]`` children for every node at depth d)
    down to each depth: (3, 2, 1, 1) -> [3, 9, 15, 21]. A drafter's tree calls are the sizes
    before the last; the target scores the whole tree and the last accepted token in one call."""
    sizes, level = [], 1
    for children in branching:
        level *= children
        sizes.append((sizes[-1] if sizes else 0) + level)
    return sizes


def choose_setups(target: nn.Module, candidates: Sequence[str], widths: Sequence[int], cache_len: int, *,
                  draft: nn.Module | None = None, head: nn.Module | None = None, batch: int = 1,
                  tree: Sequence[int] | None = None, **store: Any) -> Setups:
    """The set-ups of a run's models, each chosen by :func:`choose_setup` from ``candidates``.

    The target for its call ``widths`` (with features for a ``head`` to read) and a draft
    model for widths 1 and 2, both for batches of up to ``batch`` rows (:func:`row_buckets`)
    and, with a ``tree`` (its branching per depth), for the tree's calls (:func:`tree_sizes`).
    A feature head is not timed: it is compiled in place, for the target's widths, when its
    target's compiled set-up is kept, and stacked and prepacked otherwise. ``store``:
    compile_for_decoding's store=, build=, note= (the compiled steps kept on disk). The models
    returned replace the ones given (a drafter built around the old target must be built anew)."""
    rows = row_buckets(batch)
    sizes = tree_sizes(tree) if tree else []
    target, choice = choose_setup(target, candidates, widths, cache_len, hidden=head is not None, rows=rows,
                                  tree_widths=(sizes[-1] + 1,) if sizes else (), **store)
    choices = [("target", choice)]
    if head is not None and choice.chosen == "compiled":  # the head follows its target
        seconds = compile_for_decoding(head, widths, rows, cache_len, tree_widths=sizes[:-1], **store).compile_s
        choices.append(("head", SetupChoice("compiled", compile_s=seconds, why="as its target",
                                            cache=cache_state(head))))
    elif head is not None:
        prepare_for_decoding(head)
    if draft is not None:
        draft, choice = choose_setup(draft, candidates, (1, 2), cache_len, rows=rows, tree_widths=sizes[:-1],
                                     **store)
        choices.append(("draft", choice))
    setups = Setups(target, draft, choices)
    if store.get("store") is not None and store.get("build", True):
        setups.record(store["store"], target)
    return setups


# ----------------------------------------------------------------------------- the default: compiled when cached
def cache_length(needed: int, context: int) -> int:
    """The static cache a compiled run gets: the next power of two >= ``needed`` (at least 64),
    at most ``context``. Rounded so that runs of other lengths find the same compiled steps;
    not longer, because a compiled step attends over its whole static cache."""
    return min(context, max(64, 1 << max(0, needed - 1).bit_length()))


def cacheable(model: nn.Module) -> bool:
    """Whether a model's compiled steps can come from the cache: a CPU model small enough to
    fingerprint in a moment (MAX_COPY_BYTES), not int8, not a tensor-parallel shard."""
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return model.device.type == "cpu" and size < MAX_COPY_BYTES and not any(
        isinstance(m, (Int8Linear, ParallelAttention)) for m in model.modules())


def default_setups(target: nn.Module, widths: Sequence[int], cache_len: int, *, draft: nn.Module | None = None,
                   head: nn.Module | None = None, batch: int = 1, tree: Sequence[int] | None = None, store: Any = None,
                   stack: bool = True, prepack: bool = True) -> Setups:
    """The set-up of a run that asked for none: the compiled steps when ``store`` holds every one
    this run needs (for a static cache of ``cache_len``; loaded and probed, in seconds), else at
    once the fixed eager set-up (``stack``ed and ``prepack``ed, model/fast/fuse.py). The models as
    loaded (weights.PairSpec.load with prepare_models=False). ``Setups.hint`` says what compiling
    would gain when nothing was cached; ``Setups.notes`` the entries refused on the way."""
    notes: list[str] = []
    models = [m for m in (target, draft, head) if m is not None]
    usable = store is not None and stack and all(cacheable(m) for m in models)
    if usable:
        try:
            setups = choose_setups(target, ("compiled",), widths, cache_len, draft=draft, head=head, batch=batch,
                                   tree=tree, store=store, build=False, note=notes.append)
            for _, choice in setups.choices:
                choice.why = "the default, its compiled steps found in the cache"
            setups.notes = notes
            return setups
        except CompileError:
            for model in models:
                install(model, None)
    for model in models:
        prepare_for_decoding(model, stack=stack, prepack=prepack)
    return Setups(target, draft, [], notes=notes, hint=compile_hint(store, target) if usable else None)


def machine(device: Any) -> str:
    """The device and thread count that a measurement of compiled steps holds for."""
    return f"{device_name(device)}, {torch.get_num_threads()} threads"


def compile_hint(store: Any, target: nn.Module) -> str:
    """What a one-time --compile would gain and cost: the last measurement on this machine
    (Setups.record), or, when there is none, the figures of docs/results/benchmarks.md."""
    seen = store.measured(machine(target.device))
    if not seen:
        return ("compiled steps for this run are not in the cache: `--compile` builds them once (minutes; on a 2-core "
                "Zen 4 about 3 min for the shipped pair, whose steps then take about half the time: "
                "docs/results/benchmarks.md), and later runs load them in a few seconds")
    gain = " and ".join(f"{name} step {m['eager_ms']:.2f} -> {m['compiled_ms']:.2f} ms"
                        for name, m in seen["models"].items() if "eager_ms" in m)
    return (f"compiled steps for this run are not in the cache: `--compile` builds them once (it took "
            f"{seen['build_s']:.0f}s here on {seen['date']}{'; ' + gain if gain else ''}), and later runs load them in "
            "seconds")
