"""`python -m paritykit ...` is the `paritykit` command (torchrun launches it this way)."""

import sys

from paritykit.gate.cli import main

if __name__ == "__main__":
    sys.exit(main())
