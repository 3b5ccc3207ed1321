"""`python -m k3 …`: the same commands as the `k3` console script (k3.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
