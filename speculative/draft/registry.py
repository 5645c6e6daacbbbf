"""The drafter kinds by name: what ``--draft`` can mean, and everything the project needs to know
of a kind, in its one registration.

A kind is registered once, by the module that defines its drafter (:func:`register_drafter`; the
built-in ones in model.py, parallel.py, eagle.py and lookup.py, which speculative/draft/__init__.py
imports). The registration says:

* ``build(network, target)``: the drafter, from what weights/ loaded (or None);
* ``toy(target)``: one for the checker's small float64 target (``python -m speculative.prove NAME``);
* ``loader``: what reads its files, ``loader(folder, target, target_name, device, dtype) -> network``,
  or None for a drafter that needs none (``--draft NAME`` names it directly);
* ``recognizes(config)``: whether a folder's config.json is one of its own (``--draft FOLDER``);
* ``network``: what ``build`` receives, "checkpoint" (a Llama loaded as a target is: tensor
  parallelism and int8 apply, its own config counts in the memory plan) or "head" (a network on
  the target's features: one block of the target's shape in the plan), or None;
* ``memory``: how the memory plan counts it ("none", "own" or "target-block").

``loader``, ``recognizes`` and ``toy`` may be "MODULE:OBJECT" strings, read when first needed: a
drafter in speculative/ names its file reader in weights/ without importing it (the layers of
docs/layout.md), and a drafter of one's own may keep all three in its one file.

Outside this package a kind comes from ``--draft MODULE:OBJECT`` (a DrafterKind, or a drafter class
or factory of the target) or from an installed package's entry point in the group
``speculative_llama.drafters`` (:func:`find`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENTRY_POINTS = "speculative_llama.drafters"


@dataclass(frozen=True)
class DrafterKind:
    name: str
    description: str  # one line, for --help and the docs
    build: Callable[[Any, Any], Any]  # build(loaded network or None, target) -> a drafter
    toy: (
        str | Callable[[Any], Any]
    )  # for the proofs: toy(small float64 target) -> a drafter, or "MODULE:OBJECT"
    loader: str | Callable[..., Any] | None = (
        None  # (folder, target, target_name, device, dtype) -> network
    )
    recognizes: str | Callable[[dict[str, Any]], bool] | None = (
        None  # config.json -> one of this kind's folders
    )
    network: str | None = None  # what build receives: "checkpoint", "head" or None
    memory: str = (
        "none"  # the memory plan: "none", "own" (its config) or "target-block" (one target block)
    )

    @property
    def needs_files(self) -> bool:
        return self.loader is not None

    def load(self, *args: Any) -> Any:
        """Its network from its folder (``loader``'s arguments)."""
        return resolved(self.loader)(*args)

    def owns(self, config: dict[str, Any]) -> bool:
        return self.recognizes is not None and bool(resolved(self.recognizes)(config))


DRAFTERS: dict[str, DrafterKind] = {}
DEFAULT_KIND = "model"  # a folder no kind recognizes is a draft model's checkpoint


def register_drafter(kind: DrafterKind) -> DrafterKind:
    """Register a drafter kind (ValueError if its name is taken)."""
    if kind.name in DRAFTERS:
        raise ValueError(f"a drafter kind named {kind.name!r} is registered already")
    DRAFTERS[kind.name] = kind
    return kind


def resolved(what: Any) -> Any:
    """``what`` itself, or the object a "MODULE:OBJECT" string names."""
    if not isinstance(what, str):
        return what
    module, _, name = what.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def drafter_kind(name: str) -> DrafterKind:
    """The kind registered as ``name``; ValueError naming the registered ones otherwise."""
    kind = find(name)
    if kind is None:
        raise ValueError(
            f"drafter kind must be one of {', '.join(map(repr, DRAFTERS))}, got {name!r}"
        )
    return kind


def find(name: str) -> DrafterKind | None:
    """The kind ``name`` means: a registered one, one that an installed package's entry point of that
    name registers (or is), or ``MODULE:OBJECT``; None if none."""
    name = str(name)
    if name in DRAFTERS:
        return DRAFTERS[name]
    if ":" in name and not name.startswith(("/", ".")):
        return _from_object(name)
    for point in importlib.metadata.entry_points(group=ENTRY_POINTS):
        if point.name == name:
            _take(point)
            return DRAFTERS.get(name)
    return None


def _take(point: importlib.metadata.EntryPoint) -> None:
    """An entry point of a drafter package: loading it runs its module's registrations, and a
    DrafterKind it names is registered too."""
    obj = point.load()
    if isinstance(obj, DrafterKind) and obj.name not in DRAFTERS:
        register_drafter(obj)


def load_entry_points() -> None:
    """Every installed drafter package's kinds (entry points of the group ENTRY_POINTS), so that a
    folder of theirs is recognized (of_folder)."""
    for point in importlib.metadata.entry_points(group=ENTRY_POINTS):
        if point.name not in DRAFTERS:
            _take(point)


def _from_object(spec: str) -> DrafterKind:
    """``--draft MODULE:OBJECT``: the module is imported (its registrations run) and the object is a
    registered kind's name, a DrafterKind, or a drafter class or factory, called with the target when
    it takes an argument. ValueError in one line when it cannot be had."""
    module, _, attribute = spec.partition(":")
    try:
        obj = resolved(spec)
    except ModuleNotFoundError as error:
        raise ValueError(f"--draft {spec}: no module named {error.name!r}") from None
    except AttributeError:
        raise ValueError(f"--draft {spec}: {module} has no {attribute!r}") from None
    if isinstance(obj, DrafterKind):
        return DRAFTERS.get(obj.name) or register_drafter(obj)
    if isinstance(obj, str) and obj in DRAFTERS:
        return DRAFTERS[obj]
    if not callable(obj):
        raise ValueError(
            f"--draft {spec}: expected a DrafterKind, a drafter class or a factory of the target, "
            f"got {type(obj).__name__}"
        )
    takes_target = any(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in inspect.signature(obj).parameters.values()
    )
    return register_drafter(
        DrafterKind(
            spec,
            f"{spec}: a drafter of one's own",
            build=lambda network, target: obj(target) if takes_target else obj(),
            toy=lambda target: obj(target) if takes_target else obj(),
        )
    )


def named(name: str) -> DrafterKind | None:
    """The kind that ``--draft name`` means by itself (one that needs no file), or None."""
    kind = find(name)
    return kind if kind is not None and not kind.needs_files else None


def of_folder(config: dict[str, Any]) -> DrafterKind:
    """The kind of a folder whose config.json holds ``config``: the first registered kind that
    recognizes it (installed drafter packages' kinds included), else a draft model's checkpoint."""
    load_entry_points()
    for kind in DRAFTERS.values():
        if kind.owns(config):
            return kind
    return DRAFTERS[DEFAULT_KIND]
