"""``python -m speculative.prove MODULE:OBJECT``: the proofs' checker (speculative/proofs/checker.py)."""

import sys

from speculative.proofs.checker import check, main

__all__ = ["check", "main"]

if __name__ == "__main__":
    sys.exit(main())
