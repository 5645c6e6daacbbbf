"""The drafter kinds by name: what ``--draft`` can mean, how each is built and counted, and
the toy instance the proofs check (``python -m speculative.prove NAME``).

A kind is registered once (the built-in ones at the end of this module; a new one by the
module that defines its drafter, with :func:`register_drafter`). weights/ reads a kind's
files (``files``: "checkpoint" for a Llama checkpoint, "feature-head" for a head's folder,
None for a drafter that needs none, which ``--draft NAME`` then names directly) and hands
what it loaded to ``build``; a folder's kind is the one whose ``model_type`` its config.json
names, else "model".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from speculative.draft.eagle import FeatureDrafter
from speculative.draft.lookup import PromptLookupDrafter
from speculative.draft.model import ModelDrafter
from speculative.draft.parallel import ParallelDrafter, ParallelFeatureDrafter


@dataclass(frozen=True)
class DrafterKind:
    name: str
    description: str  # one line, for --help and the docs
    build: Callable[[Any, Any], Any]  # build(loaded network or None, target) -> a drafter
    toy: str | Callable[[Any], Any]  # for the proofs: toy(small float64 target) -> a drafter, or "MODULE:OBJECT"
    files: str | None = None  # what weights/ reads: "checkpoint", "feature-head", "eagle3-head", or None
    model_type: str | None = None  # config.json's model_type that marks a folder of this kind
    memory: str = "none"  # the memory plan: "none", "own" (its config) or "target-block" (one target block)


DRAFTERS: dict[str, DrafterKind] = {}


def register_drafter(kind: DrafterKind) -> DrafterKind:
    """Register a drafter kind (ValueError if its name is taken)."""
    if kind.name in DRAFTERS:
        raise ValueError(f"a drafter kind named {kind.name!r} is registered already")
    DRAFTERS[kind.name] = kind
    return kind


def drafter_kind(name: str) -> DrafterKind:
    """The kind registered as ``name``; ValueError naming the registered ones otherwise."""
    if name not in DRAFTERS:
        raise ValueError(f"drafter kind must be one of {', '.join(map(repr, DRAFTERS))}, got {name!r}")
    return DRAFTERS[name]


def named(name: str) -> DrafterKind | None:
    """The kind that ``--draft name`` means by itself (one that needs no file), or None."""
    kind = DRAFTERS.get(str(name))
    return kind if kind is not None and kind.files is None else None


def of_folder(model_type: str | None) -> DrafterKind:
    """The kind of a folder whose config.json names ``model_type``: its registered kind, else "model"."""
    for kind in DRAFTERS.values():
        if kind.model_type is not None and kind.model_type == model_type:
            return kind
    return DRAFTERS["model"]


# ----------------------------------------------------------------------------- the built-in kinds
register_drafter(DrafterKind(
    "model", "a smaller model of the target's family (the paper's M_q), from a checkpoint",
    build=lambda network, target: ModelDrafter(network), toy="speculative.proofs.checker:model_drafter",
    files="checkpoint", memory="own"))
register_drafter(DrafterKind(
    "parallel", "a parallel draft model (PARD): gamma tokens from one call, mask tokens after the sequence",
    build=lambda network, target: ParallelDrafter(network, network.config.extra["pard_token"],
                                                  target.config.vocab_size),
    toy="speculative.proofs.checker:parallel_drafter", files="checkpoint", model_type="pard", memory="own"))
register_drafter(DrafterKind(
    "head", "a feature head: drafts from the target's own features (EAGLE), from its folder",
    build=lambda head, target: FeatureDrafter(head, target), toy="speculative.proofs.checker:feature_drafter",
    files="feature-head", model_type="llama-feature-head", memory="target-block"))
register_drafter(DrafterKind(
    "eagle3", "an EAGLE-3 head: fused features of three target layers, its own reduced vocabulary, from its folder",
    build=lambda head, target: FeatureDrafter(head, target), toy="speculative.proofs.checker:eagle3_drafter",
    files="eagle3-head", model_type="eagle3", memory="target-block"))
register_drafter(DrafterKind(
    "peagle", "a P-EAGLE head: an EAGLE-3 head that drafts the whole chain in one call, from its folder",
    build=lambda head, target: ParallelFeatureDrafter(head, target), toy="speculative.proofs.checker:peagle_drafter",
    files="eagle3-head", model_type="peagle", memory="target-block"))
register_drafter(DrafterKind(
    "lookup", "prompt lookup: n-grams copied from the sequence, no model at all",
    build=lambda network, target: PromptLookupDrafter(), toy="speculative.draft.lookup:PromptLookupDrafter"))
