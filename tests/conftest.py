"""Shared test helpers."""

from __future__ import annotations

import os

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
