"""Loading a draft/target pair by name or path: what ``generate.py --target T --draft D`` means.

    target, draft, tokenizer = load_pair("tiny-target", "tiny-draft")

In two steps, so that a caller can refuse a run before gigabytes are read:

* :func:`read_pair` reads the configs and the tokenizers only, says what the draft name
  means (a draft model, a feature head, ``lookup``, or none) and checks that the two can
  speculate together (speculative.check_pair): a :class:`PairSpec`;
* :meth:`PairSpec.load` loads the weights (whole, this rank's shard under tensor
  parallelism, or int8), builds the drafter and prepares every network for decoding
  (model/fast/fuse.py: projections stacked, float32 weights prepacked for oneDNN on a CPU): a
  :class:`Pair`.

A draft model is returned as the model itself (the loops wrap it in a ModelDrafter), a
feature head as a speculative.FeatureDrafter around the target it was checked against,
``lookup`` as a speculative.PromptLookupDrafter.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from model import Llama, ModelConfig
from model.fast.compile import decode_widths
from model.fast.fuse import prepare_for_decoding, prepared
from model.host import describe_cpu
from model.scale.memory import check_memory
from model.scale.quantize import INT4_DTYPES
from speculative import PairMismatchError, check_pair
from speculative.draft.hybrid import HybridDrafter
from speculative.draft.model import as_drafter
from speculative.draft.protocol import trait
from speculative.draft.registry import DEFAULT_KIND, DRAFTERS, DrafterKind, named
from weights.checkpoint import (
    CheckpointError,
    load_model,
    load_tokenizer,
    read_config,
    read_generation_config,
    sampling_defaults,
    stop_ids,
)
from weights.drafters import folder_kind
from weights.eagle3 import proposal_length, target_shape
from weights.gguf import is_gguf
from weights.registry import (
    FOR_OTHER_TARGETS,
    MEASURED_DEFAULTS,
    SHIPPED,
    WEIGHTS_DIR,
    UnknownCheckpointError,
    resolve,
)
from weights.sharded import load_model_tp, plan_config
from weights.step_cache import StepCache
from weights.tokenizer import Tokenizer

if TYPE_CHECKING:
    from model.fast.setup import Setups


def draft_kind(name_or_path: str | os.PathLike | None, planning: bool = False) -> str | None:
    """What a draft name means: None (no draft), or the name of its drafter kind
    (speculative.draft.DRAFTERS: "model", "head", "eagle3", "lookup", ...). With ``planning``, a name that
    is neither shipped nor a folder is taken for a model (a Llama-2 short name whose published
    shape --plan knows without the download); otherwise it is resolved, and an unknown name
    raises UnknownCheckpointError."""
    if name_or_path is None:
        return None
    name_or_path = split_hybrid(name_or_path)[1]
    if named(str(name_or_path)) is not None:
        return str(name_or_path)
    if (
        planning
        and str(name_or_path) not in SHIPPED
        and not Path(name_or_path).expanduser().is_dir()
    ):
        return DEFAULT_KIND
    return folder_kind(resolve(name_or_path)).name


# A hybrid proposer's name: the copier, "+", and the model drafter's name (a head or a draft model)
HYBRID_COPIERS = ("suffix",)
HYBRID = "hybrid"  # the copier beside the target's default drafter (named_draft spells it out)
# The gamma of a drafter whose chains end where its own score says (suffix decoding, a hybrid), where
# none is given: the longest copied chain one verification takes (a hybrid's model drafter drafts its
# own, shorter length; docs/drafters.md, "The hybrid proposer")
ADAPTIVE_GAMMA = 16
ADAPTIVE_DRAFTERS = ("suffix",)
HYBRID_MODEL_GAMMA = 4  # a hybrid's model drafter's draft length, where its config proposes none


def split_hybrid(name: str | os.PathLike) -> tuple[str | None, str | os.PathLike]:
    """A draft name's copier and model drafter: ("suffix", "smollm2-eagle3") for
    "suffix+smollm2-eagle3" (speculative.draft.hybrid), (None, name) for any other name."""
    copier, plus, rest = str(name).partition("+")
    if plus and copier in HYBRID_COPIERS and rest:
        return copier, rest
    return None, name


def hybrid_name(draft: str) -> str:
    """suffix decoding beside ``draft`` ("suffix+NAME"), or ``draft`` itself where it has it already."""
    if split_hybrid(draft)[0] is not None:
        return draft
    return f"{HYBRID_COPIERS[0]}+{draft}"


def adapts_length(draft: str) -> bool:
    """Whether a draft name's chains end where its own score says: suffix decoding, or a hybrid."""
    return split_hybrid(draft)[0] is not None or str(draft) in ADAPTIVE_DRAFTERS


def head_config(target: ModelConfig) -> ModelConfig:
    """The shape a feature head is counted as in a memory plan: one block of its target's shape
    (its embedding and output head are the target's, so this overestimates a little)."""
    return replace(target, n_layers=1)


def plan_configs(
    target: str | os.PathLike, draft: str | os.PathLike | None
) -> tuple[ModelConfig, ModelConfig | None]:
    """The configs to plan memory with (``generate.py --plan``), from config.json or, for
    Llama-2 short names not downloaded, the published shapes (weights.sharded.plan_config).
    The draft's is as its kind counts it (DrafterKind.memory): its own config, a head's
    :func:`head_config`, or None (no draft, or one without a network)."""
    target_config = plan_config(target)
    kind = draft_kind(draft, planning=True)
    memory = DRAFTERS[kind].memory if kind is not None else "none"
    if memory == "target-block":
        return target_config, head_config(target_config)
    return target_config, plan_config(draft) if memory == "own" else None


def registered(kind: str | None) -> DrafterKind | None:
    """The registration of a drafter kind named by a pair (speculative.draft.DRAFTERS), None for none."""
    return None if kind is None else DRAFTERS[kind]


def is_checkpoint(kind: str | None) -> bool:
    """Whether a drafter kind is built from a Llama checkpoint (a draft model, or a parallel draft)."""
    return kind is not None and DRAFTERS[kind].network == "checkpoint"


def is_head(kind: str | None) -> bool:
    """Whether a drafter kind is built from a head on the target's features."""
    return kind is not None and DRAFTERS[kind].network == "head"


@dataclass(frozen=True)
class PairSpec:
    """What two names mean, read from their configs and tokenizers alone (:func:`read_pair`)."""

    target: str
    draft: str | None
    # None (no draft), or a drafter kind's name: "model", "head", "eagle3", "lookup", ...
    kind: str | None
    target_dir: Path
    draft_dir: Path | None  # a draft model's or a feature head's folder
    target_config: ModelConfig
    draft_config: ModelConfig | None  # a draft model's only
    tokenizer: Tokenizer  # the target's (a draft model's is the same: check_pair)
    stop_ids: tuple[int, ...] = ()  # every id that ends a generation (weights.checkpoint.stop_ids)
    generation: dict[str, Any] = field(default_factory=dict)  # the target's generation_config.json
    copier: str | None = None  # a hybrid's copier ("suffix") beside the drafter of ``kind``
    model_gamma: int = HYBRID_MODEL_GAMMA  # a hybrid's model drafter's own draft length

    @property
    def notes(self) -> list[str]:
        """One line for each config that holds fields nobody here has classified (model/config.py
        takes them to leave the forward pass alone: docs/checkpoint_fields.md)."""
        return [
            f"config.json of {name} has fields not classified here, taken to leave the forward pass unchanged: "
            f"{', '.join(config.unclassified)} (docs/checkpoint_fields.md)"
            for name, config in ((self.target, self.target_config), (self.draft, self.draft_config))
            if config is not None and getattr(config, "unclassified", ())
        ]

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The target's generation_config.json sampling defaults (weights.checkpoint.sampling_defaults)."""
        return sampling_defaults(self.generation)

    @property
    def context(self) -> int:
        """The longest sequence both models take."""
        return min(c.max_seq_len for c in (self.target_config, self.draft_config) if c is not None)

    @property
    def planned_draft(self) -> ModelConfig | None:
        """The draft's config for a memory plan, as its kind counts it (DrafterKind.memory)."""
        memory = DRAFTERS[self.kind].memory if self.kind is not None else "none"
        return head_config(self.target_config) if memory == "target-block" else self.draft_config

    def draft_dtype(self, device: str | torch.device, dtype: torch.dtype) -> torch.dtype:
        """The drafter's dtype beside a target in ``dtype``, when none is asked for: its checkpoint's
        own bfloat16 on a CPU that computes bfloat16 natively, else the target's. A drafter's numerics
        never reach the output (the verifier makes it the target's distribution whatever is
        proposed), so a step bound by reading its weights takes the fewer bytes wherever the CPU
        computes them at full speed (docs/drafters.md, "The drafter's own dtype")."""
        if (
            self.draft_dir is None
            or torch.device(device).type != "cpu"
            or not describe_cpu().native_bf16
        ):
            return dtype
        try:
            config = json.loads((self.draft_dir / "config.json").read_text())
        except (OSError, ValueError):
            return dtype
        own = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
        return torch.bfloat16 if own == "bfloat16" else dtype

    def load(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        quantize: str | None = None,
        tensor_parallel: bool = False,
        stack: bool = True,
        prepack: bool = True,
        prepare_models: bool = True,
        draft_dtype: torch.dtype | None = None,
    ) -> Pair:
        """Load the pair on ``device``, the target in ``dtype`` and the drafter in ``draft_dtype``
        (default ``dtype``). ``tensor_parallel`` loads this rank's shard of the target
        (weights.sharded.load_model_tp; the draft whole on every rank) and ``quantize="int8"`` int8
        blocks, both models in ``dtype``. ``stack`` and ``prepack`` are model/fast/fuse.py's
        prepare_for_decoding; ``prepare_models=False`` leaves every network as loaded, for
        :meth:`Pair.set_up` (model.fast.setup.choose_setups or default_setups)."""
        start = time.perf_counter()
        sharded = tensor_parallel or quantize is not None
        if sharded:
            target = load_model_tp(self.target_dir, device, dtype, quantize=quantize)
            draft_dtype = dtype
        else:
            draft_dtype = draft_dtype or dtype
            target = load_model(self.target_dir, device=device, dtype=dtype)
        kind = registered(self.kind)
        network = None  # what the kind's drafter is built from: none for a drafter without files
        if kind is not None and kind.network == "checkpoint" and sharded:
            # a checkpoint is read as the target is (int8 applies), whole on every rank
            # a file's own codes where the drafter's file has them
            own = quantize if quantize != "file" or is_gguf(self.draft_dir) else None
            network = load_model_tp(self.draft_dir, device, dtype, quantize=own, shard=False)
        elif kind is not None and kind.needs_files:
            # a head is checked against its target by its loader
            network = kind.load(self.draft_dir, target, self.target, device, draft_dtype)
        drafter = None
        if kind is not None and kind.bare:
            drafter = network  # a draft model is returned as the model itself (the loops wrap it)
        elif kind is not None:
            drafter = kind.build(network, target)
        drafter = hybrid_of(self.copier, drafter, self.model_gamma)
        draft = network if is_checkpoint(self.kind) else None
        networks = (
            [net for net in (target, draft, trait(drafter, "head")) if net is not None]
            if prepare_models
            else []
        )
        counts = [prepare_for_decoding(net, stack=stack, prepack=prepack) for net in networks]
        fused, prepacked = (sum(column) for column in zip(*counts)) if counts else (0, 0)
        return Pair(
            target,
            drafter,
            self.tokenizer,
            self.kind,
            time.perf_counter() - start,
            fused,
            prepacked,
            self.stop_ids,
            self.copier,
            self.model_gamma,
        )


@dataclass
class Pair:
    """A loaded pair; it unpacks as ``target, draft, tokenizer``.

    ``draft`` is what the loops take: a draft model, a drafter, or None. ``load_s`` is the
    loading time; ``fused`` and ``prepacked`` count the projection groups stacked and the
    layers prepacked (model/fast/fuse.py, model/fast/prepack.py)."""

    target: Llama
    draft: Any
    tokenizer: Tokenizer
    kind: str | None = None
    load_s: float = 0.0
    fused: int = 0
    prepacked: int = 0
    stop_ids: tuple[int, ...] = ()  # every id that ends a generation (PairSpec.stop_ids)
    copier: str | None = None  # a hybrid's copier (PairSpec.copier)
    model_gamma: int = HYBRID_MODEL_GAMMA

    def __iter__(self) -> Iterator[Any]:
        return iter((self.target, self.draft, self.tokenizer))

    @property
    def draft_model(self) -> Llama | None:
        """The draft model, when the drafter is one (or is built around one, a parallel draft)."""
        kind = registered(self.kind)
        if kind is not None and kind.bare and self.copier is None:
            return self.draft
        return trait(self.draft, "model")

    @property
    def head(self) -> torch.nn.Module | None:
        """The feature head, when the drafter is one."""
        return trait(self.draft, "head")

    @property
    def draft_dtype(self) -> torch.dtype | None:
        """The dtype the drafter's network runs in (None for a drafter without one: lookup)."""
        network = self.draft_model if self.draft_model is not None else self.head
        return None if network is None else network.dtype

    def set_up(
        self,
        setup: str,
        widths: Sequence[int],
        positions: int,
        *,
        batch: int = 1,
        tree: Sequence[int] | None = None,
        store: Any = None,
        stack: bool = True,
        prepack: bool = True,
        progress: Callable[[str], None] | None = None,
    ) -> tuple[Pair, Setups]:
        """The pair set up to decode, from its networks as loaded (PairSpec.load with
        prepare_models=False), for calls of ``widths`` tokens, ``batch`` rows, a ``tree``, and
        sequences of up to ``positions`` tokens. ``setup``: "default" (model.fast.setup.default_setups:
        the compiled steps that ``store`` holds for this run, else stacked and prepacked as
        ``stack`` and ``prepack`` say), or a request of model.fast.setup.candidates, measured or forced
        by model.fast.setup.choose_setups, compiled steps kept in ``store`` (a weights.StepCache)
        when one is given (their packages take a cache of any length: one build serves every run);
        ``progress`` gets a line as each compiled step is built and every few seconds meanwhile."""
        # Deferred: model.fast.setup loads Inductor's config (about a second), which loading a pair does not need.
        from model.fast.setup import candidates, choose_setups, default_setups

        context = min(
            m.config.max_seq_len for m in (self.target, self.draft_model) if m is not None
        )
        cache_len = min(context, positions)
        models = dict(draft=self.draft_model, head=self.head, batch=batch, tree=tree)
        if setup == "default":
            setups = default_setups(
                self.target, widths, cache_len, store=store, stack=stack, prepack=prepack, **models
            )
        else:
            notes: list[str] = []
            setups = choose_setups(
                self.target,
                candidates(setup),
                widths,
                cache_len,
                store=store,
                note=notes.append,
                progress=progress,
                **models,
            )
            setups.notes = notes
        pair = self.with_models(setups.target, setups.draft)
        counts = [
            prepared(net) for net in (pair.target, pair.draft_model, pair.head) if net is not None
        ]
        return replace(
            pair, fused=sum(c[0] for c in counts), prepacked=sum(c[1] for c in counts)
        ), setups

    def with_models(self, target: Llama, draft_model: Llama | None = None) -> Pair:
        """The same pair with other target and draft model objects (model.fast.setup.choose_setups
        returns copies): a feature head's drafter is built anew around the new target."""
        kind = registered(self.kind)
        draft = self.draft
        if kind is not None and kind.network == "checkpoint":
            draft = draft_model if kind.bare else kind.build(draft_model, target)
        elif kind is not None and kind.network == "head":
            draft = kind.build(self.head, target)
        else:
            return replace(self, target=target)
        return replace(self, target=target, draft=hybrid_of(self.copier, draft, self.model_gamma))


def hybrid_of(copier: str | None, drafter: Any, model_gamma: int) -> Any:
    """``drafter`` itself, or with a copier beside it: a hybrid proposer (speculative.draft.hybrid)."""
    if copier is None or drafter is None:
        return drafter
    return HybridDrafter(DRAFTERS[copier].build(None, None), as_drafter(drafter), model_gamma)


def read_pair(target: str | os.PathLike, draft: str | os.PathLike | None = None) -> PairSpec:
    """Resolve both names and read their configs and tokenizers; nothing heavy is read.

    Raises UnknownCheckpointError or CheckpointError for a name or folder that is not there
    or broken, and speculative.PairMismatchError, naming both, when a draft model does not
    share the target's vocabulary and tokenizer."""
    if draft == HYBRID:
        draft = named_draft(target, HYBRID)
    copier = None
    model_draft = draft
    if draft is not None:
        copier, model_draft = split_hybrid(draft)
    kind = draft_kind(model_draft)
    target_dir = resolve(target)
    draft_dir = None
    if kind is not None and DRAFTERS[kind].needs_files:
        draft_dir = resolve(model_draft)
    target_config = read_config(target_dir)
    draft_config = read_config(draft_dir) if is_checkpoint(kind) else None
    tokenizer = load_tokenizer(target_dir)
    if is_checkpoint(kind):  # check_pair reads only .config and the tokenizers
        # a parallel draft's vocabulary is the target's plus its mask id (pard_token) at the end
        own = draft_config
        if draft_config.vocab_size == target_config.vocab_size + DRAFTERS[kind].extra_ids:
            own = replace(draft_config, vocab_size=target_config.vocab_size)
        try:
            check_pair(
                SimpleNamespace(config=target_config),
                SimpleNamespace(config=own),
                tokenizer,
                load_tokenizer(draft_dir),
            )
        except PairMismatchError as err:
            raise PairMismatchError(
                f"draft {draft} cannot speculate for target {target}: {err}"
            ) from None
    generation = read_generation_config(target_dir)
    return PairSpec(
        str(target),
        None if draft is None else str(draft),
        kind,
        target_dir,
        draft_dir,
        target_config,
        draft_config,
        tokenizer,
        stop_ids(target_config, generation, tokenizer),
        generation,
        copier,
        (proposal_length(draft_dir) if copier and draft_dir else None) or HYBRID_MODEL_GAMMA,
    )


def load_pair(
    target: str | os.PathLike,
    draft: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> Pair:
    """A target and its drafter by name or path (``draft``: a checkpoint, a feature head such
    as ``tiny-eagle``, ``lookup``, or None for the target alone), checked as :func:`read_pair`
    checks them and loaded as :meth:`PairSpec.load` loads them (``options`` are its keywords),
    ready for decoding. It unpacks as ``target, draft, tokenizer``."""
    return read_pair(target, draft).load(device, dtype, **options)


# ----------------------------------------------------------------------------- the command line's pair
# generate.py and serve.py load a pair the same way: read (refused before any weight is read), the
# script's own checks, then the memory check, the weights and the set-up. Here once, for both.
DEFAULT_TARGET = "tiny-target"  # the shipped pair: both scripts' --target and --draft by default
DEFAULT_DRAFT = "tiny-draft"


def default_draft(target: str | os.PathLike) -> str:
    """``--draft`` when none is named: the target's own drafter (:func:`own_drafter`), or the set-up
    measured faster for its target where MEASURED_DEFAULTS names one: suffix decoding alone, or the head
    beside it ("suffix+NAME", a hybrid)."""
    own = own_drafter(target)
    measured = MEASURED_DEFAULTS.get(own)
    if measured == HYBRID:
        return hybrid_name(own)
    return measured or own


def own_drafter(target: str | os.PathLike) -> str:
    """The drafter trained for ``target``: for a target of the shape a shipped drafter of FOR_OTHER_TARGETS
    was trained for (hidden size, vocabulary, layers: a head's fingerprint check then tells whether it is
    that very model), that drafter; else the shipped pair's draft (refused, with a hint, under another
    target). ``--draft hybrid`` runs it beside suffix decoding."""
    config = _target_config(target)
    if config is None:
        return DEFAULT_DRAFT
    for name in FOR_OTHER_TARGETS:
        folder = WEIGHTS_DIR / name
        try:
            trained_for = json.loads((folder / "config.json").read_text())["target_shape"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if trained_for == target_shape(config):
            return name
    return DEFAULT_DRAFT


def stored_dtype(target: str | os.PathLike) -> str | None:
    """The target's own dtype as its config names it (torch_dtype, or transformers 5's dtype; a GGUF's: float32
    once dequantized), or None where it names none or cannot be read (the pair's own reading then says what is
    wrong)."""
    config = _target_config(target)
    return None if config is None else config.extra.get("torch_dtype") or config.extra.get("dtype")


def _target_config(target: str | os.PathLike) -> ModelConfig | None:
    """--target's config, read before the pair is, or None where it cannot be read: the pair's own reading then
    says what is wrong with the target."""
    try:
        return read_config(resolve(target))
    except (UnknownCheckpointError, CheckpointError):
        return None


def named_draft(target: str | os.PathLike, draft: str | None, no_draft: bool = False) -> str | None:
    """The scripts' draft: None with --no-draft, else --draft, or :func:`default_draft` of --target."""
    if no_draft:
        return None
    if draft is None:
        return default_draft(target)
    if draft == HYBRID:
        return hybrid_name(own_drafter(target))
    return draft


@dataclass(frozen=True)
class NamedPair:
    """What a command line's --target, --draft, --no-draft and --gamma mean (:func:`read_named_pair`)."""

    spec: PairSpec  # the pair, read
    # --draft, or the target's default draft when none was named; None with --no-draft
    draft: str | None
    defaulted: bool  # the draft is the target's default, not named
    gamma: int | str  # --gamma, or a default head's own draft length when --gamma was not given


def read_named_pair(
    target: str,
    draft: str | None,
    gamma: int | str,
    *,
    no_draft: bool = False,
    gamma_given: bool = True,
) -> NamedPair:
    """:func:`read_pair` of a command line's ``--target`` and ``--draft`` (none with ``--no-draft``),
    and the ``gamma`` to run: the one given, or, where the draft is the target's default and
    ``gamma_given`` is False, the draft length its own config proposes (a speculators head's, measured
    for it). A draft that cannot speculate for the target says, when it is the default draft under
    another target, how to name one."""
    chosen = named_draft(target, draft, no_draft)
    defaulted = chosen is not None and draft is None
    if chosen is not None and not gamma_given and adapts_length(chosen):
        gamma = ADAPTIVE_GAMMA
    elif defaulted and not gamma_given:
        gamma = proposal_length(resolve(chosen)) or gamma
    try:
        spec = read_pair(target, chosen)
    except PairMismatchError as err:
        hint = ""
        if defaulted:
            hint = f" (--draft defaults to {DEFAULT_DRAFT}; name a draft of the target's family, or --no-draft)"
        raise PairMismatchError(f"{err}{hint}") from None
    return NamedPair(spec, chosen, defaulted, gamma)


def say_progress(line: str) -> None:
    """A compile's progress line, on stderr as it happens (model/fast/progress.py)."""
    print(f"compile: {line}", file=sys.stderr, flush=True)


def load_named_pair(
    named: NamedPair,
    device: torch.device,
    dtype: torch.dtype,
    *,
    positions: int,
    rows: int,
    gamma: int | str,
    gamma_max: int,
    cache_len: int | None = None,
    tree: Sequence[int] | None = None,
    world_size: int = 1,
    flag: str,
    draft_dtype: torch.dtype | None = None,
    quantize: str | None = None,
    setup: str = "default",
    stack: bool = True,
    prepack: bool = True,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[Pair, Setups]:
    """The pair ``named`` loaded as a command line asks (--quantize, --setup, not --no-fuse: ``stack``,
    not --no-prepack: ``prepack``, --cache-dir): refused first when KV caches of ``positions`` x
    ``rows`` do not fit (model.scale.memory.check_memory; this rank's share of ``world_size``), then
    loaded and set up (:meth:`Pair.set_up`) for the widths that ``gamma`` calls
    (model.fast.compile.decode_widths, up to ``gamma_max``), ``rows`` rows, a ``tree`` and
    ``cache_len`` positions (default ``positions``). The default set-up takes compiled steps from
    the cache (none without ``stack`` or ``prepack``, or under tensor parallelism, whose shards are
    not cached). The drafter runs in ``draft_dtype`` (--draft-dtype), else in
    :meth:`PairSpec.draft_dtype`. A set-up that does not apply is one ValueError led by ``flag``,
    the flag that asked; so is --quantize int4 anywhere but on a CPU in float32 or bfloat16 (torch's
    packed int4 kernel)."""
    spec = named.spec
    if quantize in ("int4", "file") and (device.type != "cpu" or dtype not in INT4_DTYPES):
        raise ValueError(
            f"--quantize {quantize} runs on a CPU in float32 or bfloat16 (torch's packed int4 kernel), not "
            f"{device.type} in {str(dtype).removeprefix('torch.')}: add --device cpu, or drop --dtype"
        )
    planned = spec.planned_draft
    check_memory(
        (spec.target, spec.target_config),
        None if planned is None else (named.draft, planned),
        positions,
        dtype,
        device,
        tp_size=world_size,
        quantize=quantize,
        batch=rows,
    )
    try:
        pair = spec.load(
            device,
            dtype,
            quantize=quantize,
            tensor_parallel=world_size > 1,
            prepare_models=False,
            draft_dtype=draft_dtype or spec.draft_dtype(device, dtype),
        )
    except CheckpointError as err:
        # a default head whose target has the shape but not the weights it was made for
        if not named.defaulted:
            raise
        raise CheckpointError(
            f"{err} (--draft defaulted to {named.draft}, trained for a model of this shape; name "
            "another --draft, or --no-draft)"
        ) from None
    widths = decode_widths(gamma, gamma_max) if spec.kind else (1,)
    if spec.kind and named.draft is not None and adapts_length(named.draft):
        # chains whose length varies from one iteration to the next: the ladder of widths that
        # gamma "auto" compiles, so that a short chain is not padded to the longest verification
        widths = decode_widths("auto", gamma if isinstance(gamma, int) else gamma_max)
    if spec.copier is not None:  # the model drafter's verifications, besides the copier's longest
        widths = tuple(sorted({*widths, spec.model_gamma + 1}))
    store = None  # compiled steps are cached for one process's stacked and prepacked models only
    if stack and prepack and world_size <= 1:
        store = StepCache(cache_dir)
    try:
        return pair.set_up(
            setup,
            widths,
            positions if cache_len is None else cache_len,
            batch=rows,
            tree=tree if spec.kind else None,
            store=store,
            stack=stack,
            prepack=prepack,
            progress=say_progress,
        )
    except ValueError as err:
        # a set-up that does not apply, or --compile force that cannot compile
        raise ValueError(f"{flag}: {err}") from None
