"""``python -m hapnb.rules --check [OP ...]``: the same command as ``python -m hapnb.triples --check``."""

from __future__ import annotations

import sys

from .checker import main

if __name__ == "__main__":
    sys.exit(main())
