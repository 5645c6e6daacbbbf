"""Old module paths, kept for one release: importing one warns (DeprecationWarning) and gives
the module that now holds its contents (docs/layout.md has the new layout).

Each package installs its own table of moves (:func:`install`); the finder here resolves an old
name to its new module, which is imported as usual, and registers it under the old name too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Mapping
from types import ModuleType


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} has moved to {self.new}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module ran already


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds the old names of moved modules."""

    def __init__(self) -> None:
        self.moves: dict[str, str] = {}

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.moves:
            return None
        return importlib.util.spec_from_loader(name, _Alias(self.moves[name]))


FINDER = MovedModules()


def install(moves: Mapping[str, str]) -> None:
    """Old module name -> new module name, for every move of a package."""
    FINDER.moves.update(moves)
    if FINDER not in sys.meta_path:
        sys.meta_path.append(FINDER)


install({f"model.{name}": f"model.fast.{name}" for name in ("aot", "compile", "fuse", "prepack", "setup")}
        | {f"model.{name}": f"model.scale.{name}" for name in ("memory", "quantize", "tensor_parallel")})
