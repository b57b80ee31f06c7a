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


@pytest.fixture
def bench():
    """benchmarks/mooncake_inflight.py as a module: its raw framing and its trial."""
    require_engine("mooncake")
    spec = importlib.util.spec_from_file_location(
        "mooncake_inflight", REPO / "benchmarks" / "mooncake_inflight.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["mooncake_inflight"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("mooncake_inflight", None)


@pytest.mark.hw
@pytest.mark.timeout(60)
def test_a_write_checked_before_unregister_memory_lands_after_it(bench) -> None:
    import numpy as np
    from mooncake.engine import TransferEngine

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
    assert r["api_before_rc"] == 0 and r["api_before_landed"]  # the probe works
    assert r["first_half_in_s"] is not None  # the first half in memory before the call
    assert r["unregister_rc"] == 0 and not r["listed_after"]
    assert r["raw_new_status"] == "addr rejected"  # a new header is refused...
    assert r["api_after_rc"] != 0 and not r["api_after_landed"]
    assert r["landed_before"] == size // 2
    assert r["landed_after"] == size - size // 2  # ...the one checked before lands
    assert r["writer_status"] == "ok"


@pytest.mark.hw
@pytest.mark.timeout(60)
def test_a_deregistered_tensors_memory_stays_allocated_until_close(bench) -> None:
    """So the write above lands in memory the transport still holds, not in memory the
    process freed and gave to something else (hw/transport/base.py `deregister`): a
    request accepted while a 1 MiB tensor was registered with kvstage's Mooncake
    transport, its tensor deregistered and dropped, lands the rest of its body in the
    storage the transport kept, and the process goes on."""
    import gc
    import socket

    import torch

    from kvstage.hw.transport.base import make_transport

    size = 1 << 20
    t = make_transport("mooncake", "kvstage-retire", "cpu")
    try:
        block = torch.zeros(size, dtype=torch.uint8)
        region = t.register(block)
        rpc_port = int(t.session.rpartition(":")[2])
        port = int(bench.handshake(rpc_port)["tcp_data_port"])
        w = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            w.sendall(bench.HEADER.pack(size, region.addr, bench.WRITE | bench.V2))
            w.sendall(bytes([bench.BEFORE]) * (size // 2))
            assert bench._wait(lambda b=block: bool(b[size // 2 - 1] == bench.BEFORE)) is not None
            t.deregister(region)
            del block  # the transport's reference is the only one left
            gc.collect()
            kept = t._retired[region.addr]
            held = torch.empty(0, dtype=torch.uint8).set_(kept)
            assert held.data_ptr() == region.addr and held.numel() == size
            w.sendall(bytes([bench.AFTER]) * (size - size // 2))
            assert bench._status(w, 10.0) == "ok"
        finally:
            w.close()
        assert bool((held[size // 2 :] == bench.AFTER).all())  # landed in the kept storage
    finally:
        t.close()
    assert not t._retired  # released with the engine
