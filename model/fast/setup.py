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

The default of generate.py is not a measurement at every start: the set-ups round float32
sums in different orders, so a measured choice would let timing noise pick between greedy
outputs that differ at a near-tie, and the default path must start at once. It reads the
measurement a ``--compile`` made once and recorded beside the compiled steps
(weights/step_cache.py): a model runs its compiled steps by default only where they measured
faster than the fixed eager set-up (stacked and prepacked) on this machine, and the fixed eager
set-up otherwise (:func:`default_setups`). Measuring the eager set-ups alone is one flag away
(``--setup measure``), and any set-up can be forced by name.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from model.call import CacheCall
from model.fast.aot import device_name, model_fingerprint
from model.fast.compile import (
    CompileError,
    all_reduces,
    compile_for_decoding,
    default_mode,
    install,
)
from model.fast.fuse import prepare_for_decoding
from model.fast.prepack import prepack_linears, prepack_supported
from model.fast.timing import time_call

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
    cache: str = (
        ""  # the compiled steps: "loaded" from a store, "kept" in one (built now), "" no store
    )
    dropped: str = ""  # why the compiled candidate was dropped (it could not compile)
    model_key: str = (
        ""  # record_key of the model measured (set when compiled steps were kept in a store)
    )

    def line(self, name: str) -> str:
        dropped = f" (compiled dropped: {self.dropped})" if self.dropped else ""
        if not self.times_ms:
            compiled = f"; {self.compiled_how()}" if self.compile_s or self.cache else ""
            return f"{name}: {self.chosen} ({self.why}{compiled}){dropped}"
        timed = ", ".join(f"{setup} {ms:.2f}" for setup, ms in self.times_ms.items())
        compiled = f" ({self.compiled_how()})" if "compiled" in self.times_ms else ""
        why = f" ({self.why})" if self.why else ""
        return f"{name}: {timed} ms per step at each decode width{compiled} -> {self.chosen}{why}{dropped}"

    def compiled_how(self) -> str:
        if self.cache == "loaded":
            return f"loaded from the compiled-step cache in {self.compile_s:.1f}s"
        return f"compiled in {self.compile_s:.1f}s" + (
            ", kept in the cache" if self.cache == "kept" else ""
        )

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


def apply_setup(
    model: nn.Module,
    setup: str,
    widths: Sequence[int],
    cache_len: int,
    hidden: bool = False,
    mode: str | None = None,
    rows: Sequence[int] = (1,),
    tree_widths: Sequence[int] = (),
    **store: Any,
) -> float:
    """Turn ``model`` into ``setup`` in place (from the plain model as loaded); returns the
    compile time (0 for the eager set-ups). ``widths``, ``cache_len``, ``hidden``, ``mode``,
    ``rows``, ``tree_widths`` and ``store`` (store=, build=, note=) are compile_for_decoding's."""
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {', '.join(SETUPS)}, got {setup!r}")
    prepare_for_decoding(model, stack=setup != "plain", prepack=setup == "prepacked")
    if setup == "compiled":
        return compile_for_decoding(
            model, widths, rows, cache_len, hidden, mode, tree_widths, **store
        ).compile_s
    return 0.0


@torch.inference_mode()
def step_ms(model: nn.Module, widths: Sequence[int], hidden: bool, calls: int = 15) -> float:
    """One cached call at each width after a 32-token prefix, median of ``calls`` after two
    untimed ones (time_call, the one timer), summed (ms), in the cache the model has (a compiled
    model's static one stays in place)."""
    prefix = min(32, model.cache_len - max(widths) - 1)
    prompt = torch.zeros(1, prefix, dtype=torch.long, device=model.device)
    model(prompt, CacheCall.of(torch.arange(prefix, device=model.device).unsqueeze(0)))
    total = 0.0
    for width in widths:
        tokens = torch.ones(1, width, dtype=torch.long, device=model.device)
        call = CacheCall.of(torch.arange(prefix, prefix + width, device=model.device).unsqueeze(0))
        step = partial(model, tokens, call, return_hidden=hidden)
        total += time_call(step, calls, warmup=2, device=model.device).median
    return 1e3 * total


def choose_setup(
    model: nn.Module,
    candidates: Sequence[str],
    widths: Sequence[int],
    cache_len: int,
    hidden: bool = False,
    mode: str | None = None,
    rows: Sequence[int] = (1,),
    tree_widths: Sequence[int] = (),
    **store: Any,
) -> tuple[nn.Module, SetupChoice]:
    """The fastest of ``candidates`` (names in SETUPS; those that do not apply are skipped)
    for ``model`` as loaded: each built on a copy and timed by step_ms at ``widths``, one row
    (the compiled one compiled for ``rows`` and ``tree_widths`` as well, through ``store``:
    compile_for_decoding's store=, build=, note=). One candidate is applied without timing; a
    model too large to copy (MAX_COPY_BYTES) gets the last eager candidate (or the compiled one,
    if it is the only one), untimed, unless compiled steps are being built into a store: then the
    candidates are timed on copies all the same (twice its memory while --compile runs, once;
    ``--compile force`` times the fixed eager set-up on a copy, for the record). A compiled
    candidate that cannot compile (CompileError) is dropped when there are others, and the
    choice says why. Returns the model to decode with and the choice. Ties go to the earlier
    candidate."""
    usable = [c for c in candidates if applies(model, c)]
    if not usable:
        raise ValueError(
            f"the {' or '.join(candidates)} set-up does not apply to this model (prepacking is for "
            "float32, or bfloat16 with native bf16, on a CPU)"
        )
    candidates = usable
    widths = tuple(sorted(set(widths)))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    building = store.get("store") is not None and store.get("build", True)
    if len(candidates) == 1 or (size >= MAX_COPY_BYTES and not building):
        eager = [c for c in candidates if c != "compiled"]
        chosen = eager[-1] if eager else "compiled"
        why = (
            "the only set-up asked for"
            if len(candidates) == 1
            else f"{size / 2**30:.1f} GB: too large to time copies; the fixed choice"
        )
        # Compiled steps kept in a store are timed against the fixed eager set-up, on a copy, for the
        # record that decides the default (default_setups).
        baseline, eager_ms = fixed_eager(model), None
        if chosen == "compiled" and building:
            trial = copy.deepcopy(model)
            apply_setup(trial, baseline, widths, cache_len)
            trial.setup_cache(1, cache_len)
            eager_ms = step_ms(trial, widths, hidden)
            del trial
        seconds = apply_setup(
            model, chosen, widths, cache_len, hidden, mode, rows, tree_widths, **store
        )
        choice = SetupChoice(
            chosen, compile_s=seconds, widths=len(widths), why=why, cache=cache_state(model)
        )
        if eager_ms is not None:
            choice.times_ms = {baseline: eager_ms, "compiled": step_ms(model, widths, hidden)}
            choice.why = "forced"
        if choice.cache:
            choice.model_key = record_key(model, mode)
        return model, choice
    best, times, compile_s, cache, dropped, model_key = None, {}, 0.0, "", "", ""
    for setup in candidates:
        trial = copy.deepcopy(model)
        try:
            compile_s += apply_setup(
                trial, setup, widths, cache_len, hidden, mode, rows, tree_widths, **store
            )
        except CompileError as err:
            dropped = str(err)
            continue
        if setup != "compiled":
            trial.setup_cache(1, cache_len)
        else:
            cache = cache_state(trial)
            model_key = record_key(trial, mode) if cache else ""
        times[setup] = step_ms(trial, widths, hidden)
        if best is None or times[setup] < times[best[0]]:
            best = (setup, trial)
        del trial
    chosen, kept = best
    return kept, SetupChoice(
        chosen, times, compile_s, len(widths), cache=cache, dropped=dropped, model_key=model_key
    )


def fixed_eager(model: nn.Module) -> str:
    """The eager set-up a default run gets: stacked and prepacked where prepacking applies."""
    return "prepacked" if applies(model, "prepacked") else "stacked"


def record_key(model: nn.Module, mode: str | None, fingerprint: bool = True) -> str:
    """What a measurement of compiled steps is recorded under: the model's weights and config
    as compiled (stacked), its dtype, the compile mode, and a digest of its config and shapes.
    Without ``fingerprint``, the key's tail alone (no weight is hashed): what a record must end
    with to be this model's, cheap to look for before hashing gigabytes of weights."""
    shapes = [(n, tuple(t.shape)) for n, t in model.named_parameters()]
    digest = hashlib.blake2b(repr((model.config, shapes)).encode(), digest_size=8).hexdigest()
    tail = f"{model.dtype} {mode or default_mode(model)} {digest}"
    return f"{model_fingerprint(model)} {tail}" if fingerprint else tail


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
    # cache entries refused on the way (one line each)
    notes: list[str] = field(default_factory=list)
    hint: str | None = None  # the default run's word on what compiling would gain here

    def record(self, store: Any, target: nn.Module) -> None:
        """Keep in ``store``, per model whose compiled steps were built now, what it measured on
        this machine: its step times per set-up and the build time. A later default run reads it
        (:func:`default_setups`): the compiled steps run by default only where they measured faster."""
        for name, choice in self.choices:
            eager = {
                setup: ms / choice.widths
                for setup, ms in choice.times_ms.items()
                if setup != "compiled"
            }
            if (
                choice.cache != "kept"
                or not choice.model_key
                or not eager
                or "compiled" not in choice.times_ms
            ):
                continue
            compiled_ms = choice.times_ms["compiled"] / choice.widths
            store.record(
                machine(target.device),
                choice.model_key,
                {
                    "model": name,
                    "eager_ms": eager,
                    "compiled_ms": compiled_ms,
                    "widths": choice.widths,
                    "faster": compiled_ms < min(eager.values()),
                    "build_s": round(choice.compile_s, 1),
                    "date": time.strftime("%Y-%m-%d %H:%M"),
                },
            )

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
        return (
            f"compiling took {spent:.1f}s and saves at most {saved:.1f}s over {new_tokens} tokens: this run does "
            "not pay for its compile time"
            + (
                "; the steps are kept in the cache, and later runs load them in seconds"
                if kept
                else " (a longer run, or a process that serves many, would)"
            )
        )


def tree_sizes(branching: Sequence[int]) -> list[int]:
    """The nodes of a static token tree (``branching[d]`` children for every node at depth d)
    down to each depth: (3, 2, 1, 1) -> [3, 9, 15, 21]. A drafter's tree calls are the sizes
    before the last; the target scores the whole tree and the last accepted token in one call."""
    sizes, level = [], 1
    for children in branching:
        level *= children
        sizes.append((sizes[-1] if sizes else 0) + level)
    return sizes


def prepack_outside_step(head: nn.Module) -> None:
    """An EAGLE-3 head's compiled step runs its block alone: its fc (``project``) and output layer
    (``draft_logits``) run eagerly at every draft step, so they are prepacked, as an eager model's
    products are. A head without an output layer of its own (``draft_logits`` None, as the heads of
    model/ declare: speculative.draft.protocol.Head) runs its fc inside the step."""
    if head.draft_logits is not None:
        prepack_linears(head, only=("fc", "lm_head"))


def features_for(head: nn.Module | None) -> bool | tuple[int, ...]:
    """What the target's steps return for a feature head: nothing without one, else what the head
    declares it reads (``reads_features``: the final features, or an EAGLE-3 head's layers)."""
    return False if head is None else head.reads_features


def choose_setups(
    target: nn.Module,
    candidates: Sequence[str],
    widths: Sequence[int],
    cache_len: int,
    *,
    draft: nn.Module | None = None,
    head: nn.Module | None = None,
    batch: int = 1,
    tree: Sequence[int] | None = None,
    **store: Any,
) -> Setups:
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
    target, choice = choose_setup(
        target,
        candidates,
        widths,
        cache_len,
        hidden=features_for(head),
        rows=rows,
        tree_widths=(sizes[-1] + 1,) if sizes else (),
        **store,
    )
    choices = [("target", choice)]
    if head is not None and choice.chosen == "compiled":  # the head follows its target
        seconds = compile_for_decoding(
            head, widths, rows, cache_len, tree_widths=sizes[:-1], **store
        ).compile_s
        prepack_outside_step(head)
        choices.append(
            (
                "head",
                SetupChoice(
                    "compiled", compile_s=seconds, why="as its target", cache=cache_state(head)
                ),
            )
        )
    elif head is not None:
        prepare_for_decoding(head)
    if draft is not None:
        draft, choice = choose_setup(
            draft, candidates, (1, 2), cache_len, rows=rows, tree_widths=sizes[:-1], **store
        )
        choices.append(("draft", choice))
    setups = Setups(target, draft, choices)
    if store.get("store") is not None and store.get("build", True):
        setups.record(store["store"], target)
    return setups


# ----------------------------------------------------------------------------- the default: compiled when cached
def cacheable(model: nn.Module) -> bool:
    """Whether a model's compiled steps can come from the cache: a CPU model, not int8, not a
    tensor-parallel shard (one of SHARED_BYTES or more is kept with its weights shared)."""
    # model/scale/quantize.py's weights, by their dtype
    int8 = any(t.dtype == torch.int8 for t in model.buffers())
    return model.device.type == "cpu" and not int8 and not all_reduces(model)


def default_setups(
    target: nn.Module,
    widths: Sequence[int],
    cache_len: int,
    *,
    draft: nn.Module | None = None,
    head: nn.Module | None = None,
    batch: int = 1,
    tree: Sequence[int] | None = None,
    store: Any = None,
    stack: bool = True,
    prepack: bool = True,
) -> Setups:
    """The set-up of a run that asked for none, per model: its compiled steps when an earlier
    ``--compile`` measured them faster than the fixed eager set-up on this machine (``store``'s
    record, Setups.record) and ``store`` holds every shape this run needs (loaded and probed, in
    seconds); else at once the fixed eager set-up (``stack``ed and ``prepack``ed,
    model/fast/fuse.py). A feature head follows its target. The models as loaded
    (weights.PairSpec.load with prepare_models=False). ``Setups.hint`` says what compiling would
    gain when nothing was measured; ``Setups.notes`` the entries refused on the way."""
    notes: list[str] = []
    rows, sizes = row_buckets(batch), tree_sizes(tree) if tree else []
    usable = store is not None and stack
    choices, unmeasured, missing = [], False, False
    target_shapes = {"hidden": features_for(head), "tree_widths": (sizes[-1] + 1,) if sizes else ()}
    plan = [
        ("target", target, widths, target_shapes),
        ("draft", draft, (1, 2), {"tree_widths": sizes[:-1]}),
    ]
    for name, model, model_widths, shapes in plan:
        if model is None:
            continue
        prepare_for_decoding(model, stack=stack, prepack=False)
        records = (
            (store.measured(machine(model.device)) or {}) if usable and cacheable(model) else {}
        )
        tail = record_key(model, None, fingerprint=False)
        seen = (
            records.get(record_key(model, None)) if any(k.endswith(tail) for k in records) else None
        )
        unmeasured |= usable and cacheable(model) and seen is None
        choice = None
        if seen and seen.get("faster"):
            try:
                steps = compile_for_decoding(
                    model,
                    model_widths,
                    rows,
                    cache_len,
                    store=store,
                    build=False,
                    note=notes.append,
                    **shapes,
                )
                faster = (
                    f"{min(seen['eager_ms'].values()):.2f} -> {seen['compiled_ms']:.2f} ms a step"
                )
                choice = SetupChoice(
                    "compiled",
                    compile_s=steps.compile_s,
                    cache="loaded",
                    why=f"the default: measured faster here, {faster}; its compiled steps found "
                    "in the cache",
                )
            except CompileError:
                install(model, None)
                missing = True
        elif seen:
            eager = min(seen["eager_ms"], key=seen["eager_ms"].get)
            choice = SetupChoice(
                fixed_eager(model) if prepack else "stacked",
                why=f"the default: the compiled steps measured slower here ({seen['compiled_ms']:.2f} "
                f"against {seen['eager_ms'][eager]:.2f} ms a step {eager})",
            )
        if choice is None or choice.chosen != "compiled":
            prepare_for_decoding(model, stack=stack, prepack=prepack)
        if choice is not None:
            choices.append((name, choice))
        if name == "target" and head is not None:  # the head follows its target
            compiled = choice is not None and choice.chosen == "compiled"
            try:
                if compiled:
                    steps = compile_for_decoding(
                        head,
                        widths,
                        rows,
                        cache_len,
                        tree_widths=sizes[:-1],
                        store=store,
                        build=False,
                        note=notes.append,
                    )
                    prepack_outside_step(head)
                    choices.append(
                        (
                            "head",
                            SetupChoice(
                                "compiled",
                                compile_s=steps.compile_s,
                                why="as its target",
                                cache="loaded",
                            ),
                        )
                    )
            except CompileError:
                install(head, None)
                compiled = False
            if not compiled:
                prepare_for_decoding(head, stack=stack, prepack=prepack)
    hint = (
        compile_hint(store, target)
        if unmeasured and not any(c.chosen == "compiled" for _, c in choices)
        else None
    )
    if missing:
        hint = (
            "compiled steps that measured faster here are missing from the cache or refused: `--compile` builds "
            "them again (this run decodes eagerly)"
        )
    return Setups(target, draft, choices, notes=notes, hint=hint)


def machine(device: Any) -> str:
    """The device and thread count that a measurement of compiled steps holds for."""
    return f"{device_name(device)}, {torch.get_num_threads()} threads"


def compile_hint(store: Any, target: nn.Module) -> str:
    """What a one-time --compile would gain and cost: the measurements recorded on this machine
    (Setups.record), or, when there are none, where one machine's are written down. The message
    quotes no other machine's figure: only this machine's own records."""
    seen = store.measured(machine(target.device)) or {}
    if not seen:
        return (
            "compiled steps for this run were not measured on this machine: `--compile` builds them once (minutes "
            "on a small CPU; one machine's build and step times: docs/results/benchmarks_compiled.md), and later "
            "runs load them in a few seconds where they measured faster"
        )
    last = max(seen.values(), key=lambda m: m.get("date", ""))
    return (
        f"compiled steps for this run were not measured: `--compile` builds them once (on {last['date']} it took "
        f"{last['build_s']:.0f}s here for a {last['model']}, whose step went "
        f"{min(last['eager_ms'].values()):.2f} -> {last['compiled_ms']:.2f} ms), and later runs load them in "
        "seconds where they measured faster"
    )
