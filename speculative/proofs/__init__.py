"""The proofs as a tool: is a verification rule or a drafter exact?

Entry point: ``python -m speculative.prove MODULE:OBJECT`` (checker.py, :func:`check`). It takes
the object (subject.py), builds the toy cases (cases.py) and proves the properties
(properties.py): exact laws by running the code once per branch of its randomness
(branching.py, exact.py), against toy models and independent references (toys.py).
"""

from speculative.proofs.checker import check, main

__all__ = ["check", "main"]
