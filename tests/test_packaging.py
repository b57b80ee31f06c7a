"""The installed import names claim nothing generic: kvstage.shared, not shared."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_generic_names_are_not_installed(tmp_path):
    for name in ("shared", "sim", "hw"):
        r = _run(f"import {name}", tmp_path)
        assert r.returncode != 0 and "No module named" in r.stderr, (
            f"`import {name}` worked outside the checkout"
        )


def test_kvstage_subpackages_import_from_anywhere(tmp_path):
    r = _run(
        "import kvstage.shared.ring, kvstage.sim.driver, kvstage.hw.rank.main, kvstage.cli; "
        "print(kvstage.shared.ring.StagingRing.__module__)",
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "kvstage.shared.ring"
