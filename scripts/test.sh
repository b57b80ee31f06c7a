#!/usr/bin/env bash
# The test command: set up (idempotent) and run the whole suite. $KVSTAGE_TEST_WORKERS=N
# runs it on N pytest-xdist workers (tests of one xdist_group on one worker, `slow` tests
# first: tests/conftest.py); unset or 0, in this one process (docs/contributing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
workers=${KVSTAGE_TEST_WORKERS:-0}
parallel=()
if [ "$workers" != 0 ]; then
    parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} "$@"
