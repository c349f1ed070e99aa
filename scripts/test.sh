#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: ruff (lint + format check), then pytest over
# tests/ and the notebooks (nbval) in two worker processes (pytest-xdist; CI has 2 cores), then the browser
# test alone. Extra arguments go to pytest and run in one pass (`-n 0` runs everything in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check hapnb widgets tests benchmarks examples
.venv/bin/ruff format --check hapnb widgets tests benchmarks examples
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 "$@"
fi
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 -m "not browser"
# The browser test runs on its own (about 20 s): inside the two-worker run, on CI's loaded 2 cores,
# JupyterLab's widget manager has missed the Explorer's widget models ("model not found") for a whole page.
.venv/bin/python -m pytest -q -p no:cacheprovider -m browser tests/test_browser.py
