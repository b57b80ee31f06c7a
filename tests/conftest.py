"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI") == "true"

# A pytest-xdist worker starts with COLUMNS=80 and LINES=24 in its environment (execnet
# sets them), and a rich Console made at import time then keeps 80 columns for good: a
# test that asks for a wide terminal (`env={"COLUMNS": ...}`) would get wrapped text on a
# worker and whole lines in one process. A worker's environment is made the same as the
# serial run's, before any kvstage module is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


def require_engine(backend: str) -> None:
    """Skip a hardware test when the engine cannot be imported — but never in CI,
    where the engines are installed and a missing one is a failure."""
    from kvstage.hw.transport.base import probe_engine

    why = probe_engine(backend)
    if why is None:
        return
    if IN_CI:
        pytest.fail(f"{backend} must be importable in CI: {why}")
    pytest.skip(f"{backend} engine not importable here: {why}")


def require_triton() -> None:
    """Skip a test of the write tag's Triton kernel (run by Triton's CPU interpreter) when
    Triton is not installed, but never in CI, where the dev extra pins it."""
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        return
    if IN_CI:
        pytest.fail("triton must be importable in CI (the dev extra pins it)")
    pytest.skip("triton is not installed here (the dev extra pins it)")


def start_by_hand(cmd: list[str], log: Path):
    """A rank a test starts by hand (`python -m kvstage.hw.rank.main ...`, what `kvstage
    hw-rank` runs), its output appended to `log`: forked from this process's fork server
    (hw/launch/forkserver.py, torch already imported) as the launcher forks its ranks, or
    spawned where it would be ($KVSTAGE_RANK_START=spawn, a fork server that cannot start).
    A subprocess.Popen or a ForkedProcess: pid, poll, wait, kill."""
    from kvstage.hw.launch.forkserver import start_rank

    forked = start_rank(cmd, dict(os.environ), log)
    if forked is not None:
        return forked
    with log.open("a") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


# --- scheduling: scripts/test.sh runs the suite on pytest-xdist workers --------------------
# (`-n N --dist loadgroup --no-loadscope-reorder`: one test at a time to whichever worker is
# free, in the order below, except that tests of one xdist_group run on one worker, one after
# the other). Nothing here changes what a test asserts.
_SHARED_SCOPES = ("module", "package", "session")


def _module_fixture_group(item: pytest.Item) -> str | None:
    """The module's name where the test uses a fixture of module scope or wider that its
    own module defines: the module's tests then run on one worker and the fixture is made
    once, not once per worker (a conftest's session fixtures are cheap and excepted)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    module = getattr(item, "module", None)
    for name in info.names_closure:
        for fixdef in info.name2fixturedefs.get(name, ()):
            if fixdef.scope in _SHARED_SCOPES and module is not None:
                if getattr(fixdef.func, "__module__", None) == module.__name__:
                    return module.__name__
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = _module_fixture_group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):  # an xdist worker (a serial run keeps the files' order)
        # Longest first (the `slow` mark), so that no long test starts last and runs alone
        # at the end; the order is otherwise the collection's (a stable sort).
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
