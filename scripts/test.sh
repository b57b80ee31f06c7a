#!/usr/bin/env bash
# The test command: set up (idempotent) and run the whole suite, on
# $KVSTAGE_TEST_WORKERS pytest-xdist workers (3 unless set: one more than CI's 2 cores,
# for the CPU that hardware tests leave idle while their ranks start and wait; tests of
# one xdist_group on one worker, `slow` tests first: tests/conftest.py); 0 runs it in
# this one process (docs/contributing.md). Tests marked `alone` run after the parallel part,
# with nothing beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
workers=${KVSTAGE_TEST_WORKERS:-3}
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ "$workers" = 0 ]; then
    exec "${pytest[@]}" "$@"
fi
# Tests marked `alone` (timing-dependent attacks) run after the parallel part, on their
# own. Exit status 5 of a part is "no test selected" (arguments chose only the other).
rc=0
"${pytest[@]}" -n "$workers" --dist loadgroup --no-loadscope-reorder -m "not alone" "$@" || rc=$?
rc_alone=0
if [ "$#" -gt 0 ]; then
    "${pytest[@]}" -m alone "$@" || rc_alone=$?
else
    # only the files that mark a test `alone`: collecting the whole tree again costs ~20 s
    mapfile -t alone_files < <(grep -l "pytest.mark.alone" tests/test_*.py || true)
    if [ "${#alone_files[@]}" -gt 0 ]; then
        "${pytest[@]}" -m alone "${alone_files[@]}" || rc_alone=$?
    else
        rc_alone=5
    fi
fi
if [ "$rc" = 5 ] && [ "$rc_alone" = 5 ]; then exit 5; fi
[ "$rc" = 5 ] && rc=0
[ "$rc_alone" = 5 ] && rc_alone=0
[ "$rc" != 0 ] && exit "$rc"
exit "$rc_alone"
