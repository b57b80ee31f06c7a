"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI") == "true"


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
