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
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 -m "not browser and not timing"
# Then, in one process, the tests that a second worker on CI's 2 cores disturbs (about a minute): the browser
# test (JupyterLab's widget manager has missed the Explorer's widget models, "model not found", for a whole
# page) and the live re-balancing runs, which decide on measured step times (a straggler measured at 6.3x
# instead of 3x once took the other, also valid, option).
# Over all of tests/ (collecting it takes ~5 s), so a test marked anywhere is run by one of the passes.
.venv/bin/python -m pytest -q -p no:cacheprovider -m "browser or timing"
