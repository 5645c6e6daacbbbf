"""What the checker checks: the object named on its command line, as a verifier or a way to
make a drafter for a toy target, and the one-line errors for anything else (:class:`InputError`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from speculative.draft.protocol import DRAFTER_METHODS, is_drafter, trait
from speculative.draft.registry import DRAFTERS, UnresolvedError, find, load_object
from speculative.proofs.branching import Broken, Contract, NotApplicable
from speculative.verify.registry import RULES


class InputError(Exception):
    """The object cannot be checked; the message is the one line the command prints."""


@dataclass
class Subject:
    """The object under check: a verifier, or a way to get a drafter for a toy target."""

    label: str
    kind: str  # "verifier" or "drafter"
    verifier: Callable | None = None
    make: Callable[[torch.nn.Module], Any] | None = None

    def drafter(self, target: torch.nn.Module) -> Any:
        try:
            drafter = self.make(target)
        except Exception as error:
            raise InputError(
                f"making the drafter {self.label} raised {type(error).__name__}: {error}"
            ) from None
        if isinstance(drafter, type) or not is_drafter(drafter):
            raise InputError(
                f"{self.label} made {kind_of(drafter)}, not a drafter "
                f"(an object with {', '.join(DRAFTER_METHODS)})"
            )
        if trait(drafter, "model") is target:
            raise InputError(
                f"{self.label} called with the toy target drafts with the target itself; pass a "
                "function that builds a draft for it, e.g. speculative.prove:model_drafter"
            )
        return drafter


def can_call(function: Callable, count: int) -> bool | None:
    try:
        inspect.signature(function).bind(*range(count))
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins)
        return None
    return True


def subject(obj: Any, label: str) -> Subject:
    """What ``obj`` is: a drafter, a drafter factory or a verifier; InputError for anything else."""
    if not isinstance(obj, type) and is_drafter(obj):
        return Subject(label, "drafter", make=lambda target: obj)
    if callable(obj):
        if can_call(obj, 4) and not can_call(obj, 1):
            return Subject(label, "verifier", verifier=obj)
        if can_call(obj, 0):
            return Subject(label, "drafter", make=lambda target: obj())
        if can_call(obj, 1):
            return Subject(label, "drafter", make=obj)
    raise InputError(
        f"{label} ({kind_of(obj)}) is neither a verifier (rule(p, q, drafted, generator) -> Verdict) "
        "nor a drafter (an object with start/propose/commit/keep_rows, or a function or class that "
        "makes one from nothing or from the target)"
    )


def kind_of(obj: Any) -> str:
    """'an int', 'a class of 2 arguments', ... for the message about the wrong kind of object."""
    if callable(obj):
        try:
            count = sum(
                p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                for p in inspect.signature(obj).parameters.values()
            )
        except ValueError:
            return "a callable of unknown arguments"
        return f"a {'class' if isinstance(obj, type) else 'callable'} of {count} argument{'s' * (count != 1)}"
    name = type(obj).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def load(spec: str) -> tuple[Any, str]:
    """The object named by MODULE:OBJECT (a dotted module or a .py file), or by a registered
    name: a verification rule (speculative.verify.RULES) or a drafter kind, whose toy instance
    is checked (speculative.draft.DRAFTERS); InputError otherwise."""
    if ":" not in spec and spec in RULES:
        return RULES[spec].verify, f"rule {spec}"
    if ":" not in spec and find(spec) is not None:  # registered, or an installed drafter package's
        toy = DRAFTERS[spec].toy
        return (load(toy)[0] if isinstance(toy, str) else toy), f"drafter {spec}"
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise InputError(
            f"expected MODULE:OBJECT (a dotted module name or a .py file, then a name in it), or a "
            f"registered rule ({', '.join(RULES)}) or drafter ({', '.join(DRAFTERS)}), got {spec!r}"
        )
    try:
        return load_object(spec), spec
    except UnresolvedError as error:
        raise InputError(str(error)) from None


@contextmanager
def blaming(what: str, case: Any) -> Iterator[None]:
    """An exception of the code under check, turned into InputError (one line, with the case)."""
    try:
        yield
    except Broken as error:
        error.where = str(case)
        raise
    except (InputError, NotApplicable):
        raise
    except Contract as error:
        raise InputError(f"{what} {error} ({case})") from None
    except Exception as error:
        raise InputError(f"{what} raised {type(error).__name__}: {error} ({case})") from None
