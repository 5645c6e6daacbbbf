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
* ``memory``: how the memory plan counts it ("none", "own" or "target-block");
* ``bare``: a loaded pair hands its network over as the drafter, unbuilt (a draft model: the loops
  wrap a model themselves, and a caller of weights.load_pair gets the model);
* ``extra_ids``: the ids its checkpoint has after the target's vocabulary (a parallel draft's mask
  id), left out when the two vocabularies are compared.

``loader``, ``recognizes`` and ``toy`` may be "MODULE:OBJECT" strings, read when first needed: a
drafter in speculative/ names its file reader in weights/ without importing it (the layers of
docs/layout.md), and a drafter of one's own may keep all three in its one file.

Outside this package a kind comes from ``--draft MODULE:OBJECT`` (a DrafterKind, or a drafter class
or factory of the target) or from an installed package's entry point in the group
``speculative_llama.drafters`` (:func:`find`). MODULE is a dotted module name or a .py file:
:func:`load_object` reads every MODULE:OBJECT of the project, ``python -m speculative.prove``'s too.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ENTRY_POINTS = "speculative_llama.drafters"


@dataclass(frozen=True)
class DrafterKind:
    name: str
    description: str  # one line, for --help and the docs
    build: Callable[[Any, Any], Any]  # build(loaded network or None, target) -> a drafter
    # for the proofs: toy(small float64 target) -> a drafter, or "MODULE:OBJECT"
    toy: str | Callable[[Any], Any]
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
    bare: bool = False  # a loaded pair's drafter is its network itself (a draft model)
    extra_ids: int = 0  # ids of its checkpoint after the target's vocabulary (a mask id)

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
    """``what`` itself, or the object a "MODULE:OBJECT" string names (:func:`load_object`)."""
    return load_object(what) if isinstance(what, str) else what


# ----------------------------------------------------------------------------- MODULE:OBJECT
# The one reader of the names that `--draft MODULE:OBJECT`, `python -m speculative.prove
# MODULE:OBJECT` and a registration's "MODULE:OBJECT" strings give.
class UnresolvedError(ValueError):
    """A MODULE:OBJECT that names nothing; the message is one line."""


def names_object(spec: str) -> bool:
    """Whether ``spec`` reads as MODULE:OBJECT: a dotted module name or a .py file, a colon, and a
    (dotted) name in it."""
    where, _, name = spec.rpartition(":")
    if not where or not all(part.isidentifier() for part in name.split(".")):
        return False
    return is_file(where) or all(part.isidentifier() for part in where.split("."))


def is_file(where: str) -> bool:
    """Whether the MODULE of a MODULE:OBJECT is a .py file (or a path), not a dotted module name."""
    return where.endswith(".py") or "/" in where or "\\" in where


def load_object(spec: str) -> Any:
    """The object ``MODULE:OBJECT`` names: MODULE a dotted module name, or a .py file (imported as
    ``python file.py`` would import it, its folder on the module path), OBJECT a (dotted) name in
    it. UnresolvedError, one line, when it names nothing or its module does not import."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UnresolvedError(
            "expected MODULE:OBJECT (a dotted module name or a .py file, then a name in it), "
            f"got {spec!r}"
        )
    obj = module_of_file(where) if is_file(where) else imported(where)
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UnresolvedError(f"{where} has no {name!r}") from None
    return obj


def imported(where: str) -> ModuleType:
    """The module of a dotted name; UnresolvedError naming the module that is missing or what
    importing it raised."""
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as error:
        if error.name and (where == error.name or where.startswith(error.name + ".")):
            raise UnresolvedError(f"no module named {where!r}") from None
        raise UnresolvedError(f"importing {where} raised ModuleNotFoundError: {error}") from None
    except Exception as error:
        raise UnresolvedError(f"importing {where} raised {type(error).__name__}: {error}") from None


def module_of_file(where: str) -> ModuleType:
    """A .py file as a module, named ``_file_STEM`` and kept in sys.modules, so that its functions
    find their module (dataclasses, the checker's patches); its folder goes on the module path,
    for its own imports of the files beside it, as ``python file.py``."""
    path = Path(where)
    if not path.is_file():
        raise UnresolvedError(f"no file {where}")
    module_name = f"_file_{path.stem}"
    if str(path.resolve().parent) not in sys.path:
        sys.path.append(str(path.resolve().parent))
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    try:
        loader.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise UnresolvedError(f"importing {where} raised {type(error).__name__}: {error}") from None
    return module


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
    if names_object(name):
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
    try:
        obj = load_object(spec)
    except UnresolvedError as error:
        raise ValueError(f"--draft {spec}: {error}") from None
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
