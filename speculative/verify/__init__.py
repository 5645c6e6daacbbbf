"""Verification rules: lines 5-9 of Algorithm 1, given the target's p and the drafter's q.

A rule is ``rule(p [g+1, V], q [g, V], drafted [g], generator) -> Verdict`` (verdict.py: what a
rule returns, read once into a Verification). The chain rules are registered here by name
(:data:`RULES`): token-wise (token.py, Algorithm 1), block (block.py, Sun et al. 2025) and
drafter-invariant (invariant.py, Daliri et al. 2024: noise keyed by seed and position). A
token tree is verified by its own walk (tree.py), chosen by drafting a tree, not by name.
"""

from speculative.verify.registry import RULES, Rule, register_rule, rule
from speculative.verify.token import (
    acceptance_probability,
    expected_acceptance,
    residual_distribution,
    verify_greedy,
    verify_step,
)
from speculative.verify.verdict import Verdict, Verification, together

__all__ = [
    "RULES",
    "Rule",
    "Verdict",
    "Verification",
    "acceptance_probability",
    "expected_acceptance",
    "register_rule",
    "residual_distribution",
    "rule",
    "together",
    "verify_greedy",
    "verify_step",
]
