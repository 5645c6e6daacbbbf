"""Drafting: lines 1-3 of Algorithm 1, whatever proposes the tokens.

protocol.py is the one interface every drafter implements (:class:`Drafter`, returning a
:class:`Draft`); each drafter is a module of its own: a draft model (model.py), prompt
lookup (lookup.py), a head on the target's features (eagle.py). trees.py grows token trees
for the drafters that can; distill.py holds the losses that train drafts. Each drafter kind
is registered once by name (registry.py, :data:`DRAFTERS`).
"""

from speculative.draft.eagle import FeatureDrafter
from speculative.draft.lookup import PromptLookupDrafter
from speculative.draft.model import ModelDrafter, as_drafter
from speculative.draft.protocol import Draft, Drafter
from speculative.draft.registry import DRAFTERS, DrafterKind, drafter_kind, register_drafter

__all__ = ["DRAFTERS", "Draft", "Drafter", "DrafterKind", "FeatureDrafter", "ModelDrafter", "PromptLookupDrafter",
           "as_drafter", "drafter_kind", "register_drafter"]
