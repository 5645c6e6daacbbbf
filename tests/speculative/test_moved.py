"""The module paths the README and the docs showed before the layout by role still import, for
one release, each with a DeprecationWarning that names the new place (model/moved.py)."""

from __future__ import annotations

import importlib
import sys

import pytest

import speculative  # noqa: F401 -- installs its table of moves
import weights  # noqa: F401 -- installs its table of moves
from model.moved import FINDER
from speculative.proofs.checker import load

SHOWN = {  # old module: a name the docs used from it
    "speculative.block": "verify_block", "speculative.lookup": "PromptLookupDrafter",
    "speculative.drafter": "ModelDrafter", "speculative.calls": "chain", "speculative.pair": "check_pair",
    "speculative.tree": "TokenTree", "speculative.toys": "ref_warp", "model.setup": "default_setups",
    "model.aot": "entry_key", "weights.text": "encode_dialog",
}


@pytest.mark.parametrize("old", sorted(FINDER.moves))
def test_an_old_path_warns_and_gives_the_new_module(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} has moved to {FINDER.moves[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(FINDER.moves[old])
    if old in SHOWN:
        assert hasattr(module, SHOWN[old])
    sys.modules.pop(old, None)


def test_every_shown_path_is_kept() -> None:
    assert set(SHOWN) <= set(FINDER.moves)


def test_the_checker_still_takes_the_old_names() -> None:
    with pytest.warns(DeprecationWarning):
        obj, _ = load("speculative.block:verify_block")
    assert obj is importlib.import_module("speculative.verify.block").verify_block
    assert load("speculative.prove:model_drafter")[0].__name__ == "model_drafter"
