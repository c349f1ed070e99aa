#!/usr/bin/env bash
# Set up (scripts/setup.sh, without the browser) and run the main job: `hapnb demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
HAPNB_BROWSER=0 bash scripts/setup.sh
.venv/bin/hapnb demo "$@"
