"""The verification rules by name: what ``--verify NAME``, serve.py and ``python -m
speculative.prove NAME`` accept. A rule is registered once, here or by the module that
defines it, with what it does at temperature 0.

At temperature 0, p and q are one-hot, and every exact rule emits the target's argmax: a rule
registered with ``greedy=True`` is then replaced by the comparison of argmaxes
(token.verify_greedy), the same tokens without a draw; a rule registered with ``greedy=False``
(and any verifier passed as a function) judges one-hot p and q itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from speculative.verify.block import verify_block
from speculative.verify.invariant import verify_invariant
from speculative.verify.token import verify_step


@dataclass(frozen=True)
class Rule:
    name: str
    verify: Callable  # rule(p [g+1, V], q [g, V], drafted [g], generator) -> Verdict
    description: str  # one line, for --help and the docs
    greedy: bool  # at temperature 0: the comparison of argmaxes in its place

    @property
    def at_temperature_0(self) -> str:
        if self.greedy:
            return "the comparison of argmaxes (the target's greedy tokens; the rule itself is not run)"
        return "the rule itself, on one-hot p and q"


RULES: dict[str, Rule] = {}


def register_rule(name: str, verify: Callable, description: str, greedy: bool = False) -> Rule:
    """Register ``verify`` under ``name`` (ValueError if the name is taken)."""
    if name in RULES:
        raise ValueError(f"a verification rule named {name!r} is registered already")
    RULES[name] = Rule(name, verify, description, greedy)
    return RULES[name]


# How a sampled chain is verified unless told otherwise, by the library, generate.py and serve.py alike.
SAMPLED_CHAIN_RULE = "block"


def default_rule(tree: object = None) -> str:
    """The rule every entry point uses unless told otherwise: block verification of a chain, as exact
    as Algorithm 1's token-wise rule and never fewer tokens accepted in expectation (Sun et al.
    2025), so the fastest exact rule (docs/trees_and_blocks.md); a token tree (any ``tree``) is
    verified by its own walk, registered as "token". At temperature 0 both compare argmaxes."""
    if tree is not None:
        return "token"
    return SAMPLED_CHAIN_RULE


def rule(name: str) -> Rule:
    """The rule registered as ``name``; ValueError naming the registered ones otherwise."""
    if name not in RULES:
        raise ValueError(
            f"verify must be one of {', '.join(map(repr, RULES))} or a verifier, got {name!r}"
        )
    return RULES[name]


def keyed(verify: str | Callable) -> bool:
    """Whether a rule (a registered name or a verifier) draws with noise keyed by (seed, position),
    as its function says (``keyed = True``, speculative.verify.invariant): the engine then hands it
    a speculative.sampling.KeyedNoise per row in the generator's place, and draws the rows' plain
    steps (nothing drafted, the target alone) with the same noise, so that the target alone gives
    the tokens the rule gives."""
    verifier = verify if callable(verify) else rule(verify).verify
    return getattr(verifier, "keyed", False) is True


register_rule(
    "token", verify_step, "token-wise: Algorithm 1, lines 5-9 (Leviathan et al. 2023)", greedy=True
)
register_rule(
    "block",
    verify_block,
    "block-wise: the whole draft judged as one block (Sun et al. 2025)",
    greedy=True,
)
register_rule(
    "invariant",
    verify_invariant,
    "drafter-invariant: the target's Gumbel-max token at each position, noise keyed by seed and "
    "position; a seed gives the target alone's tokens whatever the drafter (Daliri et al. 2024)",
    greedy=True,
)
