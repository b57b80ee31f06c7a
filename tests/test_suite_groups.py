"""The suite's own scheduling: tests of one `xdist_group` run on one worker.

scripts/test.sh runs the suite with `-n 2 --dist loadgroup`; tests/conftest.py groups the
tests of a module whose module-scope fixtures are expensive, and tests/test_netns.py's
two-namespace runs share the group "netns" (one such run at a time). pytest-xdist 3.8.0
honours a group by renaming the test's id to `ID@GROUP`, which pytest 9.2.0 no longer
lets it do: there every group was silently ignored (found 2026-12-04). This runs a tiny
suite the same way and checks that the grouped tests shared a worker.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

TINY = """
import pytest

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    pass

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
"""


def test_tests_of_one_xdist_group_run_on_one_worker(tmp_path):
    (tmp_path / "test_tiny.py").write_text(TINY)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's configuration
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2"]
        + ["--dist", "loadgroup", "--no-loadscope-reorder", "-v", "test_tiny.py"],
        cwd=tmp_path,
        # the inner run is its own: none of this run's options or worker identity
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = re.findall(r"\[(gw\d+)\] .*PASSED test_tiny\.py::(test_\w+)\[(\d)\]", proc.stdout)
    assert len(ran) == 12, proc.stdout
    grouped = {worker for worker, name, _ in ran if name == "test_grouped"}
    assert len(grouped) == 1, f"the group ran on {sorted(grouped)}:\n{proc.stdout}"
