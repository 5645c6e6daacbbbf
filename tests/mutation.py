"""Source-level mutants: a module's own source with a few lines changed, run as a fresh module.

A mutant made this way breaks the code the loop actually runs (a comparison, a wiring slip
inside a function), which patching a module attribute cannot reach. Every replacement must
match the source exactly once, so that a refactor cannot silently turn a mutant into the
original code."""

from __future__ import annotations

import inspect
import itertools
import sys
import types

_COUNT = itertools.count()


def mutated(module: types.ModuleType, *replacements: tuple[str, str]) -> types.ModuleType:
    """A copy of ``module`` whose source has each ``old`` replaced by ``new``."""
    source = inspect.getsource(module)
    for old, new in replacements:
        if source.count(old) != 1:
            raise AssertionError(f"mutant of {module.__name__}: {old!r} occurs {source.count(old)} times, not once")
        source = source.replace(old, new)
    mutant = types.ModuleType(f"{module.__name__}_mutant{next(_COUNT)}")
    mutant.__file__ = module.__file__
    sys.modules[mutant.__name__] = mutant  # dataclasses look their module up while the class is made
    exec(compile(source, f"<mutant of {module.__name__}>", "exec"), mutant.__dict__)
    return mutant
