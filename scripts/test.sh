#!/usr/bin/env bash
# The test command: set up (idempotent) and run the whole suite, on
# $KVSTAGE_TEST_WORKERS pytest-xdist workers (2 unless set: CI's cores; tests of one
# xdist_group on one worker, `slow` tests first: tests/conftest.py); 0 runs it in this
# one process (docs/contributing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
workers=${KVSTAGE_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != 0 ]; then
    parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} "$@"
