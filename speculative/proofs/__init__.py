"""The proofs as a tool: is a verification rule or a drafter exact?

Entry point: ``python -m speculative.prove MODULE:OBJECT`` (checker.py, :func:`check`), which
runs exact.py (the exact law of a rule or drafter: the code run once per branch of its
randomness) against toys.py (toy models and independent references).
"""

from speculative.proofs.checker import check, main

__all__ = ["check", "main"]
