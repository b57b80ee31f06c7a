"""benchmarks/mooncake_inflight.py, once: on Mooncake's TCP transport a write whose
header was checked before `unregister_memory` still lands in full after it, while a new
request to the buffer is refused (docs/results/2026-12-04-mooncake-inflight.md). If a
Mooncake upgrade fences in-flight requests, this fails and the docs that rely on it
(docs/hardware-mode.md, docs/results/2026-12-04-write-cipher.md) need a new look."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import require_engine

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.hw
@pytest.mark.timeout(60)
def test_a_write_checked_before_unregister_memory_lands_after_it() -> None:
    require_engine("mooncake")
    import numpy as np
    from mooncake.engine import TransferEngine

    spec = importlib.util.spec_from_file_location(
        "mooncake_inflight", REPO / "benchmarks" / "mooncake_inflight.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules["mooncake_inflight"] = bench
    try:
        spec.loader.exec_module(bench)
        size = 1 << 18
        target = TransferEngine()
        assert target.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        buf = np.zeros(size + bench.PROBE_BYTES, dtype=np.uint8)
        prober = bench.Prober()
        try:
            r = bench.trial(target, prober, buf, size, size // 2, 0.0)
        finally:
            prober.close()
            del target
    finally:
        sys.modules.pop("mooncake_inflight", None)
    assert r["api_before_rc"] == 0 and r["api_before_landed"]  # the probe works
    assert r["first_half_in_s"] is not None  # the first half in memory before the call
    assert r["unregister_rc"] == 0 and not r["listed_after"]
    assert r["raw_new_status"] == "addr rejected"  # a new header is refused...
    assert r["api_after_rc"] != 0 and not r["api_after_landed"]
    assert r["landed_before"] == size // 2
    assert r["landed_after"] == size - size // 2  # ...the one checked before lands
    assert r["writer_status"] == "ok"
