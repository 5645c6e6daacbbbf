import sys

from speculative.proofs.checker import main

sys.exit(main())
