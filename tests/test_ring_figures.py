"""Ring figures that mean one thing: live bytes (written, not yet freed; never above the
pool) and reservations (regions handed out; overcommit lets them exceed the pool)."""

from __future__ import annotations

from pathlib import Path

from kvstage.metrics.rooms import ring_figures, ring_series, summarize
from kvstage.shared.scenario import load_scenario
from kvstage.shared.trace import TraceRecord
from kvstage.sim.driver import simulate

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def _write(
    t0: float, t1: float, room: int, chunk: int, nbytes: int, decode: int = 0, writer: int = 0
) -> TraceRecord:
    return TraceRecord(
        "prefill",
        writer,
        "write",
        t0,
        t1,
        room=room,
        chunk=chunk,
        writer=writer,
        peer=decode,
        offset=0,
        bytes=nbytes,
        requests=1,
    )


def _decode(phase: str, t: float, room: int, chunk: int, used: int, nbytes: int = 0) -> TraceRecord:
    return TraceRecord(
        "decode", 0, phase, t, t, room=room, chunk=chunk, offset=0, bytes=nbytes, ring_used=used
    )


def test_live_bytes_by_hand():
    """Two writers' blocks land (live 2 x 10), the region is freed (live 0); the next
    round's region was reserved over them (reserved 40 > a 30-byte pool)."""
    records = [
        _decode("req", 0.0, 1, 0, used=20),
        _decode("req", 0.5, 2, 0, used=40),  # overcommit: reserved over bytes still live
        _write(1.0, 2.0, 1, 0, 10, writer=0),
        _write(1.0, 3.0, 1, 0, 10, writer=1),
        _decode("scatter", 3.5, 1, 0, used=40),
        _decode("free", 4.0, 1, 0, used=20, nbytes=20),
        _write(4.0, 4.5, 2, 0, 20),
        _write(4.2, 4.6, 1, 0, 10),  # a block landing after its region was freed is not live
        _decode("free", 5.0, 2, 0, used=0, nbytes=20),
    ]
    s = ring_series(records)[0]
    assert s.live == [(2.0, 10), (3.0, 20), (4.0, 0), (4.5, 20), (5.0, 0)]
    assert s.reserved_peak == 40 and s.live_peak == 20
    assert ring_figures(records, 30) == {
        "ring_live_peak_bytes": 20,
        "ring_live_peak_fraction": 20 / 30,
        "ring_reserved_peak_bytes": 40,
        "ring_reserved_peak_fraction": 40 / 30,
    }


def test_overcommitting_run_live_never_above_the_pool():
    s = load_scenario(
        ROOT / "scenarios" / "llama3-8b-p4-d2.toml",
        overrides=["workload.requests=16", "workload.rate_per_s=40", "decode.staging_pool_mb=512"],
    )
    result = simulate(s)
    assert not result.violations
    series = ring_series(result.records)
    assert sorted(series) == [0, 1]
    for rank in series.values():
        assert rank.live and rank.reserved
        assert all(0 <= v <= s.pool_bytes for _, v in rank.live)
        assert rank.live[-1][1] == 0  # every landed byte freed at the end
        assert rank.reserved_peak > s.pool_bytes  # the ring overcommitted
    summary = summarize(result.records, mode="sim", pool_bytes=s.pool_bytes, requests=16)
    assert 0 < summary["ring_live_peak_fraction"] <= 1 < summary["ring_reserved_peak_fraction"]
    assert "ring_peak_bytes" not in summary  # one meaning per key


def test_slice_path_has_no_live_bytes():
    s = load_scenario(
        ROOT / "scenarios" / "llama3-8b-p4-d2.toml",
        overrides=["workload.requests=4", "transfer.path=slice"],
    )
    result = simulate(s)
    figures = ring_figures(result.records, s.pool_bytes)
    assert figures["ring_live_peak_bytes"] == 0 and figures["ring_reserved_peak_bytes"] == 0
