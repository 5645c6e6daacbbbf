"""``python -m speculative.prove MODULE:OBJECT``: the proofs' checker (speculative/proofs/checker.py)."""

import sys

from speculative.proofs.cases import feature_drafter, model_drafter, toy_draft, toy_head
from speculative.proofs.checker import check, main

__all__ = ["check", "feature_drafter", "main", "model_drafter", "toy_draft", "toy_head"]

if __name__ == "__main__":
    sys.exit(main())
