"""Drafting: lines 1-3 of Algorithm 1, whatever proposes the tokens.

protocol.py is the one interface every drafter implements (:class:`Drafter`, returning a
:class:`Draft`); each drafter is a module of its own: a draft model (model.py), prompt
lookup (lookup.py), a head on the target's features (eagle.py), the parallel drafters
(parallel.py). trees.py grows token trees for the drafters that can; distill.py, ttt.py and
parallel_training.py hold the losses that train drafts. Each drafter kind is registered once by
name, at the end of its own file (registry.py, :data:`DRAFTERS`).

Every module of this package is imported here, so that a drafter's registration runs whatever
imports the package: adding a built-in drafter is adding its file (docs/layout.md, "Add your own").
"""

import importlib
import pkgutil

from speculative.draft.eagle import FeatureDrafter
from speculative.draft.lookup import PromptLookupDrafter
from speculative.draft.model import ModelDrafter, as_drafter
from speculative.draft.parallel import ParallelDrafter, ParallelFeatureDrafter
from speculative.draft.protocol import Draft, Drafter
from speculative.draft.registry import DRAFTERS, DrafterKind, drafter_kind, register_drafter

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "DRAFTERS",
    "Draft",
    "Drafter",
    "DrafterKind",
    "FeatureDrafter",
    "ModelDrafter",
    "ParallelDrafter",
    "ParallelFeatureDrafter",
    "PromptLookupDrafter",
    "as_drafter",
    "drafter_kind",
    "register_drafter",
]
