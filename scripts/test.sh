#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: ruff (lint + format check), then pytest over
# tests/ and the notebooks (nbval) in two worker processes (pytest-xdist; CI has 2 cores). Extra arguments go
# to pytest (`-n 0` runs everything in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check hapnb widgets tests benchmarks examples
.venv/bin/ruff format --check hapnb widgets tests benchmarks examples
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 "$@"
