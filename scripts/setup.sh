#!/usr/bin/env bash
# Set up a fresh machine for hapnb: system packages (graphviz, chromium for the browser test; only when
# missing and we may install), a virtual environment in .venv, torch's CPU wheel first (a loose torch
# requirement would pull a multi-GB CUDA build), then hapnb with its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
want_apt=()
command -v dot >/dev/null 2>&1 || want_apt+=(graphviz)
if [ "${HAPNB_BROWSER:-1}" = 1 ] && ! command -v chromium >/dev/null 2>&1; then want_apt+=(chromium); fi
if [ ${#want_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${want_apt[*]} with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${want_apt[@]}" >/dev/null
  else
    echo "note: ${want_apt[*]} missing and apt-get unavailable; tests that need them are skipped" >&2
  fi
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, hapnb; print('hapnb', hapnb.__version__, 'torch', torch.__version__)"
