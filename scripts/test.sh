#!/usr/bin/env bash
# The test command: set up (idempotent) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
